"""What splitting per-key rate limits across regions costs auth (issue 31,
`inferplane.auth.shares`, docs/regions.md): per table size (`--sizes`, default 1,000 and
10,000 keys, every one with requests and tokens per minute and a request in the last minute),
on one auth database (SQLite in a temp dir), the auth of region eu1 with one peer, us1 (never
started: its demand is set by hand), in process CPU seconds over `--rounds` rounds (median):

- `demand_read`: this region's demand of every key (`SqlUsageLedger.recent_demand`, one range
  read of the ledger's end-time index; every `budget_sync_seconds`, and once per peer's call);
- `split`: this region's share of every key (`RegionShares.limits_for`);
- `reshare_poll`: the key table's poll after the shares changed (every own key with a rate
  limit built again in a worker thread, what changed pushed: at most once per sync), and
  `reshare_loop_stall`, the longest the event loop was held meanwhile (wall seconds).

Last lines: `demand_read_ms_<N>_keys`, `reshare_poll_ms_<N>_keys`,
`reshare_loop_stall_ms_<N>_keys`. Run
`.venv/bin/python bench/region_shares.py [--sizes 1000,10000] [--rounds 20]` (~1 min).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from inferplane.api.auth.v1 import auth_pb2
from inferplane.auth.app import build_components
from inferplane.auth.domain import KeySpec, Limits
from inferplane.auth.ledger import LedgerRow
from inferplane.auth.settings import AuthSettings
from inferplane.auth.shares import Demand
from inferplane.runtime import configure_logging
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.time.clock import SystemClock

ADMIN_KEY = "bench-bootstrap-admin-key-0123456789abcdef"


async def fill(components: Any, keys: int) -> list[str]:
    manager = components.manager
    now = components.clock.now()
    ids, rows = [], []
    for n in range(keys):
        key, _ = await manager.create(
            KeySpec(
                tenant=f"t{n % 50}",
                limits=Limits(requests_per_minute=600, tokens_per_minute=100_000),
            ),
            "bench",
        )
        ids.append(key.key_id)
        rows.append(
            LedgerRow(uuid.uuid4().hex, key.key_id, key.tenant, "m", now, prompt_tokens=100)
        )
    await asyncio.to_thread(components.ledger.record, rows)
    return ids


async def _ticker(stall: list[float]) -> None:
    """Records in `stall[0]` the longest the event loop was held between 1 ms sleeps."""
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(0.001)
        stall[0] = max(stall[0], loop.time() - before - 0.001)


def median_cpu(rounds: int, body: Any) -> float:
    spent = []
    for i in range(rounds):
        started = time.process_time()
        body(i)
        spent.append(time.process_time() - started)
    return statistics.median(spent)


async def costs(size: int, rounds: int, base: Path) -> dict[str, float]:
    settings = AuthSettings(
        host="127.0.0.1",
        port=0,
        data_dir=base / f"shares-{size}",
        bootstrap_admin_key=ADMIN_KEY,
        limits_store="memory",
        region="eu1",
        peers={"us1": f"127.0.0.1:{free_port()}"},
    )
    components = build_components(settings, clock=SystemClock())
    await components.start()
    # The peer is never started: its demand and reachability are set here, not followed.
    assert components.peers is not None
    await components.peers.stop()
    try:
        ids = await fill(components, size)
        feed, peers, ledger = components.key_table, components.peers, components.ledger
        assert feed is not None and peers is not None
        await feed.refresh(full=True)
        since = components.clock.now() - timedelta(seconds=60)
        out = {"demand_read": median_cpu(rounds, lambda _: ledger.recent_demand(since))}
        limits = auth_pb2.Limits(requests_per_minute=600, tokens_per_minute=100_000)
        local = {k: Demand(1, 100) for k in ids}
        peers.shares.update(local, {"us1": {k: Demand(3, 300) for k in ids}}, ["us1"])
        out["split"] = median_cpu(
            rounds, lambda _: [peers.shares.limits_for(k, "eu1", limits) for k in ids]
        )
        spent, stalls = [], []
        for i in range(rounds):
            remote = {k: Demand(3 + i % 2, 300) for k in ids}  # the shares move every round
            peers.shares.update(local, {"us1": remote}, ["us1"])
            stall = [0.0]
            ticker = asyncio.create_task(_ticker(stall))
            started = time.process_time()
            await feed.refresh()
            spent.append(time.process_time() - started)
            ticker.cancel()
            stalls.append(stall[0])
        out["reshare_poll"] = statistics.median(spent)
        out["reshare_loop_stall"] = statistics.median(stalls)
        return out
    finally:
        await components.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    configure_logging("WARNING")
    sizes = [int(s) for s in args.sizes.split(",")]

    async def run_all(base: Path) -> dict[int, dict[str, float]]:
        # One event loop for every size: grpc.aio stays bound to the first loop it ran on.
        results = {}
        for size in sizes:
            found = results[size] = await costs(size, args.rounds, base)
            print(
                f"{size} keys: "
                + ", ".join(f"{name} {value * 1000:.1f} ms" for name, value in found.items())
            )
        return results

    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(run_all(Path(tmp)))
    for size, found in results.items():
        print(f"demand_read_ms_{size}_keys: {found['demand_read'] * 1000:.1f}")
        print(f"reshare_poll_ms_{size}_keys: {found['reshare_poll'] * 1000:.1f}")
        print(f"reshare_loop_stall_ms_{size}_keys: {found['reshare_loop_stall'] * 1000:.1f}")


if __name__ == "__main__":
    main()
