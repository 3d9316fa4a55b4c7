"""The error hierarchy of edgefl: one root, a few named subclasses with fields.

Every error raised across a module boundary is one of these, chained with ``from exc`` to the
low-level cause, so a caller can catch ``EdgeflError`` at a boundary (an MQTT handler, the CLI) and
count it by its ``reason``.
"""

from __future__ import annotations


class EdgeflError(Exception):
    """Root of all edgefl errors."""


class ConfigError(EdgeflError):
    """A device profile (TOML) is invalid.

    Parameters
    ----------
    problems : list[str]
        Every problem found, each naming the dotted key, its value and the reason, e.g.
        ``"memory.cap_mb = 0: must be > 0"``. All problems are reported at once.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems) if self.problems else "invalid configuration")


class DecodeError(EdgeflError):
    """A message from the network could not be decoded or failed validation.

    Parameters
    ----------
    reason : str
        A short machine-readable label used as the ``reason`` of ``rejected_total{reason}``
        (e.g. ``"too_large"``, ``"bad_cbor"``, ``"unknown_key"``, ``"bad_shape"``, ``"not_finite"``).
    detail : str
        A human-readable explanation naming the offending field.
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


class UpdateRejected(EdgeflError):
    """An update (at the coordinator), a global head or a live sample or label (at the device) was refused.

    Parameters
    ----------
    reason : str
        Machine-readable label (``"stale_round"``, ``"duplicate"``, ``"bad_shape"``, ...).
    detail : str
        Human-readable explanation.
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


class BudgetExceeded(EdgeflError):
    """A phase could not be admitted under the memory cap, even at its smallest work size.

    Parameters
    ----------
    phase : str
        The phase name (``"train"``, ``"inference"``, ...).
    needed_bytes : int
        Estimated bytes the phase would need at its floor work size.
    available_bytes : int
        Bytes left under ``cap - reserve`` at the time of the request.
    """

    def __init__(self, phase: str, needed_bytes: int, available_bytes: int) -> None:
        self.phase = phase
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        super().__init__(
            f"phase {phase}: needs {needed_bytes} bytes, {available_bytes} bytes available under the cap"
        )


class TransportError(EdgeflError):
    """The MQTT transport failed (connect refused, publish timed out, not connected).

    Parameters
    ----------
    detail : str
        Human-readable explanation.
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class CredentialsRefused(TransportError):
    """The broker refused the agent's credentials ``attempts`` times in a row (CONNACK 0x86/0x87).

    A wrong password does not fix itself: the agent exits with code 5, which the unit does not restart.

    Parameters
    ----------
    detail : str
        Human-readable explanation (broker, reason code, what to check).
    attempts : int
        Refused connection attempts in a row.
    """

    def __init__(self, detail: str, attempts: int) -> None:
        self.attempts = attempts
        super().__init__(detail)


class StartupError(EdgeflError):
    """A resource the agent needs at start-up is unavailable (e.g. the dashboard's port is in use).

    Parameters
    ----------
    detail : str
        Human-readable explanation naming the profile key involved.
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class ModelError(EdgeflError):
    """A model file is missing, corrupt, or not the shape the profile expects.

    Parameters
    ----------
    path : str
        The model file path.
    detail : str
        Human-readable explanation.
    """

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}")
