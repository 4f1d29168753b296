"""Garbage-collector hygiene for long-running services: a frozen start-up heap, measured pauses.

CPython's cyclic collector stops the whole process (every stream the service is relaying)
while it runs. A full (generation 2) collection walks every tracked object; a node-agent that
imported transformers and torch holds ~370k of them, and one such collection took 120 ms on a
quiet core of the 2-core development box, longer under load. Objects created at start-up
(modules, tokenizers, templates) live as long as the process, so walking them again is wasted:
`freeze_heap` moves them to the permanent generation (`gc.freeze`, CPython >= 3.7) after one
last collection, as vLLM's own servers do after start-up (`vllm.utils.gc_utils.freeze_gc_heap`).
`GcPauses` exports how long each collection stopped the process.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

# From 50 us (a young collection) to 2 s (a full one on a big heap under load).
PAUSE_BUCKETS: tuple[float, ...] = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005)
PAUSE_BUCKETS += (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


def freeze_heap() -> int:
    """Collects every generation, then freezes what survived (it is never scanned again).

    Call it once start-up is over and again after loading something large and long-lived
    (a model's tokenizer). Objects allocated later are collected as usual. Returns how many
    objects are frozen now (`gc.get_freeze_count()`).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """`inferplane_gc_pause_seconds{generation}`: how long each cyclic collection stopped the
    process, from a `gc.callbacks` hook (process-wide: `install` once per process, `close` to
    remove it)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._histogram = Histogram(
            "inferplane_gc_pause_seconds",
            "Time the process spent in one cyclic garbage collection, by generation.",
            ["generation"],
            buckets=PAUSE_BUCKETS,
            registry=registry,
        )
        self._by_generation = [self._histogram.labels(str(g)) for g in range(3)]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)

    def install(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
