"""edgefl: federated last-layer training for small ARM gateways.

The installed distribution claims this one import name. Layout (one home per contract):

- ``edgefl.wire``         the wire format: messages, ``Reason``, bounded CBOR, typed arrays, compression,
                          chunking, signing (specified in ``docs/protocol.md``)
- ``edgefl.agent``        the device: its round core, store, trainer, memory governor, daemon
- ``edgefl.coordinator``  rounds, strategies, aggregation, the global head
- ``edgefl.dashboard``    the aiohttp pages served by agent and coordinator
- neutral modules shared by device and coordinator: ``errors``, ``types``, ``validators``, ``aio``,
  ``topics``, ``transport`` (paho bridged into asyncio), ``records`` (the atomic writer), ``runtime``
  (the LiteRT backbone), ``head`` (the head's maths), ``datasets``, ``resources`` (shipped files)
- ``edgefl.cli``          the composition root above device, coordinator and dashboard, with
  ``evaluation`` (the coordinator's central evaluation through the device's pipeline), ``launcher``
  (agent processes, as the unit runs them) and ``demo`` (``edgefl demo``)

``edgefl.agent``, ``edgefl.coordinator`` and ``edgefl.dashboard`` live in the top-level folders the
design names (``agent/``...); setup.cfg's ``package_dir`` maps them under ``edgefl`` in the wheel and in
the editable install alike, so each module has one name.
"""

__version__ = "0.1.0"
