"""edgefl coordinator: rounds, client selection and aggregation of updates."""
