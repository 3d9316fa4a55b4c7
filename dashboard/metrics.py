"""The dashboard's Prometheus export: metric families built from a device's or a coordinator's status.

``prometheus_client`` (about 1.8 MB RSS) is imported inside the functions, so an agent nobody scrapes
never loads it. Missing or null values are left out.

Source: Prometheus text exposition format; the enum idiom (one gauge per state, 1 for the current one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

DEVICE_STATES: Final = ("idle", "training", "uploading", "waiting", "deferred", "offline")


def finite_number(value: Any) -> float | None:
    """A status value as a finite float (bool as 0/1); None when missing, NaN, infinite or not a number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


class StatusCollector:
    """A prometheus_client collector reading ``get_status()`` at scrape time (nothing cached).

    ``kind`` ("device" or "coordinator") picks :func:`device_metrics` or :func:`coordinator_metrics`;
    both kinds add ``edgefl_rejected`` by reason; ``streams()``: the open SSE streams, exported as
    ``edgefl_dashboard_sse_streams``.
    """

    def __init__(
        self, get_status: Callable[[], Mapping[str, Any]], kind: str, streams: Callable[[], int]
    ) -> None:
        self.get_status = get_status
        self.kind = kind
        self.streams = streams

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family of the current status (prometheus_client's collector protocol)."""
        status = self.get_status()
        if self.kind == "device":
            yield from device_metrics(status)
        else:
            yield from coordinator_metrics(status)
        yield from _labelled(
            "edgefl_rejected", "Messages rejected, by reason.", "reason", status.get("rejected"), counter=True
        )
        yield from _gauge(
            "edgefl_dashboard_sse_streams",
            "Open Server-Sent Events streams of this dashboard.",
            self.streams(),
        )


def _gauge(name: str, doc: str, value: Any, *, counter: bool = False) -> Iterator[Metric]:
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

    number = finite_number(value)
    if number is not None:
        yield (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, value=number)


def _labelled(
    name: str, doc: str, label: str, values: Any, *, counter: bool = False, known: tuple[str, ...] = ()
) -> Iterator[Metric]:
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

    family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=[label])
    items = dict(values) if isinstance(values, Mapping) else {}
    for key in known:
        items.setdefault(key, None)
    for key, value in items.items():
        number = finite_number(value)
        if number is not None:
            family.add_metric([str(key)], number)
    yield family


def _state_set(name: str, doc: str, state: Any, known: tuple[str, ...]) -> Iterator[Metric]:
    """One gauge per known state, 1 for the current one (the Prometheus enum idiom)."""
    from prometheus_client.metrics_core import GaugeMetricFamily

    if not isinstance(state, str):
        return
    family = GaugeMetricFamily(name, doc, labels=["state"])
    for known_state in dict.fromkeys((*known, state)):
        family.add_metric([known_state], 1.0 if known_state == state else 0.0)
    yield family


