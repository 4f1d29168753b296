"""Routing decision latency of the router at 10, 100 and 1,000 replicas, per policy.

One decision = the deployment's policy choosing a replica and the slot being taken
(`Admission._try`: breaker wake-up check, policy, counters updated in O(1)), as on every
request; no I/O. Loads are kept realistic: about 4 requests in flight per replica, released
in random order, so least-load and the bounded-load cap see uneven loads. Requests are
multi-turn conversations (prefix features extracted once per request, timed separately).

Prints p50/p99 per policy and size; the last line is the worst p99 over policies at 1,000
replicas: `decision_p99_us_1000_replicas: X` (goal ≤ 100 µs).
Run: `.venv/bin/python bench/router_decision.py [--decisions N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.router.admission import Admission, AdmissionSettings, Lease
from inferplane.router.features import FeatureExtractor, RequestFeatures
from inferplane.router.policies import default_registry
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable
from inferplane.runtime.clock import SystemClock

POLICIES = ("round_robin", "least_load", "prefix_affinity", "session_affinity")
SIZES = (10, 100, 1000)


class _NoScheduler:
    def call_later(self, delay: float, callback: object) -> object:
        raise AssertionError("the benchmark never queues")


def _conversation(rng: random.Random, conv: int, turns: int) -> pb.ChatCompletionRequest:
    messages = [pb.ChatMessage(role="system")]
    messages[0].content.string_value = "You are a coding agent. Follow the tools' schemas. " * 8
    for t in range(turns):
        user = pb.ChatMessage(role="user")
        user.content.string_value = f"[{conv}] step {t}: " + "refactor this function " * 12
        messages.append(user)
        if t < turns - 1:
            answer = pb.ChatMessage(role="assistant")
            answer.content.string_value = "done; next " * rng.randint(10, 40)
            messages.append(answer)
    return pb.ChatCompletionRequest(model="m", messages=messages, user=f"user-{conv}")


def _features(rng: random.Random, count: int) -> tuple[list[RequestFeatures], list[float]]:
    extract = FeatureExtractor()
    out, costs = [], []
    for i in range(count):
        request = _conversation(rng, i % 500, rng.randint(1, 8))
        start = time.perf_counter_ns()
        out.append(extract.chat(request, {"x-session-id": f"s-{i % 500}"}))
        costs.append((time.perf_counter_ns() - start) / 1000)
    return out, costs


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1]


def bench(policy: str, n: int, features: list[RequestFeatures], decisions: int) -> list[float]:
    endpoints = tuple(
        Endpoint(f"10.{i // 250}.{i % 250}.1:50054", f"r{i}", max_concurrency=64) for i in range(n)
    )
    route = ModelRoute("m", endpoints, routing_policy=policy)
    admission = Admission(
        default_registry(),
        AdmissionSettings(),
        SystemClock(),
        _NoScheduler(),  # type: ignore[arg-type]
    )
    admission.apply(RouteTable.of([route]))
    deployment = admission._deployments["m"]
    rng = random.Random(n)
    held: list[Lease] = []
    target = 4 * n
    timings: list[float] = []
    for i in range(decisions + 200):
        feature = features[i % len(features)]
        start = time.perf_counter_ns()
        lease = admission._try(deployment, feature, frozenset())
        elapsed = (time.perf_counter_ns() - start) / 1000
        if i >= 200:  # warm-up: ring built, caches filled
            timings.append(elapsed)
        assert lease is not None
        lease.first_chunk()
        held.append(lease)
        while len(held) > target:
            held.pop(rng.randrange(len(held))).release()
    for lease in held:
        lease.release()
    return timings


async def main(decisions: int) -> None:
    rng = random.Random(7)
    features, costs = _features(rng, 2000)
    print(
        f"feature extraction per request (1-8 turns): p50 {statistics.median(costs):.1f} us, "
        f"p99 {_percentile(costs, 0.99):.1f} us"
    )
    worst_1000 = 0.0
    for n in SIZES:
        for policy in POLICIES:
            timings = bench(policy, n, features, decisions)
            p50, p99 = statistics.median(timings), _percentile(timings, 0.99)
            print(f"{n:>5} replicas  {policy:<17} p50 {p50:6.1f} us  p99 {p99:6.1f} us")
            if n == 1000:
                worst_1000 = max(worst_1000, p99)
    print(f"decision_p99_us_1000_replicas: {worst_1000:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=20_000)
    asyncio.run(main(parser.parse_args().decisions))
