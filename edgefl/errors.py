"""The error hierarchy of edgefl: one root, a few named subclasses with fields.

Errors crossing a module boundary are these, chained ``from exc``, so a boundary (an MQTT handler,
the CLI) catches ``EdgeflError`` and counts it by its ``reason``.
"""

from __future__ import annotations


class EdgeflError(Exception):
    """Root of all edgefl errors."""


class ConfigError(EdgeflError):
    """A profile (TOML) is invalid: ``problems`` lists each, e.g. ``"memory.cap_mb = 0: must be > 0"``."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems) if self.problems else "invalid configuration")


class Refusal(EdgeflError):
    """An input refused: ``reason`` is the label of ``rejected_total{reason}``, ``detail`` for people.

    The labels are :class:`edgefl.wire.reasons.Reason`'s values (``docs/protocol.md``, "Refusals").
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


class DecodeError(Refusal):
    """A message from the network could not be decoded or failed validation (``detail`` names the field)."""


class UpdateRejected(Refusal):
    """An update (at the coordinator), a global head or a live sample or label (at the device) was refused."""


class BudgetExceeded(EdgeflError):
    """A ``phase`` (``"train"``...) needing ``needed_bytes`` at its floor work size could not be admitted.

    ``available_bytes`` were left under ``cap - reserve`` at the request.
    """

    def __init__(self, phase: str, needed_bytes: int, available_bytes: int) -> None:
        self.phase = phase
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        super().__init__(
            f"phase {phase}: needs {needed_bytes} bytes, {available_bytes} bytes available under the cap"
        )


class TransportError(EdgeflError):
    """The MQTT transport failed (connect refused, publish timed out, not connected): ``detail`` says how."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class BrokerRefused(TransportError):
    """The broker answered a publish (PUBACK) or a subscription (SUBACK) with a failure reason code.

    ``topic``: the topic or filter refused; ``code``: the reason code (MQTT 5.0 §2.4: 0x87 Not
    authorized is an ACL's; 3.1.1 has only SUBACK 0x80 Failure and drops a refused publish silently).
    """

    def __init__(self, detail: str, topic: str, code: int) -> None:
        self.topic = topic
        self.code = code
        super().__init__(detail)


class CredentialsRefused(TransportError):
    """The broker refused our credentials ``attempts`` times in a row (CONNACK 0x86/0x87).

    The agent exits with code 5, the coordinator (at the first refusal) with 1; the unit restarts
    neither. ``detail`` names the broker, the reason code and what to check.
    """

    def __init__(self, detail: str, attempts: int) -> None:
        self.attempts = attempts
        super().__init__(detail)


class CertificateNotTrusted(CredentialsRefused):
    """The broker's TLS certificate failed verification ``attempts`` times in a row (exit code 5 too).

    ``detail`` names the broker, the verification error and what to check.
    """


class StartupError(EdgeflError):
    """A resource the agent needs at start-up is unavailable; ``detail`` names the profile key involved."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class ModelError(EdgeflError):
    """The model file ``path`` is missing, corrupt, or not the shape the profile expects (``detail``)."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}")
