"""edgefl device agent: LiteRT inference, on-device head training, federated rounds over MQTT."""

if __name__ != "edgefl.agent":  # the checkout's folder is not a second module
    raise ImportError(f"{__name__}: import edgefl.agent (setup.cfg maps agent/ under edgefl)")
