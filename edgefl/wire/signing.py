"""Message authenticity: Ed25519 signatures over a canonical byte string that binds the message's context.

Signing, verification before decoding and keys (64 hex digits or PKCS #8 / SPKI PEM); the layout:
``docs/protocol.md`` ("Signatures"). The arithmetic is PyNaCl's, imported at the first signature.
Source: RFC 8032 §5.1 (Ed25519); RFC 8410 §7, §10 (Ed25519 keys in PKCS #8 / SPKI); RFC 8949
§4.2.1 (deterministic encoding).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import logging
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import cbor2

from edgefl.errors import DecodeError
from edgefl.wire.cbor import DEFAULT_LIMITS, NO_LIMITS, SCHEMA_VERSION, Limits, MessageType, Scanned, scan
from edgefl.wire.reasons import Reason

logger = logging.getLogger(__name__)

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
    MessageType.PRESENCE: "seq",
}
#: Kinds whose signed bytes bind the sender (device or site) the topic names, and its key in the message.
_SENDER_KEYS: Final[Mapping[MessageType, str]] = {
    MessageType.UPDATE: "device",
    MessageType.DECLINE: "device",
    MessageType.PARTIAL: "site",
}
_SIGNED_TAIL: Final = b"\x69signature\x58\x40"  # CBOR text "signature", then a 64-byte string's head
_PKCS8_PREFIX: Final = bytes.fromhex("302e020100300506032b657004220420")  # RFC 8410 §10.3
_SPKI_PREFIX: Final = bytes.fromhex("302a300506032b6570032100")  # RFC 8410 §10.1
_HEX_RE: Final = re.compile(r"[0-9a-fA-F]{64}")
_PEM_RE: Final = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END \1-----", re.DOTALL)


@dataclass(frozen=True, slots=True)
class VerifyKey:
    """An Ed25519 public key: ``raw``, 32 bytes (RFC 8032 §5.1.5); ValueError otherwise."""

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
    """An Ed25519 private key: ``seed``, 32 bytes (RFC 8032 §5.1.5; ValueError otherwise).

    Its ``repr`` shows the public key only.
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


class _Nacl:
    """PyNaCl's Ed25519 (libsodium ``crypto_sign``), imported at first use (memory paid only if used)."""

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


@functools.cache
def _backend() -> _Nacl:
    try:
        return _Nacl()
    except ImportError as exc:
        raise RuntimeError(f"no Ed25519 library: PyNaCl cannot be imported ({exc}); {INSTALL_HINT}") from exc


INSTALL_HINT: Final = "pip install 'edgefl[security]' (or apt-get install python3-nacl)"


def library_problem(setting: str) -> str | None:
    """Why the key a profile's dotted ``setting`` configures cannot be used here (no PyNaCl), or None."""
    try:
        _backend()
    except RuntimeError:
        return (
            f"{setting}: a key is configured but the Ed25519 library (PyNaCl) cannot be imported; "
            f"{INSTALL_HINT}"
        )
    return None


def generate_signing_key() -> SigningKey:
    """A new random signing key (``os.urandom``); :func:`write_key_pair` stores it."""
    return SigningKey(os.urandom(32))


_PEM_LABELS: Final = {"private key": "PRIVATE KEY", "public key": "PUBLIC KEY"}
_ED25519_OID: Final = bytes.fromhex("06032b6570")  # 1.3.101.112, RFC 8410 §3


