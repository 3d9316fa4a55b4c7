"""Message authenticity: Ed25519 signatures over a canonical byte string that binds the message's context.

Owns the signed-bytes layout (:func:`signed_bytes`), signing (:func:`sign_message`,
:func:`sign_payload`), verification before decoding (:func:`verify_payload`) and Ed25519 keys. A signed
message carries its 64-byte signature as the value of its last key, ``"signature"``, and is schema 2;
the signature covers::

    "edgefl-sig-v2" 0x00 || CBOR([fleet, kind, round, version, device, SHA-256(blank form)])

where the blank form is the message with 64 zero bytes as its signature. The verifier rebuilds it from
its own fleet, the kind its topic carries and the device the topic names, with round and version read
by the allocation-free header scan, so a head signed for another fleet, a round announcement replayed
as a head or an update signed for another device fails. Layout and examples: ``docs/protocol.md``
("Signatures"); key rotation: ``docs/security.md``.

Keys are 32-byte Ed25519 seeds / public keys, as 64 hex digits or PEM (PKCS #8 ``PRIVATE KEY`` /
SPKI ``PUBLIC KEY``, as written by ``openssl genpkey -algorithm ed25519``); a :class:`SigningKey`'s
``repr`` shows only its public key. Ed25519 is deterministic, so the two supported libraries give
identical signatures: PyNaCl (~1.2 MB of RSS at import) is preferred, ``cryptography`` (~8.6 MB) the
fallback; both are imported lazily, on the first signature operation.

Source: RFC 8032 §5.1 (Ed25519); RFC 8410 §7, §10.3 (Ed25519 keys in PKCS #8 / SPKI); RFC 8949
§4.2.1 (deterministic encoding).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import logging
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import cbor2

from edgefl.errors import DecodeError
from edgefl.wire.cbor import (
    DEFAULT_LIMITS,
    NO_LIMITS,
    SCHEMA_VERSION,
    SIGNED_SCHEMA_VERSION,
    Limits,
    MessageType,
    prescan,
)
from edgefl.wire.reasons import SIGNATURE_REASONS, Reason

logger = logging.getLogger(__name__)

__all__ = [
    "CONTEXT",
    "PLACEHOLDER",
    "SIGNATURE_BYTES",
    "SIGNATURE_REASONS",
    "SIGNED_KINDS",
    "SIGNED_SCHEMA_VERSION",
    "SigningKey",
    "VerifyKey",
    "backend_name",
    "generate_signing_key",
    "is_signed",
    "load_signing_key",
    "load_verify_key",
    "load_verify_keys",
    "parse_signing_key",
    "parse_verify_key",
    "set_backend",
    "sign_message",
    "sign_payload",
    "signed_bytes",
    "unsigned_form",
    "verify_payload",
]

CONTEXT: Final = b"edgefl-sig-v2\x00"
SIGNATURE_BYTES: Final = 64
#: What the signature bytes hold while the blank form is encoded and hashed.
PLACEHOLDER: Final = bytes(SIGNATURE_BYTES)
#: The signed kinds, each with the key holding its version.
SIGNED_KINDS: Final[Mapping[MessageType, str]] = {
    MessageType.GLOBAL_MODEL: "version",
    MessageType.ROUND: "base_version",
    MessageType.UPDATE: "base_version",
    MessageType.DECLINE: "base_version",
    MessageType.PARTIAL: "base_version",
}
#: Kinds whose signed bytes bind the sender the topic names, and the key naming it in the message:
#: a device (Update, Decline) or a site (Partial).
_SENDER_KEYS: Final[Mapping[MessageType, str]] = {
    MessageType.UPDATE: "device",
    MessageType.DECLINE: "device",
    MessageType.PARTIAL: "site",
}
_KEY: Final = b"\x69signature"  # CBOR text string "signature"
_SIGNED_TAIL: Final = _KEY + b"\x58\x40"  # "signature": 64-byte string header
_PKCS8_PREFIX: Final = bytes.fromhex("302e020100300506032b657004220420")  # RFC 8410 §10.3
_SPKI_PREFIX: Final = bytes.fromhex("302a300506032b6570032100")  # RFC 8410 §10.1
_HEX_RE: Final = re.compile(r"[0-9a-fA-F]{64}")
_PEM_RE: Final = re.compile(r"-----BEGIN ([A-Z ]+)-----\s*([A-Za-z0-9+/=\s]+?)\s*-----END \1-----")


@dataclass(frozen=True, slots=True)
class VerifyKey:
    """An Ed25519 public key.

    Parameters
    ----------
    raw : bytes
        The 32-byte public key (RFC 8032 §5.1.5).

    Raises
    ------
    ValueError
        If ``raw`` is not 32 bytes.
    """

    raw: bytes

    def __post_init__(self) -> None:
        if len(self.raw) != 32:
            raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(self.raw)}")

    @property
    def hex(self) -> str:
        """The key as 64 lowercase hex digits (what a profile holds)."""
        return self.raw.hex()


@dataclass(frozen=True, slots=True)
class SigningKey:
    """An Ed25519 private key; its ``repr`` shows the public key only.

    Parameters
    ----------
    seed : bytes
        The 32-byte private seed (RFC 8032 §5.1.5).

    Raises
    ------
    ValueError
        If ``seed`` is not 32 bytes.
    """

    seed: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.seed) != 32:
            raise ValueError("an Ed25519 private key is 32 bytes")

    @property
    def verify_key(self) -> VerifyKey:
        """The matching public key."""
        return VerifyKey(_backend().public(self.seed))

    def __repr__(self) -> str:
        return f"SigningKey(public={self.verify_key.hex})"


# ---------------------------------------------------------------------------------------------------
# Backends (imported lazily: the agent pays their memory only when signatures are on)


class _Ed25519(Protocol):
    name: str

    def public(self, seed: bytes) -> bytes: ...
    def sign(self, seed: bytes, message: bytes) -> bytes: ...
    def verify(self, public: bytes, signature: bytes, message: bytes) -> bool: ...


#: Private keys a backend keeps expanded (a process signs with one key, a test with a few): making
#: one from its seed is a scalar multiplication, ~50 us, that every signature paid.
_KEYS_KEPT: Final = 4


def _kept(cache: dict[bytes, Any], seed: bytes, make: Callable[[bytes], Any]) -> Any:
    """The backend's key object for ``seed``, made once (at most :data:`_KEYS_KEPT` kept)."""
    key = cache.get(seed)
    if key is None:
        if len(cache) >= _KEYS_KEPT:
            cache.clear()
        key = cache[seed] = make(seed)
    return key


