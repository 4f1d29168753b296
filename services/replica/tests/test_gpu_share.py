"""GPU-seconds per request: a replica's share split equally among its requests in flight."""

from __future__ import annotations

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica.pipeline.gpu_share import GpuShareMeter, replica_gpu_share


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_share_is_what_placement_reserved() -> None:
    spec = nodeagent_pb2.ReplicaSpec
    assert replica_gpu_share(spec()) == 0.0  # a CPU replica charges nothing
    assert replica_gpu_share(spec(gpu_indices=[0, 1, 2, 3, 4, 5, 6, 7])) == 8.0
    assert replica_gpu_share(spec(gpu_indices=[3], gpu_memory_fraction=0.25)) == 0.25
    assert replica_gpu_share(spec(gpu_indices=[0, 1], gpu_memory_fraction=0.9)) == 1.8


def test_overlapping_requests_split_the_share_and_add_up_to_busy_time() -> None:
    clock = Clock()
    meter = GpuShareMeter(2.0, clock)
    clock.now += 5  # idle: charged to nobody
    a = meter.start()
    clock.now += 1  # a alone: 1 s × 2 GPUs
    b = meter.start()
    clock.now += 2  # a and b: 2 s × 2 GPUs / 2 each
    c = meter.start()
    clock.now += 3  # a, b, c: 3 s × 2 / 3 each
    charged_a = meter.end(a)
    clock.now += 4  # b, c: 4 s × 2 / 2 each
    charged_b = meter.end(b)
    clock.now += 1  # c alone
    charged_c = meter.end(c)
    assert charged_a == pytest.approx(2 + 2 + 2)
    assert charged_b == pytest.approx(2 + 2 + 4)
    assert charged_c == pytest.approx(2 + 4 + 2)
    busy = 1 + 2 + 3 + 4 + 1
    assert charged_a + charged_b + charged_c == pytest.approx(2.0 * busy)


def test_a_request_alone_pays_its_whole_duration() -> None:
    clock = Clock()
    meter = GpuShareMeter(0.25, clock)
    token = meter.start()
    clock.now += 8
    assert meter.end(token) == pytest.approx(2.0)
    assert GpuShareMeter(0.0, clock).end(GpuShareMeter(0.0, clock).start()) == 0.0
