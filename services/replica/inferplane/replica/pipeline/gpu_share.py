"""GPU-seconds per request: a replica's GPU share split equally among its requests in flight.

While `n` requests are in flight on a replica holding a GPU share `g`, each is charged `g / n`
GPU-seconds per second. So the charges of all requests on a replica add up exactly to `g` ×
the time the replica had at least one request (idle time is charged to nobody), and a request
that ran alone pays its whole duration. Equal split is the rule because the engine batches
every running request into the same forward passes; per-token weighting would need the
engine's per-step composition, which it does not expose.

`GpuShareMeter` computes it in O(1) per event with a "virtual clock" `V(t) = ∫ dt / n(t)`
(advanced only while `n > 0`): a request that started at `V0` and ends at `V1` is charged
`g × (V1 − V0)`.

The share `g` of a replica (`replica_gpu_share`) is what its placement reserved: the number of
its accelerators × the fraction of each one's memory it may use (`ReplicaSpec.gpu_indices`,
`gpu_memory_fraction`; a whole GPU when the fraction is unset). A replica without accelerators
(CPU nodes, the fixture model) has share 0 and charges nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from inferplane.api.nodeagent.v1 import nodeagent_pb2


def replica_gpu_share(spec: nodeagent_pb2.ReplicaSpec) -> float:
    """GPUs reserved by the replica (may be fractional); 0 without accelerators."""
    count = len(spec.gpu_indices)
    if not count:
        return 0.0
    fraction = spec.gpu_memory_fraction
    return count * (fraction if 0.0 < fraction <= 1.0 else 1.0)


class GpuShareMeter:
    """Attributes a GPU share to the requests in flight (see the module docstring).

    Args:
        share: GPUs held (≥ 0).
        monotonic: seconds, monotonic (the replica's clock).
    """

    def __init__(self, share: float, monotonic: Callable[[], float]) -> None:
        self._share = max(0.0, share)
        self._monotonic = monotonic
        self._virtual = 0.0
        self._at = monotonic()
        self._in_flight = 0

    def _advance(self) -> float:
        now = self._monotonic()
        if self._in_flight:
            self._virtual += (now - self._at) / self._in_flight
        self._at = now
        return self._virtual

    def start(self) -> float:
        """A request starts; returns its token for `end`."""
        token = self._advance()
        self._in_flight += 1
        return token

    def end(self, token: float) -> float:
        """The request that got `token` from `start` ends; returns its GPU-seconds."""
        virtual = self._advance()
        self._in_flight = max(0, self._in_flight - 1)
        return self._share * (virtual - token)