class _Nacl:
    name = "pynacl"

    def __init__(self) -> None:
        import nacl.exceptions
        import nacl.signing

        self._signing = nacl.signing
        self._bad = nacl.exceptions.BadSignatureError
        self._keys: dict[bytes, Any] = {}

    def public(self, seed: bytes) -> bytes:
        return bytes(_kept(self._keys, seed, self._signing.SigningKey).verify_key)

    def sign(self, seed: bytes, message: bytes) -> bytes:
        return bytes(_kept(self._keys, seed, self._signing.SigningKey).sign(message).signature)

    def verify(self, public: bytes, signature: bytes, message: bytes) -> bool:
        try:
            self._signing.VerifyKey(public).verify(message, signature)
        except (self._bad, ValueError):
            return False
        return True


class _Cryptography:
    name = "cryptography"

    def __init__(self) -> None:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric import ed25519
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._ed = ed25519
        self._bad = InvalidSignature
        self._raw = (Encoding.Raw, PublicFormat.Raw)
        self._keys: dict[bytes, Any] = {}

    def public(self, seed: bytes) -> bytes:
        key = _kept(self._keys, seed, self._ed.Ed25519PrivateKey.from_private_bytes)
        return bytes(key.public_key().public_bytes(*self._raw))

    def sign(self, seed: bytes, message: bytes) -> bytes:
        return bytes(_kept(self._keys, seed, self._ed.Ed25519PrivateKey.from_private_bytes).sign(message))

    def verify(self, public: bytes, signature: bytes, message: bytes) -> bool:
        try:
            self._ed.Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
        except (self._bad, ValueError):
            return False
        return True


_BACKENDS: Final[Mapping[str, Callable[[], _Ed25519]]] = {"pynacl": _Nacl, "cryptography": _Cryptography}
_choice = "auto"
_loaded: _Ed25519 | None = None


def set_backend(name: str) -> None:
    """Choose the Ed25519 library: ``"auto"`` (PyNaCl, else cryptography), ``"pynacl"`` or ``"cryptography"``.

    Raises
    ------
    ValueError
        If ``name`` is unknown.
    """
    global _choice, _loaded
    if name != "auto" and name not in _BACKENDS:
        raise ValueError(f"signing backend {name!r}: expected auto, pynacl or cryptography")
    _choice, _loaded = name, None


def _backend() -> _Ed25519:
    global _loaded
    if _loaded is None:
        names = list(_BACKENDS) if _choice == "auto" else [_choice]
        errors = []
        for name in names:
            try:
                _loaded = _BACKENDS[name]()
                break
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
        else:
            raise RuntimeError(
                "no Ed25519 library: install PyNaCl or cryptography (" + "; ".join(errors) + ")"
            )
        logger.debug("Ed25519 backend: %s", _loaded.name)
    return _loaded


