"""Message authenticity: Ed25519 signatures over the exact wire bytes of a message.

What is signed
--------------
Every signed message (GlobalModel, RoundAnnouncement, Update) is a CBOR map whose *last* entry is
``"signature"`` with a byte string value; ``edgefl.wire.codec`` encodes it that way. The signer encodes the
message once with ``signature = h''`` (the *unsigned form* ``U``, which ends with the bytes
``69 "signature" 40``) and signs::

    CONTEXT || U        with CONTEXT = the 13 ASCII bytes "edgefl-sig-v1" and a zero byte

then puts the 64-byte signature in place of the empty byte string (``... 69 "signature" 58 40 <sig>``).
The verifier reverses that on the bytes it received, before decoding anything: it needs no
canonical re-encoding (an int8 or top-k update does not survive decode → encode byte for byte), and
a forged message is refused before it costs a decode. The context prefix keeps these signatures
from being valid for any other protocol that might use the same key.

Keys
----
A signing key is the 32-byte Ed25519 seed; a verify key is the 32-byte public key. Both load from
64 hex digits or from PEM (PKCS #8 ``PRIVATE KEY`` / SubjectPublicKeyInfo ``PUBLIC KEY``, as written
by ``openssl genpkey -algorithm ed25519``). A :class:`SigningKey`'s ``repr`` shows only its public key:
private keys never reach a log.

Backends
--------
Ed25519 (RFC 8032) is deterministic, so both supported libraries produce identical signatures.
``PyNaCl`` (libsodium, ~1.2 MB of RSS at import) is preferred when installed, ``cryptography``
(bundled OpenSSL, ~8.6 MB of RSS at import) otherwise; both are imported lazily, on the first
signature operation.

Source: RFC 8032 §5.1 (Ed25519); RFC 8410 §7, §10.3 (Ed25519 keys in PKCS #8 / SPKI).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

from edgefl.errors import DecodeError

logger = logging.getLogger(__name__)

__all__ = [
    "CONTEXT",
    "SIGNATURE_BYTES",
    "SIGNATURE_REASONS",
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
    "unsigned_form",
    "verify_payload",
]

CONTEXT: Final = b"edgefl-sig-v1\x00"
#: ``DecodeError.reason`` values raised here (``rejected_total{reason}`` labels).
SIGNATURE_REASONS: Final = frozenset({"unsigned", "bad_signature"})
SIGNATURE_BYTES: Final = 64
_KEY: Final = b"\x69signature"  # CBOR text string "signature"
_EMPTY_TAIL: Final = _KEY + b"\x40"  # "signature": h''
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


class _Nacl:
    name = "pynacl"

    def __init__(self) -> None:
        import nacl.exceptions
        import nacl.signing

        self._signing = nacl.signing
        self._bad = nacl.exceptions.BadSignatureError

    def public(self, seed: bytes) -> bytes:
        return bytes(self._signing.SigningKey(seed).verify_key)

    def sign(self, seed: bytes, message: bytes) -> bytes:
        return bytes(self._signing.SigningKey(seed).sign(message).signature)

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

    def public(self, seed: bytes) -> bytes:
        return bytes(
            self._ed.Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(*self._raw)
        )

    def sign(self, seed: bytes, message: bytes) -> bytes:
        return bytes(self._ed.Ed25519PrivateKey.from_private_bytes(seed).sign(message))

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


def is_signed(payload: bytes) -> bool:
    """Whether ``payload`` ends with a 64-byte ``"signature"`` entry (not whether it is valid)."""
    n = len(_SIGNED_TAIL) + SIGNATURE_BYTES
    return len(payload) > n and bytes(payload[-n:-SIGNATURE_BYTES]) == _SIGNED_TAIL


def unsigned_form(payload: bytes) -> bytes:
    """The bytes a signature covers (without :data:`CONTEXT`): ``payload`` with ``"signature": h''``.

    Raises
    ------
    DecodeError
        ``unsigned`` if ``payload`` does not end with a 64-byte ``"signature"`` entry.
    """
    if not is_signed(payload):
        raise DecodeError("unsigned", "no 64-byte signature as the message's last entry")
    return bytes(payload[: -(2 + SIGNATURE_BYTES)]) + b"\x40"


def sign_payload(unsigned: bytes, key: SigningKey) -> bytes:
    """Sign an encoded message whose last entry is ``"signature": h''``.

    Parameters
    ----------
    unsigned : bytes
        The message encoded with an empty signature (``edgefl.wire.codec`` puts it last).
    key : SigningKey

    Returns
    -------
    bytes
        The same message with the 64-byte signature in place (``len(unsigned) + 65`` bytes).

    Raises
    ------
    ValueError
        If ``unsigned`` does not end with ``"signature": h''``.
    """
    if bytes(unsigned[-len(_EMPTY_TAIL) :]) != _EMPTY_TAIL:
        raise ValueError("the message must end with an empty 'signature' entry (encode with signature=b'')")
    signature = _backend().sign(key.seed, CONTEXT + bytes(unsigned))
    return bytes(unsigned[:-1]) + b"\x58\x40" + signature


_M = TypeVar("_M")


def sign_message(encode: Callable[[_M], bytes], msg: _M, key: SigningKey) -> bytes:
    """Encode ``msg`` once with an empty signature and sign it: the bytes to publish.

    Parameters
    ----------
    encode : callable
        The codec encoder, e.g. ``encode_global_model`` or ``lambda m: encode_update(m, rng=...)``
        (called exactly once, so stochastic rounding is signed as sent).
    msg : GlobalModel, RoundAnnouncement or Update
        A dataclass with a ``signature`` field (replaced by ``b""`` before encoding).
    key : SigningKey

    Returns
    -------
    bytes
        The signed payload.

    Raises
    ------
    ValueError
        If the encoder does not put ``"signature"`` last.
    """
    blank: Any = dataclasses.replace(msg, signature=b"")  # type: ignore[type-var]
    return sign_payload(encode(blank), key)


def verify_payload(payload: bytes, key: VerifyKey) -> None:
    """Check a payload's signature against ``key``, before decoding it.

    Parameters
    ----------
    payload : bytes
        The received message.
    key : VerifyKey
        The sender's public key (the coordinator's, or the device named by the topic).

    Raises
    ------
    DecodeError
        ``unsigned`` (no 64-byte signature as the last entry, e.g. a message from an old or hostile
        sender), ``bad_signature`` (wrong key, or any byte changed).
    """
    unsigned = unsigned_form(payload)
    signature = bytes(payload[-SIGNATURE_BYTES:])
    if not _backend().verify(key.raw, signature, CONTEXT + unsigned):
        raise DecodeError("bad_signature", f"Ed25519 signature does not verify with key {key.hex[:12]}…")
