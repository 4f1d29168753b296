"""Keys across regions end to end (issue 31, docs/regions.md): two regions' auths (eu1, us1),
each the other's peer (`--region`, `--peer`), their own SQLite databases and one pepper, and a
router's `KeyTable` in us1 following us1's auth through the real watch client
(`inferplane.router.key_source`), all over gRPC on loopback.

- A key created in eu1 authenticates on us1's router with no router change; a key pinned to
  eu1 is unknown there (401); us1's own keys work too.
- 20 revocations in eu1, each refused as revoked by us1's router: the figures are printed and
  bounded by `regions.KEY_REPLICATION_SECONDS`.
- A key's rate limit is global (`inferplane.auth.shares`): a key homed in eu1 with demand only
  there is admitted up to the floor by us1's router (`inferplane.router.keylimits`), then
  refused; once us1 serves the key too, us1's router admits its share of the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path

from inferplane import regions
from inferplane.auth.app import build_components as build_auth
from inferplane.auth.domain import KeySpec, Limits
from inferplane.auth.ledger import LedgerRow
from inferplane.auth.settings import AuthSettings, resolve_pepper
from inferplane.router.key_source import KeyTableWatch
from inferplane.router.keylimits import KeyLimiter, RequestsLimitError
from inferplane.router.keys import KeyTable
from inferplane.runtime import RunningServer, UnauthenticatedError, UnavailableError
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.security.api_keys import SecretHasher
from inferplane.testing.clock import FakeClock

ADMIN_KEY = "test-bootstrap-admin-key-0123456789abcdef"
PEPPER = "one-pepper-shared-by-every-region"
PATH = "/v1/chat/completions"


class WallClock:
    """The FakeClock's wall time with real monotonic time (the table's age)."""

    def __init__(self, fake: FakeClock) -> None:
        self._fake = fake

    def time(self) -> float:
        return self._fake.time()

    def now(self) -> datetime:
        return self._fake.now()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@contextlib.asynccontextmanager
async def two_regions(tmp_path: Path) -> AsyncIterator[tuple[dict[str, object], KeyTable]]:
    clock = FakeClock(start=datetime.now().astimezone())
    ports = {"eu1": free_port(), "us1": free_port()}
    auths: dict[str, object] = {}
    servers = []
    for name, other in (("eu1", "us1"), ("us1", "eu1")):
        settings = AuthSettings(
            host="127.0.0.1",
            port=ports[name],
            data_dir=tmp_path / name,
            bootstrap_admin_key=ADMIN_KEY,
            limits_store="memory",
            grace_period_seconds=0.2,
            pepper=PEPPER,
            budget_sync_seconds=0.2,
            region=name,
            peers={other: f"127.0.0.1:{ports[other]}"},
        )
        components = build_auth(settings, clock=clock)
        server = RunningServer(components.app(), settings)
        await server.start()
        servers.append(server)
        auths[name] = components
    hasher = SecretHasher(resolve_pepper(AuthSettings(pepper=PEPPER)))
    table = KeyTable(hasher, WallClock(clock), stale_after_seconds=5.0)
    watch = KeyTableWatch(
        f"127.0.0.1:{ports['us1']}",
        table,
        router_id="us1-router",
        initial_backoff_seconds=0.05,
        max_backoff_seconds=0.2,
    )
    await watch.start()
    try:
        await _until(lambda: watch.received.is_set())
        yield auths, table
    finally:
        await watch.stop()
        for server in servers:
            await server.stop()


async def _until(condition: Callable[[], bool], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def _refusal(table: KeyTable, secret: str) -> str:
    """The refusal's message of `secret`; empty when the table lets it in."""
    try:
        table.authenticate({"authorization": f"Bearer {secret}"}, PATH)
    except (UnauthenticatedError, UnavailableError) as exc:
        return str(exc)
    return ""


def test_another_regions_keys_work_on_a_router_and_revocations_reach_it(tmp_path: Path) -> None:
    async def scenario() -> list[float]:
        async with two_regions(tmp_path) as (auths, table):
            eu1 = auths["eu1"].manager  # type: ignore[attr-defined]
            us1 = auths["us1"].manager  # type: ignore[attr-defined]
            keys = [await eu1.create(KeySpec(tenant="acme"), "test") for _ in range(20)]
            _, pinned = await eu1.create(KeySpec(tenant="acme", region_pinned=True), "test")
            _, local = await us1.create(KeySpec(tenant="acme"), "test")
            await _until(lambda: all(_refusal(table, s) == "" for _, s in keys))
            assert _refusal(table, local) == ""
            principal = table.authenticate({"authorization": f"Bearer {keys[0][1]}"}, PATH)
            assert principal.key_id == keys[0][0].key_id
            # The pinned key never left eu1: unknown to us1's router.
            assert _refusal(table, pinned).startswith("Incorrect API key provided: ip-eu1***")
            took = []
            for key, secret in keys:
                started = time.perf_counter()
                await eu1.revoke(key.key_id, "test")
                await _until(lambda: "revoked" in _refusal(table, secret))  # noqa: B023
                took.append(time.perf_counter() - started)
            return took

    took = sorted(asyncio.run(scenario()))
    p50, p99 = statistics.median(took), took[min(len(took) - 1, int(0.99 * len(took)))]
    print(
        f"\nrevocation in eu1 refused by a us1 router: p50 {p50 * 1000:.0f} ms, "
        f"p99 {p99 * 1000:.0f} ms, max {took[-1] * 1000:.0f} ms over {len(took)}"
    )
    assert took[-1] < regions.KEY_REPLICATION_SECONDS


def test_a_routers_region_admits_its_share_of_a_keys_limit(tmp_path: Path) -> None:
    def served(auth: object, key_id: str, region: str, count: int, now: datetime) -> None:
        rows = [
            LedgerRow(f"{region}-{i}", key_id, "acme", "m", now, prompt_tokens=10)
            for i in range(count)
        ]
        auth.ledger.record(rows)  # type: ignore[attr-defined]

    def admitted(limiter: KeyLimiter, table: KeyTable, secret: str) -> int:
        principal = table.authenticate({"authorization": f"Bearer {secret}"}, PATH)
        n = 0
        try:
            while n < 1000:
                limiter.admit(principal, f"r{n}").release()
                n += 1
        except RequestsLimitError:
            pass
        return n

    def rpm(table: KeyTable, secret: str) -> int:
        principal = table.authenticate({"authorization": f"Bearer {secret}"}, PATH)
        return principal.limits.requests_per_minute

    async def scenario() -> None:
        async with two_regions(tmp_path) as (auths, table):
            eu1 = auths["eu1"]
            key, secret = await eu1.manager.create(  # type: ignore[attr-defined]
                KeySpec(tenant="acme", limits=Limits(requests_per_minute=40)), "test"
            )
            clock = eu1.clock  # type: ignore[attr-defined]
            served(eu1, key.key_id, "eu1", 30, clock.now())
            # Demand only in eu1: us1's router gets the floor (5 % of 40, at least 1).
            await _until(lambda: _refusal(table, secret) == "" and rpm(table, secret) == 2)
            assert admitted(KeyLimiter(WallClock(clock)), table, secret) == 2
            # us1 serves the key too (10 requests to eu1's 30): 2 + 36 / 4 = 11.
            served(auths["us1"], key.key_id, "us1", 10, clock.now())
            await _until(lambda: rpm(table, secret) == 11)
            assert admitted(KeyLimiter(WallClock(clock)), table, secret) == 11

    asyncio.run(scenario())
