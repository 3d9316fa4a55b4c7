"""edgefl device agent: LiteRT inference, on-device head training, federated rounds over MQTT."""