def _decode_text(text: str, prefix: bytes, kind: str) -> bytes:
    """The 32 key bytes of ``text`` (64 hex digits or a PEM block); errors never quote the key."""
    text = text.strip()
    if _HEX_RE.fullmatch(text):
        return bytes.fromhex(text)
    if not text:
        raise ValueError(f"{kind}: empty; expected 64 hex digits or a PEM block")
    m = _PEM_RE.search(text)
    if m is None:
        if re.fullmatch(r"[0-9a-fA-F]+", text):
            raise ValueError(f"{kind}: {len(text)} hex digits; an Ed25519 key is 64 (32 bytes)")
        if "-----BEGIN" in text:
            raise ValueError(f"{kind}: a PEM block without its matching -----END line")
        raise ValueError(f"{kind}: expected 64 hex digits or a PEM block (-----BEGIN ...-----)")
    label, wanted = m.group(1), _PEM_LABELS[kind]
    if label != wanted:
        if label == "ENCRYPTED PRIVATE KEY":
            why = "an encrypted key; edgefl reads unencrypted PKCS #8 (openssl pkey -in KEY -out PLAIN.key)"
        elif label == "PUBLIC KEY":
            why = "a PUBLIC KEY where the private key belongs"
        elif label == "PRIVATE KEY":
            why = (
                "a PRIVATE KEY where a public key belongs; give its public half "
                "(edgefl keys show KEY, or openssl pkey -in KEY -pubout)"
            )
        else:
            why = f"a PEM {label!r} block; expected {wanted!r} (PKCS #8 / SPKI, RFC 8410)"
        raise ValueError(f"{kind}: {why}")
    try:
        der = base64.b64decode("".join(m.group(2).split()), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{kind}: the PEM block is not valid base64") from exc
    if len(der) != len(prefix) + 32 or not der.startswith(prefix):
        algorithm = "an Ed25519 key of another layout" if _ED25519_OID in der else "not an Ed25519 key"
        raise ValueError(
            f"{kind}: PEM {label!r} is {algorithm} (expected RFC 8410's, as edgefl keys generate and "
            "openssl genpkey -algorithm ed25519 write)"
        )
    return der[len(prefix) :]


def parse_signing_key(text: str) -> SigningKey:
    """Parse a private key's text: 64 hex digits (the seed) or PKCS #8 PEM ``PRIVATE KEY``.

    ValueError saying what the text is instead (a public key, an encrypted or non-Ed25519 PEM block, a
    wrong number of hex digits), never quoting key material. Source: RFC 8410 §7, §10.3.
    """
    return SigningKey(_decode_text(text, _PKCS8_PREFIX, "private key"))


def parse_verify_key(text: str) -> VerifyKey:
    """Parse a public key (profile value or ``.pub`` text): 64 hex digits or SPKI PEM ``PUBLIC KEY``.

    ValueError as :func:`parse_signing_key`. Source: RFC 8410 §4, §10.1.
    """
    return VerifyKey(_decode_text(text, _SPKI_PREFIX, "public key"))


def _pem(label: str, der: bytes) -> str:
    b64 = base64.b64encode(der).decode("ascii")
    lines = [b64[i : i + 64] for i in range(0, len(b64), 64)]
    return "\n".join([f"-----BEGIN {label}-----", *lines, f"-----END {label}-----"]) + "\n"


def private_pem(key: SigningKey) -> str:
    """The private key as PKCS #8 PEM, as openssl writes it (RFC 8410 §7, §10.3; RFC 7468 §10)."""
    return _pem("PRIVATE KEY", _PKCS8_PREFIX + key.seed)


def public_pem(key: VerifyKey) -> str:
    """The public key as SubjectPublicKeyInfo PEM (RFC 8410 §4, §10.1; RFC 7468 §13)."""
    return _pem("PUBLIC KEY", _SPKI_PREFIX + key.raw)


def write_key_pair(directory: Path, name: str) -> tuple[Path, Path, SigningKey]:
    """Generate a key pair: ``<name>.key`` (PKCS #8 PEM, mode 0600) and ``<name>.pub`` (SPKI PEM).

    The private key file is owner-only from its creation (``O_EXCL``) and fsynced; ``directory`` is
    created (0700) if missing; ``name`` is a file stem (a device id, ``coordinator``, a site). Returns
    the two paths and the key. FileExistsError if either file exists (nothing is written); OSError if
    the folder or a file cannot be written; ValueError if ``name`` is empty or holds a path separator.
    """
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"key name {name!r}: a file stem, without '/'")
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    for path in (private, public):
        if path.exists():
            raise FileExistsError(f"{path} exists: not replaced (rotate keys on purpose: docs/security.md)")
    key = generate_signing_key()
    for path, text, mode in ((private, private_pem(key), 0o600), (public, public_pem(key.verify_key), 0o644)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed the public key's mode
            os.write(fd, text.encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
    return private, public, key


MAX_KEY_FILE_BYTES = 16 * 1024
"""Largest key file read; a larger or special file (``/dev/zero``, a fifo) is refused unread."""


def read_key_text(path: Path, what: str) -> str:
    """The text of a key file, read only if it is a regular file of at most :data:`MAX_KEY_FILE_BYTES`.

    OSError if it cannot be read; ValueError if it is not a regular file, too large, or not ASCII.
    """
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: {what}: not a regular file")
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"{path}: {what}: over {MAX_KEY_FILE_BYTES} bytes, not a key file")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: {what}: not a text file (64 hex digits or PEM)") from None


_K = TypeVar("_K", SigningKey, VerifyKey)


def _load_key(path: Path, what: str, parse: Callable[[str], _K]) -> _K:
    """``parse`` of the key file's text; a ValueError names the path, never the content."""
    text = read_key_text(path, what)
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def load_signing_key(path: Path) -> SigningKey:
    """Load a private key file (:func:`parse_signing_key`); warn if others can read it.

    OSError if it cannot be read; ValueError (naming the path, never the content) without a key.
    """
    mode = Path(path).stat().st_mode
    key = _load_key(path, "private key", parse_signing_key)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "private key %s is accessible by group/others (mode %o); chmod 600 it", path, mode & 0o777
        )
    return key


