"""Flower's side of ``bench.peer``: a legacy gRPC server (FedAvg) or a NumPyClient, run in Flower's own venv.

Imports only numpy and flwr (1.42): ``bench.peer`` runs it with the peer venv's python, never edgefl's.
The client trains the same last layer as an edgefl device (softmax regression, SGD, float32) on the
same embeddings, which ``bench.peer`` computed with edgefl's backbone and wrote to an ``.npz``.

Usage (by ``bench.peer``):
  python peer_flower.py server ADDR ROUNDS INIT.npz OUT.json
  python peer_flower.py client ADDR DATA.npz EPOCHS LR BATCH OUT.json

Source: McMahan et al. 2017 (FedAvg); Beutel et al. 2020, "Flower: A Friendly Federated Learning
Framework" (legacy ``start_server``/``start_client`` API).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def train(w: Any, b: Any, x: Any, y: Any, epochs: int, lr: float, batch: int, seed: int) -> tuple[Any, Any]:
    """SGD on softmax cross-entropy over a linear head: W float32 [D, K], b float32 [K]."""
    w = np.array(w, dtype=np.float32)
    b = np.array(b, dtype=np.float32)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), batch):
            j = order[start : start + batch]
            z = x[j] @ w + b
            z -= z.max(axis=1, keepdims=True)
            p = np.exp(z)
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(j)), y[j]] -= 1.0
            g = (p / len(j)).astype(np.float32)
            w -= np.float32(lr) * (x[j].T @ g)
            b -= np.float32(lr) * g.sum(axis=0)
    return w, b


def server(addr: str, rounds: int, init: str, out: str) -> None:
    import flwr as fl
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    events: list[tuple[str, int, float]] = []
    final: dict[str, Any] = {}
    start = np.load(init)

    class TimedFedAvg(FedAvg):  # type: ignore[misc]
        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            events.append(("fit_start", server_round, time.time()))
            events.append(("fit_start_cpu", server_round, time.process_time()))  # every thread, ns
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            agg = super().aggregate_fit(server_round, results, failures)
            events.append(("fit_end", server_round, time.time()))
            if agg[0] is not None:
                final["params"] = parameters_to_ndarrays(agg[0])
            return agg

    strategy = TimedFedAvg(
        fraction_fit=1.0,
        min_fit_clients=2,
        min_available_clients=2,
        fraction_evaluate=0.0,
        min_evaluate_clients=0,
        initial_parameters=ndarrays_to_parameters([start["W"], start["b"]]),
    )
    fl.server.start_server(
        server_address=addr, config=fl.server.ServerConfig(num_rounds=rounds), strategy=strategy
    )
    np.savez(out + ".npz", W=final["params"][0], b=final["params"][1])
    with open(out, "w") as fh:
        json.dump({"events": events, "status": _status()}, fh)


def client(addr: str, data: str, epochs: int, lr: float, batch: int, out: str) -> None:
    from flwr.client import NumPyClient, start_client

    shard = np.load(data)
    x, y = shard["x"].astype(np.float32), shard["y"].astype(np.int64)
    fits: list[tuple[float, float]] = []  # (time.time(), time.process_time()) as each fit starts

    class HeadClient(NumPyClient):  # type: ignore[misc]
        def get_parameters(self, config: Any) -> Any:
            return [np.zeros((x.shape[1], 10), np.float32), np.zeros(10, np.float32)]

        def fit(self, parameters: Any, config: Any) -> Any:
            fits.append((time.time(), time.process_time()))
            w, b = train(parameters[0], parameters[1], x, y, epochs, lr, batch, seed=len(fits))
            return [w, b], len(x), {}

        def evaluate(self, parameters: Any, config: Any) -> Any:
            return 0.0, len(x), {}

    start_client(server_address=addr, client=HeadClient().to_client(), insecure=True)
    with open(out, "w") as fh:
        json.dump({"fits": fits, "status": _status()}, fh)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        client(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
