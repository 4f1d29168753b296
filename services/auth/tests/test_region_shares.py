"""Per-key rate limits global across regions (issue 31, docs/regions.md, `inferplane.auth.shares`).

First the split itself (`split`, `RegionShares`), then two auth services on loopback, eu1 and
us1, each the other's peer through a TCP link the test cuts (`inferplane.testing.links.Link`),
real gRPC and SQLite: a key homed in eu1 used only in eu1 keeps its whole limit there and the
floor in us1; used in both, the two regions' shares sum to the limit and follow the demand;
with the link cut, each region takes the whole limit once the peer is silent for the cut time;
healed, the limit is split again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inferplane.api.auth.v1 import auth_pb2, usage_pb2, usage_pb2_grpc
from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.auth.domain import KeySpec, Limits
from inferplane.auth.shares import Demand, RegionShares, floor_of, split
from inferplane.testing.links import Link

from .conftest import eventually

RPM, TPM, CONCURRENCY = 100, 10_000, 10


# -- the split ---------------------------------------------------------------------------------


def test_the_split_follows_demand_with_a_floor_and_sums_to_the_limit() -> None:
    assert floor_of(100) == 5 and floor_of(10) == 1 and floor_of(1) == 1
    # No demand anywhere: the owner (the home region) gets the whole limit, others the floor.
    assert split(100, {"eu1": 0, "us1": 0}, "eu1") == {"eu1": 100, "us1": 5}
    # Demand in one region only: it gets the whole limit, wherever the key is homed.
    assert split(100, {"eu1": 0, "us1": 7}, "eu1") == {"eu1": 5, "us1": 100}
    # Demand in both: floors, then the rest by demand (largest remainder, ties by name).
    assert split(100, {"eu1": 30, "us1": 10}, "eu1") == {"eu1": 73, "us1": 27}
    assert split(100, {"eu1": 1, "us1": 1, "ap1": 1}, "eu1") == {"ap1": 34, "eu1": 33, "us1": 33}
    for limit in (1, 2, 3, 7, 20, 99, 100, 1001):
        for demand in ({"a": 1, "b": 2}, {"a": 5, "b": 5, "c": 1}, {"a": 1, "b": 999}):
            shares = split(limit, demand, "a")
            assert all(s >= 1 for s in shares.values())
            if limit >= len(demand):
                assert sum(shares.values()) == limit, (limit, demand, shares)
            else:  # below the number of regions with demand: 1 each
                assert set(shares.values()) == {1}
    # A region with more demand never gets less.
    shares = split(1000, {"a": 3, "b": 1, "c": 2}, "a")
    assert shares["a"] >= shares["c"] >= shares["b"]


def test_region_shares_keep_the_whole_limit_alone_and_skip_unlimited_keys() -> None:
    limits = auth_pb2.Limits(
        requests_per_minute=RPM, tokens_per_minute=TPM, max_concurrent_requests=CONCURRENCY
    )
    shares = RegionShares("us1")
    assert shares.limits_for("k", "eu1", limits) is None  # no peer counted: the key's own
    assert shares.update({}, {"eu1": {"k": Demand(9, 900)}}, ["eu1"], peers=["eu1"])
    assert not shares.update({}, {"eu1": {"k": Demand(9, 900)}}, ["eu1"], peers=["eu1"])
    got = shares.limits_for("k", "eu1", limits)
    assert got is not None
    assert (got.requests_per_minute, got.tokens_per_minute, got.max_concurrent_requests) == (
        5,
        500,
        1,
    )
    assert shares.limits_for("k", "eu1", auth_pb2.Limits(monthly_token_budget=10)) is None
    # Tokens split by tokens, requests by requests.
    shares.update({"k": Demand(1, 9000)}, {"eu1": {"k": Demand(3, 1000)}}, ["eu1"])
    got = shares.limits_for("k", "eu1", limits)
    assert got is not None
    assert got.requests_per_minute == 5 + 90 * 1 // 4  # 22.5 each side: the tie goes to eu1
    assert got.tokens_per_minute == 500 + 9000 * 9000 // 10_000
    # The home region out of reach and no demand: the first reachable region by name owns it.
    shares.update({}, {}, ["ap1"])
    assert shares.shares_of("k", "eu1", limits) == {"ap1": (RPM, TPM, 10), "us1": (5, 500, 1)}
    # No peer counted (a cut): the key's own limits.
    shares.update({}, {}, [])
    assert shares.limits_for("k", "eu1", limits) is None


# -- two regions -------------------------------------------------------------------------------


@contextlib.contextmanager
def two_regions(
    tmp_path: Path, make_settings: Any, start_auth: Any, links: dict[str, Link]
) -> Iterator[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        auths = {}
        for name, other in (("eu1", "us1"), ("us1", "eu1")):
            settings = make_settings(
                tmp_path / name,
                region=name,
                peers={other: f"127.0.0.1:{links[other].port}"},
                pepper="one-pepper-shared-by-every-region",
                budget_sync_seconds=0.2,
                key_table_budget_seconds=0.2,
            )
            auths[name] = stack.enter_context(start_auth(settings))
            links[name].target = auths[name].server.port
        yield auths


def limits_of(auth: Any, key_id: str) -> tuple[tuple[int, int, int], bool] | None:
    """The limits the region's routers get for `key_id` (requests, tokens, concurrency) and
    whether the entry carries a share (`key_limits` set, the key's own); None while the key
    is not in the region's table yet."""

    async def snapshot() -> kpb.WatchKeyTableResponse:
        return auth.components.key_table.snapshot()

    for entry in auth.run(snapshot()).entries:
        if entry.key_id == key_id and not entry.previous_secret:
            lim = entry.limits
            shared = entry.HasField("key_limits")
            if shared:
                own = entry.key_limits
                assert (own.requests_per_minute, own.tokens_per_minute) == (RPM, TPM)
            triple = (lim.requests_per_minute, lim.tokens_per_minute, lim.max_concurrent_requests)
            return triple, shared
    return None


def report(auth: Any, key_id: str, prefix: str, requests: int, tokens: int) -> None:
    usage_pb2_grpc.UsageServiceStub(auth.channel).ReportUsage(
        usage_pb2.ReportUsageRequest(
            usage=[
                usage_pb2.RequestUsage(
                    key_id=key_id, request_id=f"{prefix}-{i}", prompt_tokens=tokens
                )
                for i in range(requests)
            ]
        ),
        timeout=5,
    )


def counted(auth: Any, state: str) -> float | None:
    value: float | None = auth.components.registry.get_sample_value(
        "inferplane_auth_region_share_peers", {"state": state}
    )
    return value


def test_rate_limits_are_split_by_demand_taken_back_in_a_cut_and_split_again(
    tmp_path: Path, make_settings: Any, start_auth: Any, links: dict[str, Link]
) -> None:
    with two_regions(tmp_path, make_settings, start_auth, links) as auths:
        eu1, us1 = auths["eu1"], auths["us1"]
        key, _ = eu1.run(
            eu1.components.manager.create(
                KeySpec(
                    tenant="acme",
                    limits=Limits(
                        requests_per_minute=RPM,
                        tokens_per_minute=TPM,
                        max_concurrent_requests=CONCURRENCY,
                    ),
                ),
                "test-admin",
            )
        )
        key_id = key.key_id
        # Demand only at home: eu1's entries carry the whole limit, us1's the floor.
        report(eu1, key_id, "eu", 30, 100)
        eventually(lambda: counted(us1, "counted") == 1.0, what="us1 counts eu1")
        eventually(
            lambda: limits_of(us1, key_id) == ((5, 500, 1), True), what="us1 holds the floor"
        )
        assert limits_of(eu1, key_id) == ((RPM, TPM, CONCURRENCY), False)
        # Demand in both (30 and 10 requests, 3,000 and 3,000 tokens): the shares sum to the
        # limit and follow the demand.
        report(us1, key_id, "us", 10, 300)
        expected_eu1, expected_us1 = (73, 5000, 7), (27, 5000, 3)
        eventually(lambda: limits_of(eu1, key_id) == (expected_eu1, True), what="eu1's share")
        eventually(lambda: limits_of(us1, key_id) == (expected_us1, True), what="us1's share")
        assert [a + b for a, b in zip(expected_eu1, expected_us1, strict=True)] == [
            RPM,
            TPM,
            CONCURRENCY,
        ]
        # The link cut: each side takes the other's share back once it has heard nothing for
        # the cut time (2 heartbeats here: 2 s; in production 2 × BUDGET_SYNC_SECONDS).
        cut_after = us1.components.peers.settings.cut_after
        links["eu1"].cut()
        links["us1"].cut()
        cut_at = time.monotonic()
        eventually(
            lambda: limits_of(us1, key_id) == ((RPM, TPM, CONCURRENCY), False),
            timeout=cut_after + 5,
            what="us1 takes the whole limit",
        )
        took = time.monotonic() - cut_at
        eventually(lambda: limits_of(eu1, key_id) == ((RPM, TPM, CONCURRENCY), False))
        assert counted(us1, "cut") == 1.0 and counted(us1, "counted") == 0.0
        # Not at once (the watch ends at the cut): once silent for the cut time, which began
        # at the last heartbeat before the cut (up to 1 s earlier, more on a loaded box).
        assert took > min(0.5, cut_after / 2)
        print(f"\ncut: us1 took the whole limit after {took:.2f} s (cut time {cut_after} s)")
        # Healed: split again by the same demand.
        links["eu1"].restore()
        links["us1"].restore()
        healed_at = time.monotonic()
        eventually(lambda: limits_of(us1, key_id) == (expected_us1, True), what="re-split")
        eventually(lambda: limits_of(eu1, key_id) == (expected_eu1, True), what="re-split")
        print(f"healed: split again after {time.monotonic() - healed_at:.2f} s")
