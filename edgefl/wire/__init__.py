"""The wire format, one package shared by device and coordinator; the specification is ``docs/protocol.md``.

One module per message family (``rounds``, ``global_model``, ``status``, ``partial``, ``ingest``,
``presence``, each with paired ``encode_x`` / ``decode_x``) on the bounded CBOR envelope (``cbor``),
typed arrays, delta compression, chunking, signing and ``Reason``, every refusal's label.
"""