def load_verify_key(path: Path) -> VerifyKey:
    """Load a public key file (:func:`parse_verify_key`); OSError or ValueError as above."""
    return _load_key(path, "public key", parse_verify_key)


def load_verify_keys(directory: Path) -> dict[str, VerifyKey]:
    """Every ``<device>.pub`` of a directory by device id: the key ring (OSError, ValueError)."""
    return {
        p.name[:-4]: load_verify_key(p)
        for p in sorted(Path(directory).iterdir())
        if p.name.endswith(".pub") and p.is_file()
    }


def signed_bytes(*, fleet: str, kind: str, round: int, version: int, device: str, digest: bytes) -> bytes:
    """The bytes a signature covers: ``CONTEXT || CBOR([fleet, kind, round, version, device, digest])``.

    Each item as in ``docs/protocol.md`` ("Signatures"); ``digest`` is the blank form's SHA-256.
    Source: RFC 8949 §4.2.1 (deterministic encoding).
    """
    return CONTEXT + cbor2.dumps([fleet, str(kind), int(round), int(version), device, bytes(digest)])


def is_signed(payload: bytes) -> bool:
    """Whether ``payload`` ends with a 64-byte ``"signature"`` entry (not whether it is valid)."""
    n = len(_SIGNED_TAIL) + SIGNATURE_BYTES
    return len(payload) > n and bytes(payload[-n:-SIGNATURE_BYTES]) == _SIGNED_TAIL


def unsigned_form(payload: bytes) -> bytes:
    """The blank form of a signed payload (its signature bytes as :data:`PLACEHOLDER`); else ``unsigned``."""
    if not is_signed(payload):
        raise DecodeError(Reason.UNSIGNED, "no 64-byte signature as the message's last entry")
    return bytes(payload[:-SIGNATURE_BYTES]) + PLACEHOLDER


def _signed_header(found: Mapping[str, int | str]) -> tuple[int, str, int, int, str]:
    """``(v, type, round, version, device)``: the signed fields among a message's top-level header values."""
    schema, kind = found.get("v"), found.get("type")
    if type(schema) is not int:
        raise DecodeError(Reason.BAD_VERSION, "v: missing or not an unsigned integer")
    if type(kind) is not str:
        raise DecodeError(Reason.MISSING_KEY, "type")
    version_key = SIGNED_KINDS.get(kind)  # type: ignore[call-overload]  # a StrEnum key: text finds it
    if version_key is None:
        raise DecodeError(Reason.WRONG_TYPE, f"type = {kind[:40]!r}: not a signed message type")
    round_ = 0 if kind == MessageType.PRESENCE else found.get("round")  # a Presence signs round 0
    version = found.get(version_key)
    if type(round_) is not int or type(version) is not int:
        raise DecodeError(Reason.MISSING_KEY, f"round or {version_key}: missing or not unsigned integers")
    sender_key = _SENDER_KEYS.get(kind)  # type: ignore[call-overload]
    device = found.get(sender_key, "") if sender_key is not None else ""
    return schema, kind, round_, version, device if type(device) is str else ""


