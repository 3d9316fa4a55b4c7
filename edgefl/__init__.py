"""edgefl: federated last-layer training for small ARM gateways.

The installed distribution claims this one import name. Layout (one home per contract):

- ``edgefl.wire``         the wire format: messages, ``Reason``, bounded CBOR, typed arrays, compression,
                          chunking, signing (specified in ``docs/protocol.md``)
- ``edgefl.agent``        the device: its round core, store, trainer, memory governor, daemon
- ``edgefl.coordinator``  rounds, strategies, aggregation, the global head
- ``edgefl.dashboard``    the aiohttp pages served by agent and coordinator
- ``edgefl.cross_build``  the offline wheelhouse builder for ARM gateways
- neutral modules shared by device and coordinator: ``errors``, ``types``, ``validators``, ``aio``,
  ``topics``, ``transport`` (paho bridged into asyncio), ``records`` (the atomic writer), ``runtime``
  (the LiteRT backbone), ``head`` (the head's maths), ``datasets``, ``resources`` (shipped files)
- ``edgefl.cli``          the composition root above device, coordinator and dashboard

In a source checkout ``edgefl/agent`` etc. are symlinks to the top-level folders the design names;
an installed wheel maps them with ``package_dir`` (setup.cfg).
"""

__version__ = "0.1.0"
