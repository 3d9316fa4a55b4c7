"""MQTT topic names of the edgefl contract (DESIGN.md, "MQTT contract"), shared by agent and coordinator."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic names under ``<prefix>/<fleet>/`` (``broker.topic_prefix``, ``device.fleet``)."""

    prefix: str
    fleet: str

    @property
    def base(self) -> str:
        """``<prefix>/<fleet>``."""
        return f"{self.prefix}/{self.fleet}"

    @property
    def global_model(self) -> str:
        """Retained GlobalModel, coordinator → devices."""
        return f"{self.base}/global"

    @property
    def round(self) -> str:
        """Retained RoundAnnouncement, coordinator → devices."""
        return f"{self.base}/round"

    @property
    def coordinator(self) -> str:
        """Retained Presence of the coordinator that runs the fleet (its lease); its last will clears it."""
        return f"{self.base}/coordinator"

    @property
    def coordinator_holder(self) -> str:
        """Retained Presence of the coordinator that last took the lease; no will clears it."""
        return f"{self.base}/coordinator/holder"

    def update(self, device: str) -> str:
        """Update of one device, device → coordinator (``"+"`` for the wildcard)."""
        return f"{self.base}/update/{device}"

    def status(self, device: str) -> str:
        """Retained DeviceStatus of one device (``"+"`` for the wildcard); last will is "offline"."""
        return f"{self.base}/status/{device}"

    def partial(self, site: str) -> str:
        """Partial of one site, site aggregator → root over a broker bridge (``"+"`` for the wildcard)."""
        return f"{self.base}/partial/{site}"

    def site_of(self, topic: str) -> str | None:
        """The ``<site>`` segment of a ``partial/<site>`` topic, else None."""
        return self._last_level(topic, ("partial",))

    def samples(self, device: str) -> str:
        """Samples for one device, gateway apps → device (live ingest; ``docs/protocol.md``, "Sample")."""
        return f"{self.base}/samples/{device}"

    def labels(self, device: str) -> str:
        """Late labels of earlier samples, gateway apps → device (``docs/protocol.md``, "Label")."""
        return f"{self.base}/labels/{device}"

    def predictions(self, device: str) -> str:
        """The device's predictions of its samples, device → gateway apps (``docs/protocol.md``)."""
        return f"{self.base}/predictions/{device}"

    def device_of(self, topic: str) -> str | None:
        """The ``<device>`` segment of an ``update/<device>`` or ``status/<device>`` topic, else None."""
        return self._last_level(topic, ("update", "status"))

    def _last_level(self, topic: str, kinds: tuple[str, ...]) -> str | None:
        parts, base = topic.split("/"), self.base.split("/")
        if len(parts) == len(base) + 2 and parts[: len(base)] == base and parts[-2] in kinds:
            return parts[-1]
        return None
