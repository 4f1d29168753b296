"""Two regions behind the global tier: throughput with both up, and what a region's loss costs
(issue 31 part 3; docs/regions.md).

Set-up (`inferplane.localstack.regions` on network namespaces, as tests/regions: needs root):
two regions `a` and `b`, each a control host (orchestrator, auth, router, telemetry, its edge)
and a worker (node-agent, one replica process around the fake vLLM HTTP engine: one token
every `--token-delay` s per request, so the figures are the platform's, not a model's), and
the global tier's Envoy on a host of its own. Keys: half the load uses a key homed in `a`,
half one homed in `b`.

Phases, each with open-loop arrivals at `--rate` requests per second (short text
completions, streamed, read to `[DONE]`):
1. `up`: both regions up, `--seconds` s;
2. `cut`: both cables of region `a` pulled, `--seconds` s;
3. `restored`: cables back, `--seconds` s.

A request *fails* when it gets no HTTP 200 or its stream ends without `[DONE]` (an error
event, a transport error). Figures per phase: requests sent, served per second, failed, p50
and p99 latency. Failover: from the cut until every `a`-key request is answered as without
the cut (the end of the last that failed or took over 3× the `up` phase's p99 latency);
restore: from the cables' return until `a`-key requests are served by `a` again
(`x-inferplane-region`).

Last lines: `regions_failover_seconds <s>` and `regions_failed_requests <n>` (requests of the
`cut` phase that had not started before the cut and failed; goal 0).

Usage: `sudo python bench/regions.py [--rate 4] [--seconds 30]`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from inferplane.localstack import MODEL_NAME
from inferplane.localstack.netns import Hosts, namespaces_unavailable
from inferplane.localstack.regions import (
    Regions,
    control_host,
    layout_host_names,
    namespace_layout,
    running_regions,
    worker_host,
)
from inferplane.wire.headers import SERVED_REGION

REGIONS = ("a", "b")
INTERNAL_TOKEN = "bench-regions-internal-token"


@dataclasses.dataclass(slots=True)
class Outcome:
    """One request: its key's home region, monotonic send and end times, HTTP status (0: none),
    whether `[DONE]` ended the stream, the region that served it, the error if any."""

    home: str
    sent: float
    end: float = 0.0
    status: int = 0
    done: bool = False
    region: str = ""
    error: str = ""

    @property
    def failed(self) -> bool:
        return self.status != 200 or not self.done or bool(self.error)


async def one(client: httpx.AsyncClient, url: str, key: str, home: str, tokens: int) -> Outcome:
    out = Outcome(home=home, sent=time.monotonic())
    body = {"model": MODEL_NAME, "prompt": "Count: t", "max_tokens": tokens, "stream": True}
    try:
        async with client.stream(
            "POST", f"{url}/completions", json=body, headers={"authorization": f"Bearer {key}"}
        ) as response:
            out.status = response.status_code
            out.region = response.headers.get(SERVED_REGION, "")
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        out.done = True
                    elif '"error"' in data:
                        out.error = data[:200]
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    out.end = time.monotonic()
    return out


async def phase(
    url: str, keys: dict[str, str], rate: float, seconds: float, tokens: int
) -> list[Outcome]:
    """Open-loop arrivals at `rate`/s for `seconds`, keys alternating; every outcome."""
    tasks: list[asyncio.Task[Outcome]] = []
    timeout = httpx.Timeout(10, read=120)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        start = time.monotonic()
        k = 0
        while time.monotonic() - start < seconds:
            home = REGIONS[k % len(REGIONS)]
            tasks.append(asyncio.create_task(one(client, url, keys[home], home, tokens)))
            k += 1
            await asyncio.sleep(max(0.0, start + k / rate - time.monotonic()))
        return list(await asyncio.gather(*tasks))


def summary(name: str, outcomes: Sequence[Outcome], seconds: float) -> None:
    served = [o for o in outcomes if not o.failed]
    latency = sorted(o.end - o.sent for o in served) or [0.0]
    print(
        f"{name:9s} sent {len(outcomes):4d}  served/s {len(served) / seconds:6.2f}  "
        f"failed {len(outcomes) - len(served):3d}  p50 {statistics.median(latency):.3f} s  "
        f"p99 {p99(outcomes):.3f} s"
    )


def failover_seconds(outcomes: Sequence[Outcome], cut_at: float, slow_s: float) -> float:
    """From the cut until every `a`-key request is answered as without the cut: the end of
    the last one that failed or took longer than `slow_s`, minus the cut (0: none did)."""
    held = [
        o.end for o in outcomes if o.home == REGIONS[0] and (o.failed or o.end - o.sent > slow_s)
    ]
    return max(held, default=cut_at) - cut_at


def p99(outcomes: Sequence[Outcome]) -> float:
    latency = sorted(o.end - o.sent for o in outcomes if not o.failed) or [0.0]
    return latency[min(len(latency) - 1, int(0.99 * len(latency)))]


def run(args: argparse.Namespace, hosts: Hosts, root: Path) -> None:
    config = namespace_layout(
        {name: hosts.host(name) for name in layout_host_names(REGIONS)},
        REGIONS,
        root,
        internal_token=INTERNAL_TOKEN,
        fake_engine_token_delay=args.token_delay,
    )
    with running_regions(config, print) as regions:
        keys = {r: regions.stacks[r].create_api_key(f"bench-{r}") for r in REGIONS}
        wait_served(regions, keys)
        up = asyncio.run(phase(regions.base_url, keys, args.rate, args.seconds, args.tokens))
        cut_at = time.monotonic()
        for host in (control_host(REGIONS[0]), worker_host(REGIONS[0])):
            hosts.cut(host)
        try:
            cut = asyncio.run(phase(regions.base_url, keys, args.rate, args.seconds, args.tokens))
        finally:
            for host in (control_host(REGIONS[0]), worker_host(REGIONS[0])):
                hosts.restore(host)
        restored_at = time.monotonic()
        back = asyncio.run(phase(regions.base_url, keys, args.rate, args.seconds, args.tokens))
        summary("up", up, args.seconds)
        summary("cut", cut, args.seconds)
        summary("restored", back, args.seconds)
        home_back = [o.sent for o in back if o.home == REGIONS[0] and o.region == REGIONS[0]]
        restore = (min(home_back) - restored_at) if home_back else float("nan")
        print(f"regions_restore_seconds {restore:.2f}")
        failed = [o for o in cut if o.failed]
        for o in failed[:10]:
            print(
                f"  failed: home {o.home} status {o.status} at +{o.sent - cut_at:.1f} s: {o.error}"
            )
        # "As without the cut": within 3× the p99 latency with both regions up.
        slow_s = 3 * p99(up)
        print(f"regions_failover_seconds {failover_seconds(cut, cut_at, slow_s):.2f}")
        print(f"regions_failed_requests {len(failed)}")


def wait_served(regions: Regions, keys: dict[str, str], seconds: float = 60.0) -> None:
    """Until each key is served by its home region (its key table reached the routers)."""
    deadline = time.monotonic() + seconds
    for region, key in keys.items():
        while True:
            with (
                httpx.Client(timeout=30, trust_env=False) as client,
                client.stream(
                    "POST",
                    f"{regions.base_url}/completions",
                    json={"model": MODEL_NAME, "prompt": "Count: t", "max_tokens": 2},
                    headers={"authorization": f"Bearer {key}"},
                ) as response,
            ):
                response.read()
                if response.headers.get(SERVED_REGION) == region:
                    break
            if time.monotonic() > deadline:
                sys.exit(f"key of region {region} not served there within {seconds:.0f} s")
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens of each request")
    parser.add_argument("--token-delay", type=float, default=0.02, help="fake engine s/token")
    parser.add_argument(
        "--data-dir", type=Path, help="keep the stacks' folders (logs) here; default: a temp dir"
    )
    args = parser.parse_args()
    reason = namespaces_unavailable()
    if reason:
        sys.exit(reason)
    hosts = Hosts.fresh(layout_host_names(REGIONS))
    hosts.create()
    try:
        if args.data_dir is not None:
            run(args, hosts, args.data_dir)
        else:
            with tempfile.TemporaryDirectory(prefix="bench-regions-") as tmp:
                run(args, hosts, Path(tmp))
    finally:
        hosts.delete()


if __name__ == "__main__":
    main()
