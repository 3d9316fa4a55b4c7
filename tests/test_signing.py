"""Ed25519 message signatures: good ones accepted, wrong key / tampered / missing rejected."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

import cbor2
import numpy as np
import pytest

from edgefl.errors import DecodeError
from edgefl.wire import signing
from edgefl.wire.compression import Compression
from edgefl.wire.global_model import GlobalModel, decode_global_model, encode_global_model
from edgefl.wire.rounds import (
    RoundAnnouncement,
    Update,
    UpdateMetrics,
    decode_round,
    decode_update,
    encode_round,
    encode_update,
)
from edgefl.wire.signing import (
    CONTEXT,
    PLACEHOLDER,
    SigningKey,
    VerifyKey,
    is_signed,
    load_signing_key,
    load_verify_key,
    load_verify_keys,
    parse_signing_key,
    parse_verify_key,
    private_pem,
    public_pem,
    sign_message,
    sign_payload,
    signed_bytes,
    unsigned_form,
    verify_payload,
)
from edgefl.wire.status import DeviceStatus, encode_status

# RFC 8032 §7.1, TEST 1 (empty message)
RFC_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
RFC_SIGNATURE = bytes.fromhex(
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
)
SHA = "ab" * 32
FLEET = "f1"
GM, ROUND, UPDATE = "global_model", "round", "update"
# RFC 8410 §10.3 and §10.1: an Ed25519 private key in PKCS #8 PEM and its public key in SPKI PEM
RFC8410_PRIVATE_PEM = (
    "-----BEGIN PRIVATE KEY-----\n"
    "MC4CAQAwBQYDK2VwBCIEINTuctv5E1hK1bbY8fdp+K06/nwoy/HU++CXqI9EdVhC\n"
    "-----END PRIVATE KEY-----\n"
)
RFC8410_PUBLIC_PEM = (
    "-----BEGIN PUBLIC KEY-----\n"
    "MCowBQYDK2VwAyEAGb9ECWmEzf6FQbrBZ9w7lshQhqowtrbLDFw4rXAxZuE=\n"
    "-----END PUBLIC KEY-----\n"
)
RFC8410_SEED = bytes.fromhex("d4ee72dbf913584ad5b6d8f1f769f8ad3afe7c28cbf1d4fbe097a88f44755842")
RFC8410_PUBLIC = bytes.fromhex("19bf44096984cdfe8541bac167dc3b96c85086aa30b6b6cb0c5c38ad703166e1")


def make_update() -> Update:
    rng = np.random.default_rng(1)
    return Update(
        round=4,
        base_version=3,
        device="dev-2",
        num_examples=20,
        delta_W=rng.standard_normal((16, 4)).astype(np.float32),
        delta_b=rng.standard_normal(4).astype(np.float32),
        metrics=UpdateMetrics(0.7, 0.8, 0.02, 1 << 20),
        update_id="dev-2:4:3",
        compression=Compression.INT8,
    )


def make_round() -> RoundAnnouncement:
    return RoundAnnouncement(4, 3, 30.0, 2, 0.1, 16, 2, ("dev-1", "dev-2"))


def test_sign_rfc8032_test_vector() -> None:
    impl = signing._backend()
    assert impl.public(RFC_SEED) == RFC_PUBLIC
    assert impl.sign(RFC_SEED, b"") == RFC_SIGNATURE
    assert impl.verify(RFC_PUBLIC, RFC_SIGNATURE, b"")
    assert not impl.verify(RFC_PUBLIC, RFC_SIGNATURE, b"x")


def test_sign_good_signature_accepted_for_every_signed_message() -> None:
    key = SigningKey(RFC_SEED)
    gm = GlobalModel(2, 3, SHA, np.ones((16, 4), np.float32), np.zeros(4, np.float32))
    payload = sign_message(encode_global_model, gm, key, fleet=FLEET)
    assert len(payload) == len(encode_global_model(gm)) + 65 and is_signed(payload)
    verify_payload(payload, key.verify_key, fleet=FLEET, kind=GM)
    got = decode_global_model(payload, expect_shape=(16, 4))
    assert len(got.signature) == 64 and got.version == 3 and np.array_equal(got.W, gm.W)

    ann = make_round()
    payload = sign_message(encode_round, ann, key, fleet=FLEET)
    verify_payload(payload, key.verify_key, fleet=FLEET, kind=ROUND)
    assert decode_round(payload).selected == ("dev-1", "dev-2")

    # int8 with stochastic rounding: encoded once, signed as sent; no re-encoding on either side
    rng = np.random.default_rng(7)
    payload = sign_message(lambda m: encode_update(m, rng=rng), make_update(), key, fleet=FLEET)
    verify_payload(payload, key.verify_key, fleet=FLEET, kind=UPDATE, device="dev-2")
    assert decode_update(payload, expect_shape=(16, 4)).update_id == "dev-2:4:3"


def test_sign_signed_bytes_are_the_canonical_context_string() -> None:
    key = SigningKey(RFC_SEED)
    ann = make_round()
    blank = encode_round(dataclasses.replace(ann, signature=PLACEHOLDER))
    payload = sign_payload(blank, key, fleet=FLEET)
    assert unsigned_form(payload) == blank
    assert payload[:-64] == blank[:-64] and payload[-66:-64] == b"\x58\x40"
    assert cbor2.loads(payload)["v"] == 1  # signed or not, every message is schema 1
    digest = hashlib.sha256(blank).digest()
    # CONTEXT || CBOR [fleet, kind, round, version, device, sha256(blank)], written out by hand
    by_hand = (
        b"edgefl-sig-v2\x00"
        + b"\x86"  # array of 6
        + b"\x62f1"  # "f1"
        + b"\x65round"  # "round"
        + b"\x04\x03"  # round 4, base_version 3
        + b"\x60"  # no device
        + b"\x58\x20"
        + digest
    )
    assert by_hand[:15] == CONTEXT + b"\x86"
    assert signed_bytes(fleet=FLEET, kind=ROUND, round=4, version=3, device="", digest=digest) == by_hand
    assert signing._backend().verify(RFC_PUBLIC, payload[-64:], by_hand)
    # signing a message that already carries a signature signs its blank form (same result)
    assert sign_message(encode_round, decode_round(payload), key, fleet=FLEET) == payload


def test_sign_wrong_key_rejected() -> None:
    payload = sign_message(encode_round, make_round(), SigningKey(RFC_SEED), fleet=FLEET)
    other = SigningKey(bytes(32)).verify_key
    with pytest.raises(DecodeError) as info:
        verify_payload(payload, other, fleet=FLEET, kind=ROUND)
    assert info.value.reason == "bad_signature"
    # an attacker re-signing a hostile global head with their own key is refused the same way
    hostile = GlobalModel(9, 99, SHA, np.full((16, 4), 1e3, np.float32), np.zeros(4, np.float32))
    forged = sign_message(encode_global_model, hostile, SigningKey(b"\x01" * 32), fleet=FLEET)
    with pytest.raises(DecodeError, match="bad_signature"):
        verify_payload(forged, SigningKey(RFC_SEED).verify_key, fleet=FLEET, kind=GM)


def test_sign_tampered_byte_anywhere_rejected() -> None:
    key = SigningKey(RFC_SEED)
    payload = sign_message(encode_round, make_round(), key, fleet=FLEET)
    for i in range(len(payload)):
        for flip in (0x01, 0x80):
            bad = bytearray(payload)
            bad[i] ^= flip
            with pytest.raises(DecodeError) as info:
                verify_payload(bytes(bad), key.verify_key, fleet=FLEET, kind=ROUND)
            assert info.value.reason in ("bad_signature", "unsigned"), i
    # changing a value through CBOR (a cleverer tamper) is refused too
    obj = cbor2.loads(payload)
    obj["lr"] = 10.0
    with pytest.raises(DecodeError, match="bad_signature"):
        verify_payload(cbor2.dumps(obj), key.verify_key, fleet=FLEET, kind=ROUND)


def test_sign_missing_signature_rejected() -> None:
    key = SigningKey(RFC_SEED).verify_key
    unsigned = encode_round(make_round())
    for payload in (
        unsigned,  # signature = h''
        unsigned[:-1] + b"\x58\x3f" + b"s" * 63,  # 63 bytes
        cbor2.dumps({k: v for k, v in cbor2.loads(unsigned).items() if k != "signature"}),
        b"",
        b"\x69signature\x58\x40" + b"s" * 64,  # nothing but the tail
    ):
        with pytest.raises(DecodeError) as info:
            verify_payload(payload, key, fleet=FLEET, kind=ROUND)
        assert info.value.reason == "unsigned"


def test_sign_refuses_messages_without_a_trailing_signature_entry() -> None:
    status = encode_status(DeviceStatus("dev-1", "online", {}))
    with pytest.raises(ValueError, match="zero 'signature' placeholder"):
        sign_payload(status, SigningKey(RFC_SEED), fleet=FLEET)


def test_sign_keys_parse_hex_and_pem(tmp_path: Path) -> None:
    # RFC 8410's PEM examples read as the RFC says, and written back byte for byte
    assert parse_signing_key(RFC8410_PRIVATE_PEM).seed == RFC8410_SEED
    assert parse_signing_key(RFC8410_PRIVATE_PEM).verify_key.raw == RFC8410_PUBLIC
    assert parse_verify_key(RFC8410_PUBLIC_PEM).raw == RFC8410_PUBLIC
    assert private_pem(SigningKey(RFC8410_SEED)) == RFC8410_PRIVATE_PEM
    assert public_pem(VerifyKey(RFC8410_PUBLIC)) == RFC8410_PUBLIC_PEM
    # a PEM block on one line (a --set value) and hex in either case
    assert parse_verify_key(" ".join(RFC8410_PUBLIC_PEM.split("\n"))).raw == RFC8410_PUBLIC
    assert parse_signing_key(RFC_SEED.hex().upper() + "\n").seed == RFC_SEED
    assert parse_verify_key(RFC_PUBLIC.hex()) == VerifyKey(RFC_PUBLIC)
    assert SigningKey(RFC_SEED).verify_key.hex == RFC_PUBLIC.hex()
    with pytest.raises(ValueError, match="32 bytes"):
        VerifyKey(b"short")
    keys = tmp_path / "device_keys"
    keys.mkdir()
    (keys / "dev-1.pub").write_text(RFC_PUBLIC.hex() + "\n")
    (keys / "dev-2.pub").write_text(RFC8410_PUBLIC_PEM)
    (keys / "README").write_text("not a key")
    assert load_verify_keys(keys) == {"dev-1": VerifyKey(RFC_PUBLIC), "dev-2": VerifyKey(RFC8410_PUBLIC)}
    assert load_verify_key(keys / "dev-1.pub").raw == RFC_PUBLIC


# an X25519 private key (RFC 8410 §10.3's layout with OID 1.3.101.110) and an RSA public key header
X25519_PEM = (
    "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VuBCIEINTuctv5E1hK1bbY8fdp+K06/nwoy/HU++CXqI9EdVhC\n"
    "-----END PRIVATE KEY-----\n"
)


@pytest.mark.parametrize(
    ("parse", "text", "why"),
    [
        (parse_verify_key, RFC8410_PRIVATE_PEM, "a PRIVATE KEY where a public key belongs; give its"),
        (parse_signing_key, RFC8410_PUBLIC_PEM, "a PUBLIC KEY where the private key belongs"),
        (parse_signing_key, RFC8410_PRIVATE_PEM.replace("PRIVATE", "ENCRYPTED PRIVATE"), "an encrypted key"),
        (parse_signing_key, X25519_PEM, "PEM 'PRIVATE KEY' is not an Ed25519 key"),
        (parse_verify_key, RFC8410_PUBLIC_PEM.replace("PUBLIC KEY", "RSA PUBLIC KEY"), "a PEM 'RSA PUBL"),
        (parse_verify_key, RFC8410_PUBLIC_PEM.replace("MCow", "MCo*"), "not valid base64"),
        (parse_verify_key, RFC8410_PUBLIC_PEM.rsplit("-----END", 1)[0], "without its matching -----END"),
        (parse_signing_key, RFC_SEED.hex()[:-2], "62 hex digits; an Ed25519 key is 64"),
        (parse_signing_key, "   ", "empty"),
        (parse_verify_key, "ssh-ed25519 AAAAC3Nza", "expected 64 hex digits or a PEM block"),
    ],
)
def test_sign_key_errors_say_what_the_text_is_never_quoting_it(
    parse: object, text: str, why: str
) -> None:
    assert callable(parse)
    with pytest.raises(ValueError) as info:
        parse(text)
    message = str(info.value)
    assert why in message
    assert message.split(":")[0] in ("private key", "public key")
    for secret in (RFC_SEED.hex()[:16], "INTuctv5E1hK1bbY8fdp", "AyEAGb9ECWmEzf6F"):
        assert secret not in message


def test_sign_keys_write_key_pair_pem_0600_never_replaced(tmp_path: Path) -> None:
    private, public, key = signing.write_key_pair(tmp_path / "keys", "gw-7")
    assert (private.name, public.name) == ("gw-7.key", "gw-7.pub")
    assert private.stat().st_mode & 0o777 == 0o600
    assert public.stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----\n")
    assert load_signing_key(private) == key
    assert load_verify_keys(tmp_path / "keys") == {"gw-7": key.verify_key}
    before = private.read_bytes()
    with pytest.raises(FileExistsError, match=r"gw-7\.key exists: not replaced"):
        signing.write_key_pair(tmp_path / "keys", "gw-7")
    assert private.read_bytes() == before
    with pytest.raises(ValueError, match="without '/'"):
        signing.write_key_pair(tmp_path, "a/b")


def test_sign_private_key_never_logged_or_shown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = SigningKey(RFC_SEED)
    assert RFC_SEED.hex() not in repr(key) and RFC_PUBLIC.hex() in repr(key)
    path = tmp_path / "device.key"
    path.write_text(RFC_SEED.hex())
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="edgefl.wire.signing"):
        assert load_signing_key(path) == key
    assert "chmod 600" in caplog.text
    path.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgefl.wire.signing"):
        load_signing_key(path)
    assert caplog.text == ""
    bad = tmp_path / "bad.key"
    bad.write_text(RFC_SEED.hex()[:-1] + "z")
    bad.chmod(0o600)
    with pytest.raises(ValueError) as info:
        load_signing_key(bad)
    assert RFC_SEED.hex()[:20] not in str(info.value) and "bad.key" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


# ----------------------------------------------------------------------------------------------
# Forgeries: the signed bytes bind fleet, kind, round, version and (for updates) the device


def test_forgery_head_signed_for_fleet_f1_fails_on_fleet_f2() -> None:
    key = SigningKey(RFC_SEED)
    gm = GlobalModel(2, 3, SHA, np.ones((16, 4), np.float32), np.zeros(4, np.float32))
    payload = sign_message(encode_global_model, gm, key, fleet="f1")
    verify_payload(payload, key.verify_key, fleet="f1", kind=GM)
    with pytest.raises(DecodeError) as info:
        verify_payload(payload, key.verify_key, fleet="f2", kind=GM)
    assert info.value.reason == "bad_signature"
    assert "fleet 'f2'" in info.value.detail


def test_forgery_update_signed_for_device_a_fails_as_device_b() -> None:
    key = SigningKey(RFC_SEED)  # even with one key shared by both devices
    payload = sign_message(encode_update, make_update(), key, fleet=FLEET)  # device "dev-2"
    verify_payload(payload, key.verify_key, fleet=FLEET, kind=UPDATE, device="dev-2")
    with pytest.raises(DecodeError) as info:
        verify_payload(payload, key.verify_key, fleet=FLEET, kind=UPDATE, device="dev-1")
    assert info.value.reason == "bad_signature"
    assert "device 'dev-2' received as 'dev-1'" in info.value.detail
    with pytest.raises(ValueError, match="needs the device"):
        verify_payload(payload, key.verify_key, fleet=FLEET, kind=UPDATE)


def test_forgery_round_announcement_replayed_as_global_head() -> None:
    key = SigningKey(RFC_SEED)
    payload = sign_message(encode_round, make_round(), key, fleet=FLEET)
    with pytest.raises(DecodeError) as info:
        verify_payload(payload, key.verify_key, fleet=FLEET, kind=GM)
    assert info.value.reason == "bad_signature"
    assert "'round' message where 'global_model' is expected" in info.value.detail
    with pytest.raises(ValueError, match="not signed"):
        verify_payload(payload, key.verify_key, fleet=FLEET, kind="status")


def test_forgery_round_or_version_changed_after_signing() -> None:
    key = SigningKey(RFC_SEED)
    gm = GlobalModel(2, 3, SHA, np.ones((16, 4), np.float32), np.zeros(4, np.float32))
    payload = sign_message(encode_global_model, gm, key, fleet=FLEET)
    obj = cbor2.loads(payload)
    for field, value in (("version", 1), ("round", 7)):  # a rollback or a replay into another round
        changed = dict(obj, **{field: value})
        with pytest.raises(DecodeError) as info:
            verify_payload(cbor2.dumps(changed), key.verify_key, fleet=FLEET, kind=GM)
        assert info.value.reason == "bad_signature", field


def test_forgery_signature_over_the_raw_encoding_is_refused() -> None:
    # a signature over CONTEXT' || the encoding itself (not over the canonical signed bytes)
    key = SigningKey(RFC_SEED)
    unsigned = encode_round(make_round())
    assert cbor2.loads(unsigned)["v"] == 1
    other = signing._backend().sign(key.seed, b"edgefl-sig-v1\x00" + unsigned)
    payload = unsigned[:-1] + b"\x58\x40" + other
    with pytest.raises(DecodeError) as info:
        verify_payload(payload, key.verify_key, fleet=FLEET, kind=ROUND)
    assert info.value.reason == "bad_signature"
    assert "does not verify" in info.value.detail
    # and a signer refuses to sign a message of another schema
    blank = cbor2.loads(encode_round(dataclasses.replace(make_round(), signature=PLACEHOLDER)))
    blank["v"] = 2
    with pytest.raises(ValueError, match="schema 1, not 2"):
        sign_payload(cbor2.dumps(blank), key, fleet=FLEET)


def test_forgery_signed_fields_unreadable_or_newer_schema() -> None:
    key = SigningKey(RFC_SEED)
    sig = b"s" * 64
    cases = {
        # no round: the signed bytes cannot be rebuilt
        cbor2.dumps(
            {"v": 2, "type": "round", "base_version": 1, "signature": sig}
        ): "signed fields unreadable",
        # a status is never signed
        cbor2.dumps({"v": 2, "type": "status", "round": 1, "signature": sig}): "signed fields unreadable",
        # a negative version is not an unsigned integer
        cbor2.dumps(
            {"v": 2, "type": "round", "round": 1, "base_version": -1, "signature": sig}
        ): "unreadable",
        # malformed CBOR before the signature entry
        b"\xa3\x61v\x02\xff" + b"\x69signature\x58\x40" + sig: "unreadable",
        # a newer schema: unauthenticated until verified, and this peer cannot verify it
        cbor2.dumps(
            {"v": 5, "type": "round", "round": 1, "base_version": 1, "signature": sig}
        ): "not schema 1",
    }
    for payload, detail in cases.items():
        with pytest.raises(DecodeError) as info:
            verify_payload(payload, key.verify_key, fleet=FLEET, kind=ROUND)
        assert info.value.reason == "bad_signature" and detail in info.value.detail, info.value.detail
    with pytest.raises(ValueError, match="cannot sign this message"):
        sign_payload(cbor2.dumps({"v": 2, "type": "round", "signature": PLACEHOLDER}), key, fleet=FLEET)
