"""The wire format, one package shared by device and coordinator; the specification is ``docs/protocol.md``.

- ``cbor``         the envelope (``"v"``, ``"type"``), ``Limits``, the bounded pre-scan, field readers
- ``arrays``       RFC 8746 typed arrays
- ``compression``  the delta layouts, written once, and their sizes on the wire
- ``messages``     GlobalModel, RoundAnnouncement, Update, DeviceStatus: ``encode_x`` / ``decode_x``
- ``chunking``     chunks under the broker's packet limit, bounded reassembly
- ``signing``      Ed25519 over the canonical signed bytes (fleet, kind, round, version, device)
- ``reasons``      ``Reason``: every refusal's label
- ``codec``        re-exports of the above under the name used before the split
"""
