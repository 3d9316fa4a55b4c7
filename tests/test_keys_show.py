"""``edgefl keys show`` on a file that holds no key says what it holds, not "a broken private key"."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import _ca, _write

from edgefl.cli import main


def test_keys_show_a_certificate_is_named_as_neither_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "ca.pem", _ca("edgefl test CA")[0])
    assert main(["keys", "show", str(tmp_path / "ca.pem")]) == 1
    assert capsys.readouterr().err == (
        f"edgefl keys: {tmp_path / 'ca.pem'}: not an Ed25519 key: a PEM 'CERTIFICATE' block; expected "
        "'PRIVATE KEY' or 'PUBLIC KEY' (PKCS #8 / SPKI, RFC 8410)\n"
    )
    (tmp_path / "short").write_text("abcd\n")
    assert main(["keys", "show", str(tmp_path / "short")]) == 1
    assert capsys.readouterr().err == (
        f"edgefl keys: {tmp_path / 'short'}: not an Ed25519 key: 4 hex digits; "
        "an Ed25519 key is 64 (32 bytes)\n"
    )


def test_keys_show_a_public_key_of_another_algorithm_gets_the_public_keys_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pub = ec.generate_private_key(ec.SECP256R1()).public_key()
    pem = pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "p256.pub").write_bytes(pem)
    assert main(["keys", "show", str(tmp_path / "p256.pub")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"edgefl keys: {tmp_path / 'p256.pub'}: public key: PEM 'PUBLIC KEY' is not an Ed25519 key"
    )
