"""edgefl coordinator: rounds, client selection and aggregation of updates."""

if __name__ != "edgefl.coordinator":  # the checkout's folder is not a second module
    raise ImportError(f"{__name__}: import edgefl.coordinator (setup.cfg maps coordinator/ under edgefl)")