_DEVICE_GAUGES: Final = (
    ("edgefl_memory_cap_bytes", "cap_bytes", "Memory cap of the agent."),
    ("edgefl_memory_rss_bytes", "rss_bytes", "Resident set size of the agent."),
    ("edgefl_memory_pss_bytes", "pss_bytes", "Proportional set size of the agent."),
    ("edgefl_memory_peak_rss_bytes", "peak_rss_bytes", "Peak RSS of the agent."),
    ("edgefl_system_available_bytes", "system_available_bytes", "MemAvailable of the system."),
    ("edgefl_round", "round", "Current round known to the device."),
    ("edgefl_global_version", "version", "Version of the global head in use."),
    ("edgefl_last_update_bytes", "last_update_bytes", "Wire size of the last update sent."),
    ("edgefl_local_accuracy", "local_accuracy", "Accuracy of the last local training (0..1)."),
    ("edgefl_inference_rate_samples_per_second", "inference_rate", "Inference rate."),
    ("edgefl_store_samples", "store_samples", "Labelled embeddings in the store."),
    ("edgefl_broker_connected", "broker_connected", "1 when connected to the MQTT broker."),
    ("edgefl_ingest_queued", "ingest_queued", "Live samples received, not yet classified."),
    ("edgefl_pending_labels", "pending_labels", "Classified live samples waiting for a late label."),
)
_DEVICE_COUNTERS: Final = (
    ("edgefl_inferred_samples", "inferred_total", "Samples classified."),
    # live ingest (source.kind = "mqtt"): absent otherwise
    ("edgefl_ingest_samples_received", "samples_received", "Live samples accepted."),
    ("edgefl_ingest_labels_received", "labels_received", "Labels accepted, inline or late."),
    ("edgefl_ingest_predictions_published", "predictions_published", "Predictions published."),
    ("edgefl_ingest_dropped", "ingest_dropped", "Live samples dropped unclassified (queue full, oldest)."),
    ("edgefl_ingest_pending_expired", "pending_expired", "Live samples whose late label never came."),
)
_COORDINATOR_GAUGES: Final = (
    ("edgefl_round", "round", "Current round."),
    ("edgefl_global_version", "version", "Version of the global head."),
    ("edgefl_round_updates_received", "updates_received", "Updates received this round."),
    ("edgefl_round_updates_expected", "updates_expected", "Updates expected this round."),
    ("edgefl_round_deadline_left_seconds", "deadline_s_left", "Seconds left before the round deadline."),
    ("edgefl_broker_connected", "broker_connected", "1 when the coordinator is connected to its broker."),
)


def device_metrics(status: Mapping[str, Any]) -> Iterator[Metric]:
    """Yield the Prometheus families of a device status (``docs/operations.md``, "The dashboard's routes")."""
    for name, key, doc in _DEVICE_GAUGES[:5]:
        yield from _gauge(name, doc, status.get(key))
    yield from _labelled(
        "edgefl_phase_peak_bytes", "Peak RSS measured during each phase.", "phase", status.get("phase_peaks")
    )
    for name, key, doc in _DEVICE_GAUGES[5:]:
        yield from _gauge(name, doc, status.get(key))
    for name, key, doc in _DEVICE_COUNTERS:
        yield from _gauge(name, doc, status.get(key), counter=True)
    yield from _state_set(
        "edgefl_agent_state", "Agent state (1 = current).", status.get("state"), DEVICE_STATES
    )
    mode = status.get("pipeline_mode")
    if isinstance(mode, str):
        yield from _labelled("edgefl_pipeline_info", "Input pipeline mode in use.", "mode", {mode: 1.0})


def coordinator_metrics(status: Mapping[str, Any]) -> Iterator[Metric]:
    """Yield the Prometheus families of a coordinator status (``docs/operations.md``, as above)."""
    for name, key, doc in _COORDINATOR_GAUGES:
        yield from _gauge(name, doc, status.get(key))
    yield from _state_set(
        "edgefl_coordinator_state", "Coordinator state (1 = current).", status.get("state"), ()
    )
    history = status.get("accuracy_history")
    if isinstance(history, list) and history and isinstance(history[-1], Mapping):
        accuracy = history[-1].get("accuracy")
        yield from _gauge("edgefl_test_accuracy", "Test accuracy of the latest global head (0..1).", accuracy)
    devices = status.get("devices")
    devices = devices if isinstance(devices, Mapping) else {}
    for key, name, doc in (
        ("online", "edgefl_device_online", "1 when the device's retained status says online."),
        ("rss_bytes", "edgefl_device_rss_bytes", "RSS reported by the device."),
        ("cap_bytes", "edgefl_device_cap_bytes", "Memory cap reported by the device."),
        ("last_round", "edgefl_device_last_round", "Last round the device took part in."),
    ):
        values = {d: e.get(key) for d, e in devices.items() if isinstance(e, Mapping)}
        yield from _labelled(name, doc, "device", values)
