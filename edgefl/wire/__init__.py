"""The wire format, one package shared by device and coordinator; the specification is ``docs/protocol.md``.

- ``cbor``         the envelope (``"v"``, ``"type"``), ``Limits``, the bounded pre-scan, field readers
- ``arrays``       RFC 8746 typed arrays
- ``compression``  the delta layouts, written once, and their sizes on the wire
- ``rounds``       RoundAnnouncement, Update, Decline: ``encode_x`` / ``decode_x`` (so every message module)
- ``global_model`` GlobalModel and its head layouts
- ``status``       DeviceStatus
- ``partial``      Partial, a site's contribution sent up to the root
- ``ingest``       Sample, Label, Prediction
- ``presence``     a coordinator's heartbeat
- ``chunking``     chunks under the broker's packet limit, bounded reassembly
- ``signing``      Ed25519 over the canonical signed bytes (fleet, kind, round, version, device)
- ``reasons``      ``Reason``: every refusal's label
"""
