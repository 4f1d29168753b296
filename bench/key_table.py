"""What auth's key table costs (issue 28): the CPU of its database polls at 1,000 and 10,000
keys, and how fast a revocation reaches three routers' tables.

Part 1, per table size (`--sizes`, default 1,000 and 10,000 keys; a tenth of them with a
monthly token budget and usage this month), on one auth database (SQLite in a temp dir unless
`--database-url`): the feed (`inferplane.auth.key_table.KeyTableFeed`, as the app builds it)
is loaded, then timed, in process CPU seconds (`time.process_time`: the worker thread's
SQLite or driver work included), over `--rounds` rounds:

- `idle_poll`: the poll every 0.25 s when nothing changed (one indexed read of the audit log);
- `change_poll`: the poll after another instance revoked one key (the audit read, the key,
  its entries);
- `budget_poll`: the poll that re-reads the month's tokens of every key with a budget (every
  1 s), with one key's usage changed;
- `resync`: the whole table read again (every 30 s);
- `snapshot`: one watch's first message built and serialized (per router connect).

and the CPU share of one auth instance at the default cadence (per second 3 polls and one
budget poll; a resync every 30 s), in percent of one core.

Part 2: two auth instances on one SQLite database, three routers' `KeyTable`s following them
through the real watch (`inferplane.router.key_source`: two on A, one on B) over loopback;
`--revocations` keys revoked through A one by one at a random point of B's poll cycle; the
time until all three tables refuse the key, p50/p99/max.

Last lines: `idle_poll_cpu_us_<N>_keys`, `cpu_percent_at_default_cadence_<N>_keys`, and
`revocation_propagation_p99_ms: X` (goal < 1,000). Run
`.venv/bin/python bench/key_table.py [--sizes 1000,10000] [--database-url URL]` (~1-2 min).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from inferplane.auth.app import build_components
from inferplane.auth.domain import KeySpec, Limits
from inferplane.auth.ledger import LedgerRow
from inferplane.auth.schema import METADATA
from inferplane.auth.settings import AuthSettings, resolve_pepper
from inferplane.router.key_source import KeyTableWatch
from inferplane.router.keys import KeyTable
from inferplane.runtime import RunningServer, UnauthenticatedError, configure_logging
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.security.api_keys import SecretHasher
from inferplane.runtime.time.clock import SystemClock

ADMIN_KEY = "bench-bootstrap-admin-key-0123456789abcdef"


def settings_for(data_dir: Path, database_url: str, port: int = 0) -> AuthSettings:
    return AuthSettings(
        host="127.0.0.1",
        port=port,
        data_dir=data_dir,
        database_url=database_url,
        bootstrap_admin_key=ADMIN_KEY,
        limits_store="memory",
        grace_period_seconds=0.2,
    )


async def fill(components: Any, keys: int) -> list[str]:
    """Creates `keys` keys (a tenth with a budget and usage this month); returns their ids."""
    manager = components.manager
    ids = []
    budgeted: list[LedgerRow] = []
    now = components.clock.now()
    for n in range(keys):
        limits = Limits(monthly_token_budget=1_000_000) if n % 10 == 0 else Limits()
        key, _ = await manager.create(
            KeySpec(tenant=f"t{n % 50}", scopes=("inference",), limits=limits), "bench"
        )
        ids.append(key.key_id)
        if limits.monthly_token_budget:
            budgeted.append(
                LedgerRow(
                    request_id=uuid.uuid4().hex,
                    key_id=key.key_id,
                    tenant=key.tenant,
                    model="m",
                    end_time=now,
                    prompt_tokens=100,
                )
            )
    await asyncio.to_thread(components.ledger.record, budgeted)
    return ids


async def cpu(rounds: int, body: Callable[[], Awaitable[Any]]) -> float:
    """Median process CPU seconds of `body` over `rounds` runs."""
    spent = []
    for _ in range(rounds):
        started = time.process_time()
        await body()
        spent.append(time.process_time() - started)
    return statistics.median(spent)


async def poll_costs(size: int, rounds: int, database_url: str, base: Path) -> dict[str, float]:
    data = base / f"costs-{size}"
    settings = settings_for(data, database_url)
    components = build_components(settings, clock=SystemClock())
    writer = build_components(settings, clock=SystemClock())  # "another instance"
    await components.start()
    try:
        ids = await fill(components, size)
        feed = components.key_table
        assert feed is not None
        await feed.refresh(full=True)
        print(f"{size} keys: {len(feed)} secret hashes in the table")
        results = {"idle_poll": await cpu(rounds, feed.refresh)}

        change_rounds = []
        for key_id in random.sample(ids, min(rounds, len(ids))):
            await writer.manager.revoke(key_id, "bench")  # not timed
            started = time.process_time()
            await feed.refresh()
            change_rounds.append(time.process_time() - started)
        results["change_poll"] = statistics.median(change_rounds)

        budgeted = [k for n, k in enumerate(ids) if n % 10 == 0]
        budget_rounds = []
        for _ in range(max(3, rounds // 10)):
            row = LedgerRow(
                request_id=uuid.uuid4().hex,
                key_id=random.choice(budgeted),
                tenant="t",
                model="m",
                end_time=components.clock.now(),
                completion_tokens=10,
            )
            await asyncio.to_thread(components.ledger.record, [row])
            started = time.process_time()
            await feed.refresh(budgets=True)
            budget_rounds.append(time.process_time() - started)
        results["budget_poll"] = statistics.median(budget_rounds)
        results["resync"] = await cpu(max(3, rounds // 20), lambda: feed.refresh(full=True))

        async def snapshot() -> None:
            feed.snapshot().SerializeToString()

        results["snapshot"] = await cpu(max(3, rounds // 20), snapshot)
        results["snapshot_bytes"] = float(len(feed.snapshot().SerializeToString()))
    finally:
        await components.stop()
        await asyncio.to_thread(writer.store.close)
        await asyncio.to_thread(writer.ledger.close)
        if database_url:
            await asyncio.to_thread(_drop, components)
    return results


def _drop(components: Any) -> None:
    """Drops every auth table of a shared (PostgreSQL) database, for the next size."""
    engine = components.store.engine
    from sqlalchemy import text

    with engine.begin() as conn:
        for metadata in METADATA:
            metadata.drop_all(conn)
        conn.execute(text("DROP TABLE IF EXISTS auth_alembic_version"))


async def propagation(revocations: int, base: Path) -> list[float]:
    data = base / "propagation"
    auths = []
    for _ in range(2):
        settings = settings_for(data, "", free_port())
        components = build_components(settings, clock=SystemClock())
        server = RunningServer(components.app(), settings)
        await server.start()
        auths.append((components, server, settings))
    hasher = SecretHasher(resolve_pepper(auths[0][2]))
    tables = [KeyTable(hasher, SystemClock()) for _ in range(3)]
    watches = [
        KeyTableWatch(f"127.0.0.1:{auths[0 if i < 2 else 1][2].port}", table)
        for i, table in enumerate(tables)
    ]
    for watch in watches:
        await watch.start()

    def refused(secret: str) -> bool:
        for table in tables:
            try:
                table.authenticate({"authorization": f"Bearer {secret}"}, "/v1/models")
            except UnauthenticatedError:
                continue
            return False
        return True

    try:
        manager = auths[0][0].manager
        keys = [await manager.create(KeySpec(tenant="acme"), "bench") for _ in range(revocations)]
        await asyncio.sleep(1.0)
        took = []
        for key, secret in keys:
            await asyncio.sleep(random.uniform(0, 0.25))
            started = time.perf_counter()
            await manager.revoke(key.key_id, "bench")
            while not refused(secret):
                await asyncio.sleep(0.001)
            took.append(time.perf_counter() - started)
    finally:
        for watch in watches:
            await watch.stop()
        for _, server, _ in auths:
            await server.stop()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--revocations", type=int, default=20)
    parser.add_argument("--database-url", default="")
    args = parser.parse_args()
    configure_logging("warning", json_logs=False)  # the services' info lines would drown this
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        costs = {}
        for size in sizes:
            costs[size] = asyncio.run(poll_costs(size, args.rounds, args.database_url, base))
            c = costs[size]
            print(
                f"{size} keys: idle poll {c['idle_poll'] * 1e6:.0f} µs, change poll "
                f"{c['change_poll'] * 1e6:.0f} µs, budget poll ({size // 10} keys) "
                f"{c['budget_poll'] * 1e3:.1f} ms, resync {c['resync'] * 1e3:.0f} ms, snapshot "
                f"{c['snapshot'] * 1e3:.1f} ms ({c['snapshot_bytes'] / 1e6:.2f} MB) CPU"
            )
        took = sorted(asyncio.run(propagation(args.revocations, base)))
    p50 = statistics.median(took)
    p99 = took[min(len(took) - 1, int(0.99 * len(took)))]
    print(
        f"revocation through A refused by 3 routers (2 on A, 1 on B), {len(took)} revocations: "
        f"p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms, max {took[-1] * 1e3:.0f} ms"
    )
    for size, c in costs.items():
        print(f"idle_poll_cpu_us_{size}_keys: {c['idle_poll'] * 1e6:.0f}")
        per_second = 3 * c["idle_poll"] + c["budget_poll"] + c["resync"] / 30
        print(f"cpu_percent_at_default_cadence_{size}_keys: {per_second * 100:.2f}")
    print(f"revocation_propagation_p99_ms: {p99 * 1e3:.0f}")


if __name__ == "__main__":
    main()