INSTALL_HINT: Final = "pip install 'edgefl[security]'"
"""How to get an Ed25519 library (the ``security`` extra: PyNaCl)."""


def library_problem(setting: str) -> str | None:
    """Why a configured key ``setting`` cannot be used here, or None if an Ed25519 library imports.

    Profiles call it for every key they configure, so ``check-config``, ``edgefl run`` and
    ``edgefl coordinator`` refuse at load (exit 1) instead of failing at the first signed message.

    Parameters
    ----------
    setting : str
        The dotted profile key that configures a key, e.g. ``"security.coordinator_public_key"``.

    Returns
    -------
    str or None
        One line naming the setting and :data:`INSTALL_HINT`.
    """
    try:
        _backend()
    except RuntimeError:
        return (
            f"{setting}: a key is configured but no Ed25519 library (PyNaCl or cryptography) can be "
            f"imported; {INSTALL_HINT}"
        )
    return None


def backend_name() -> str:
    """Name of the Ed25519 library in use (imports it)."""
    return _backend().name


# ---------------------------------------------------------------------------------------------------
# Keys


def generate_signing_key() -> SigningKey:
    """A new random signing key (``os.urandom``); store ``key.seed.hex()`` in an owner-only (0600) file."""
    return SigningKey(os.urandom(32))


