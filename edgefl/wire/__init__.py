"""The wire format, one package shared by device and coordinator; the specification is ``docs/protocol.md``.

One module per message family (``encode_x`` / ``decode_x``) on the bounded CBOR envelope (``cbor``).
"""