def sign_payload(blank: bytes, key: SigningKey, *, fleet: str) -> bytes:
    """Sign a blank form (a message encoded with :data:`PLACEHOLDER` as its last entry) for ``fleet``.

    Returns the message with the signature in place of the placeholder. ValueError if ``blank`` does
    not end with the placeholder, is of another schema, is not a signed kind, or lacks its round or
    version.
    """
    if not is_signed(blank) or bytes(blank[-SIGNATURE_BYTES:]) != PLACEHOLDER:
        raise ValueError(
            "the message must end with a 64-byte zero 'signature' placeholder (signature=PLACEHOLDER)"
        )
    try:
        schema, kind, round_, version, device = _signed_header(scan(bytes(blank), NO_LIMITS).header)
    except DecodeError as exc:
        raise ValueError(f"cannot sign this message: {exc}") from exc
    if schema != SCHEMA_VERSION:
        raise ValueError(f"a signed message is written as schema {SCHEMA_VERSION}, not {schema}")
    digest = hashlib.sha256(blank).digest()
    signed = signed_bytes(fleet=fleet, kind=kind, round=round_, version=version, device=device, digest=digest)
    return bytes(blank[:-SIGNATURE_BYTES]) + _backend().sign(key.seed, signed)


_M = TypeVar("_M")


def sign_message(encode: Callable[[_M], bytes], msg: _M, key: SigningKey, *, fleet: str) -> bytes:
    """Encode ``msg`` once with the placeholder signature and sign it for ``fleet``: the bytes to publish.

    ``encode`` (e.g. ``encode_global_model``) is called exactly once, so stochastic rounding is signed
    as sent; ``msg`` is a message dataclass with a ``signature`` field. ValueError as :func:`sign_payload`.
    """
    blank: Any = dataclasses.replace(msg, signature=PLACEHOLDER)  # type: ignore[type-var]
    return sign_payload(encode(blank), key, fleet=fleet)


def verify_payload(
    payload: bytes | Scanned,
    key: VerifyKey,
    *,
    fleet: str,
    kind: MessageType | str,
    device: str = "",
    limits: Limits = DEFAULT_LIMITS,
) -> None:
    """Check a payload's signature against ``key`` and the context it arrived in, before decoding it.

    ``payload`` may be its :func:`~edgefl.wire.cbor.scan`; ``fleet`` is this peer's; ``kind`` the type
    the topic carries; ``device`` the device (for a Partial, the site) the topic names, for the kinds
    that bind a sender; ``limits`` bound the header scan. DecodeError ``unsigned`` or ``bad_signature``
    (each case: ``docs/protocol.md``, "Signatures"; the detail says which); ValueError if ``kind`` is
    not signed, or binds a sender and ``device`` is empty.
    """
    expected = MessageType(kind)
    if expected not in SIGNED_KINDS:
        raise ValueError(f"{expected.value} messages are not signed")
    if expected in _SENDER_KEYS and not device:
        raise ValueError(f"verifying a {expected.value} needs the device (or site) its topic names")
    data = payload.data if isinstance(payload, Scanned) else payload
    blank = unsigned_form(data)
    header = payload.header if isinstance(payload, Scanned) else None
    try:
        schema, kind, round_, version, sender = _signed_header(
            header if header is not None else scan(blank, limits).header
        )
    except DecodeError as exc:
        raise DecodeError(Reason.BAD_SIGNATURE, f"signed fields unreadable ({exc})") from exc
    if schema != SCHEMA_VERSION:
        # the claim is unauthenticated until verified, and this peer only verifies its own schema
        detail = f"v = {min(schema, 10**6)}: not schema {SCHEMA_VERSION}, cannot verify it"
        raise DecodeError(Reason.BAD_SIGNATURE, detail)
    wanted_device = device if expected in _SENDER_KEYS else ""
    digest = hashlib.sha256(blank).digest()
    message = signed_bytes(
        fleet=fleet, kind=expected.value, round=round_, version=version, device=wanted_device, digest=digest
    )
    if _backend().verify(key.raw, bytes(data[-SIGNATURE_BYTES:]), message):
        return
    if kind != expected.value:
        why = f"a {kind[:40]!r} message where {expected.value!r} is expected"
    elif sender != wanted_device:
        why = f"update of device {sender[:64]!r} received as {wanted_device!r}"
    else:
        why = f"does not verify for fleet {fleet!r} with key {key.hex[:12]}…"
    raise DecodeError(Reason.BAD_SIGNATURE, f"Ed25519 signature: {why}")