def _decode_text(text: str, prefix: bytes, kind: str) -> bytes:
    text = text.strip()
    if _HEX_RE.fullmatch(text):
        return bytes.fromhex(text)
    m = _PEM_RE.search(text)
    if m is None:
        raise ValueError(f"{kind}: expected 64 hex digits or a PEM block")
    try:
        der = base64.b64decode("".join(m.group(2).split()), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{kind}: PEM block is not valid base64") from exc
    if len(der) != len(prefix) + 32 or not der.startswith(prefix):
        raise ValueError(f"{kind}: PEM block {m.group(1)!r} is not an Ed25519 key (RFC 8410)")
    return der[len(prefix) :]


def parse_signing_key(text: str) -> SigningKey:
    """Parse a private key: 64 hex digits (the seed) or PKCS #8 PEM ``PRIVATE KEY``.

    Raises
    ------
    ValueError
        If the text is neither (the message never contains the key material).
    """
    return SigningKey(_decode_text(text, _PKCS8_PREFIX, "private key"))


def parse_verify_key(text: str) -> VerifyKey:
    """Parse a public key: 64 hex digits or SubjectPublicKeyInfo PEM ``PUBLIC KEY``.

    Raises
    ------
    ValueError
        If the text is neither.
    """
    return VerifyKey(_decode_text(text, _SPKI_PREFIX, "public key"))


def load_signing_key(path: Path) -> SigningKey:
    """Load a private key file (see :func:`parse_signing_key`); warn if others can read it.

    Raises
    ------
    OSError
        If the file cannot be read.
    ValueError
        If it holds no Ed25519 private key (the path is named, the content never).
    """
    path = Path(path)
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "private key %s is accessible by group/others (mode %o); chmod 600 it", path, mode & 0o777
        )
    try:
        return parse_signing_key(path.read_text(encoding="ascii"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: no Ed25519 private key ({type(exc).__name__})") from None


def load_verify_key(path: Path) -> VerifyKey:
    """Load a public key file (see :func:`parse_verify_key`).

    Raises
    ------
    OSError, ValueError
        If the file cannot be read or holds no Ed25519 public key.
    """
    path = Path(path)
    try:
        return parse_verify_key(path.read_text(encoding="ascii"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def load_verify_keys(directory: Path, suffix: str = ".pub") -> dict[str, VerifyKey]:
    """Load every ``<device>.pub`` of a directory: the coordinator's device key ring.

    Parameters
    ----------
    directory : Path
    suffix : str
        File name suffix; the rest of the name is the device id.

    Returns
    -------
    dict[str, VerifyKey]
        Device id -> public key.

    Raises
    ------
    OSError, ValueError
        If the directory or a key file cannot be read or parsed.
    """
    return {
        p.name[: -len(suffix)]: load_verify_key(p)
        for p in sorted(Path(directory).iterdir())
        if p.name.endswith(suffix) and p.is_file()
    }


# ---------------------------------------------------------------------------------------------------
# Signing and verification


def signed_bytes(*, fleet: str, kind: str, round: int, version: int, device: str, digest: bytes) -> bytes:
    """The canonical byte string a signature covers.

    Parameters
    ----------
    fleet : str
        Fleet the message is meant for (profile ``device.fleet``, coordinator ``--fleet``).
    kind : str
        Message type (``"global_model"``, ``"round"``, ``"update"``, ``"decline"``, ``"partial"``).
    round : int
        The message's ``round``, >= 0.
    version : int
        Its ``version`` (GlobalModel) or ``base_version`` (RoundAnnouncement, Update, Decline), >= 0.
    device : str
        The sending device for an Update or a Decline, the sending site for a Partial, ``""`` otherwise.
    digest : bytes
        SHA-256 of the blank form (32 bytes).

    Returns
    -------
    bytes
        ``CONTEXT || CBOR([fleet, kind, round, version, device, digest])``, deterministic encoding.

    Source: RFC 8949 §4.2.1 (deterministic encoding).
    """
    return CONTEXT + cbor2.dumps([fleet, str(kind), int(round), int(version), device, bytes(digest)])


def is_signed(payload: bytes) -> bool:
    """Whether ``payload`` ends with a 64-byte ``"signature"`` entry (not whether it is valid)."""
    n = len(_SIGNED_TAIL) + SIGNATURE_BYTES
    return len(payload) > n and bytes(payload[-n:-SIGNATURE_BYTES]) == _SIGNED_TAIL


def unsigned_form(payload: bytes) -> bytes:
    """The blank form of a signed payload: its 64 signature bytes replaced by :data:`PLACEHOLDER`.

    Raises
    ------
    DecodeError
        ``unsigned`` if ``payload`` does not end with a 64-byte ``"signature"`` entry.
    """
    if not is_signed(payload):
        raise DecodeError(Reason.UNSIGNED, "no 64-byte signature as the message's last entry")
    return bytes(payload[:-SIGNATURE_BYTES]) + PLACEHOLDER


@dataclass(frozen=True, slots=True)
class _Signed:
    schema: int
    kind: str
    round: int
    version: int
    device: str


def _signed_fields(blank: bytes, limits: Limits) -> _Signed:
    """Read v, type, round, version and device from the blank form's headers (nothing is decoded)."""
    found = prescan(blank, limits, ("v", "type", "round", "version", "base_version", "device", "site"))
    schema, kind = found.get("v"), found.get("type")
    if type(schema) is not int:
        raise DecodeError(Reason.BAD_VERSION, "v: missing or not an unsigned integer")
    if type(kind) is not str:
        raise DecodeError(Reason.MISSING_KEY, "type")
    version_key = SIGNED_KINDS.get(MessageType(kind)) if kind in set(MessageType) else None
    if version_key is None:
        raise DecodeError(Reason.WRONG_TYPE, f"type = {kind[:40]!r}: not a signed message type")
    round_, version = found.get("round"), found.get(version_key)
    if type(round_) is not int or type(version) is not int:
        raise DecodeError(Reason.MISSING_KEY, f"round or {version_key}: missing or not unsigned integers")
    sender_key = _SENDER_KEYS.get(MessageType(kind))
    device = found.get(sender_key, "") if sender_key is not None else ""
    return _Signed(schema, kind, round_, version, device if type(device) is str else "")


def sign_payload(blank: bytes, key: SigningKey, *, fleet: str) -> bytes:
    """Sign a blank form: a message encoded with :data:`PLACEHOLDER` as its (last) signature.

    Parameters
    ----------
    blank : bytes
        E.g. ``encode_round(replace(msg, signature=PLACEHOLDER))`` (schema 2, signature last).
    key : SigningKey
    fleet : str
        Fleet the message is meant for.

    Returns
    -------
    bytes
        The message with the signature in place of the placeholder (same length as ``blank``).

    Raises
    ------
    ValueError
        If ``blank`` does not end with the placeholder signature, is not a schema-2 (or 3) GlobalModel,
        RoundAnnouncement, Update or Partial, or lacks its round or version.
    """
    if not is_signed(blank) or bytes(blank[-SIGNATURE_BYTES:]) != PLACEHOLDER:
        raise ValueError(
            "the message must end with a 64-byte zero 'signature' placeholder (signature=PLACEHOLDER)"
        )
    try:
        fields = _signed_fields(bytes(blank), NO_LIMITS)
    except DecodeError as exc:
        raise ValueError(f"cannot sign this message: {exc}") from exc
    if not SIGNED_SCHEMA_VERSION <= fields.schema <= SCHEMA_VERSION:
        raise ValueError(
            f"a signed message is written as schema {SIGNED_SCHEMA_VERSION} to {SCHEMA_VERSION},"
            f" not {fields.schema}"
        )
    digest = hashlib.sha256(blank).digest()
    message = signed_bytes(
        fleet=fleet,
        kind=fields.kind,
        round=fields.round,
        version=fields.version,
        device=fields.device,
        digest=digest,
    )
    return bytes(blank[:-SIGNATURE_BYTES]) + _backend().sign(key.seed, message)


_M = TypeVar("_M")


def sign_message(encode: Callable[[_M], bytes], msg: _M, key: SigningKey, *, fleet: str) -> bytes:
    """Encode ``msg`` once with the placeholder signature and sign it: the bytes to publish.

    Parameters
    ----------
    encode : callable
        The encoder, e.g. ``encode_global_model`` or ``lambda m: encode_update(m, compressed=c)``
        (called exactly once, so stochastic rounding is signed as sent).
    msg : GlobalModel, RoundAnnouncement, Update or Partial
        A dataclass with a ``signature`` field (replaced by :data:`PLACEHOLDER` before encoding).
    key : SigningKey
    fleet : str
        Fleet the message is meant for (bound into the signed bytes).

    Returns
    -------
    bytes
        The signed payload.

    Raises
    ------
    ValueError
        As :func:`sign_payload` (e.g. an encoder that does not put ``"signature"`` last).
    """
    blank: Any = dataclasses.replace(msg, signature=PLACEHOLDER)  # type: ignore[type-var]
    return sign_payload(encode(blank), key, fleet=fleet)


def verify_payload(
    payload: bytes,
    key: VerifyKey,
    *,
    fleet: str,
    kind: MessageType | str,
    device: str = "",
    limits: Limits = DEFAULT_LIMITS,
) -> None:
    """Check a payload's signature against ``key`` and the context it arrived in, before decoding it.

    Parameters
    ----------
    payload : bytes
        The received message.
    key : VerifyKey
        The sender's public key (the coordinator's, or the device named by the topic).
    fleet : str
        This peer's fleet.
    kind : MessageType or str
        The type the topic carries (``global_model`` on ``global``, ``round`` on ``round``,
        ``update`` on ``update/<device>``).
    device : str
        For an Update, the device its topic names (for a Partial, the site); ignored for other kinds.
    limits : Limits
        Bounds of the header scan (the receiver's decoding limits).

    Raises
    ------
    DecodeError
        ``unsigned`` (no 64-byte signature as the last entry, e.g. a message from an old or hostile
        sender); ``bad_signature`` (wrong key, any byte changed, signed for another fleet, kind or
        device, a schema-1 signature, a schema newer than this peer's, or signed fields that cannot
        be read; the detail says which).
    ValueError
        If ``kind`` is not a signed kind, or is ``update`` (``partial``) without a ``device`` (site).
    """
    expected = MessageType(kind)
    if expected not in SIGNED_KINDS:
        raise ValueError(f"{expected.value} messages are not signed")
    if expected in _SENDER_KEYS and not device:
        raise ValueError(f"verifying a {expected.value} needs the device (or site) its topic names")
    blank = unsigned_form(payload)
    try:
        fields = _signed_fields(blank, limits)
    except DecodeError as exc:
        raise DecodeError(Reason.BAD_SIGNATURE, f"signed fields unreadable ({exc})") from exc
    if fields.schema > SCHEMA_VERSION:
        # the claim is unauthenticated until verified, and this peer only verifies schema-2 signatures
        detail = f"v = {min(fields.schema, 10**6)}: newer than schema {SCHEMA_VERSION}, cannot verify it"
        raise DecodeError(Reason.BAD_SIGNATURE, detail)
    if fields.schema < SIGNED_SCHEMA_VERSION:
        raise DecodeError(
            Reason.BAD_SIGNATURE, f"schema-{fields.schema} signature: the sender predates schema 2"
        )
    wanted_device = device if expected in _SENDER_KEYS else ""
    message = signed_bytes(
        fleet=fleet,
        kind=expected.value,
        round=fields.round,
        version=fields.version,
        device=wanted_device,
        digest=hashlib.sha256(blank).digest(),
    )
    if _backend().verify(key.raw, bytes(payload[-SIGNATURE_BYTES:]), message):
        return
    if fields.kind != expected.value:
        why = f"a {fields.kind[:40]!r} message where {expected.value!r} is expected"
    elif fields.device != wanted_device:
        why = f"update of device {fields.device[:64]!r} received as {wanted_device!r}"
    else:
        why = f"does not verify for fleet {fleet!r} with key {key.hex[:12]}…"
    raise DecodeError(Reason.BAD_SIGNATURE, f"Ed25519 signature: {why}")
