"""Per-key limits in Check: requests/min, tokens/min after usage is reported, concurrency,
with a fake clock, on one and on two auth instances sharing one SQLite file."""

from __future__ import annotations

import concurrent.futures
import json
import os
import sqlite3
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from inferplane.api.auth.v1 import auth_pb2
from inferplane.auth.counters import MemoryCounterStore, SqlCounterStore
from inferplane.auth.domain import Limits
from inferplane.runtime import UnavailableError
from inferplane.runtime.processes.ports import free_port
from inferplane.testing.clock import FakeClock
from inferplane.wire.ratelimit import format_reset

RESOURCE_EXHAUSTED = 8


def _key(auth: Any, **limits: int) -> tuple[str, str]:
    created = auth.keys.CreateApiKey(
        auth_pb2.CreateApiKeyRequest(
            api_key=auth_pb2.ApiKey(tenant="acme", limits=auth_pb2.Limits(**limits))
        ),
        metadata=auth.admin_md(),
    )
    return created.secret, created.api_key.name.split("/")[1]


def _ok_headers(resp: Any) -> dict[str, str]:
    assert resp.status.code == 0, resp
    return {h.header.key: h.header.value for h in resp.ok_response.response_headers_to_add}


def _refusal(resp: Any) -> tuple[dict[str, str], dict[str, Any]]:
    assert resp.status.code == RESOURCE_EXHAUSTED, resp
    denied = resp.denied_response
    assert denied.status.code == 429
    headers = {h.header.key: h.header.value for h in denied.headers}
    assert headers["content-type"] == "application/json"
    return headers, json.loads(denied.body)["error"]


def _rid(n: int) -> dict[str, str]:
    return {"x-request-id": f"req-{n}"}


def test_requests_per_minute_with_openai_headers_until_the_window_resets(auth: Any) -> None:
    secret, _ = _key(auth, requests_per_minute=2)
    auth.clock.advance(15)  # 45 s left in this minute
    first = _ok_headers(auth.check(secret, extra=_rid(1)))
    assert first["x-ratelimit-limit-requests"] == "2"
    assert first["x-ratelimit-remaining-requests"] == "1"
    assert first["x-ratelimit-reset-requests"] == "45s"
    assert "x-ratelimit-limit-tokens" not in first  # no token limit: no token headers
    assert _ok_headers(auth.check(secret, extra=_rid(2)))["x-ratelimit-remaining-requests"] == "0"
    headers, error = _refusal(auth.check(secret, extra=_rid(3)))
    assert headers["retry-after"] == "45"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "Limit 2" in error["message"] and error["param"] is None
    assert auth.check(secret, path="/v1/admin/api-keys").status.code != RESOURCE_EXHAUSTED
    auth.clock.advance(45)  # next window
    assert _ok_headers(auth.check(secret, extra=_rid(4)))["x-ratelimit-remaining-requests"] == "1"


def test_tokens_per_minute_refuse_once_reported_usage_reaches_the_limit(auth: Any) -> None:
    """A key over its token limit is refused until its window resets."""
    secret, key_id = _key(auth, tokens_per_minute=100)
    ok = _ok_headers(auth.check(secret, extra=_rid(1)))
    assert ok["x-ratelimit-remaining-tokens"] == "100"
    auth.run(auth.components.limiter.record_usage(key_id, 60))
    assert _ok_headers(auth.check(secret, extra=_rid(2)))["x-ratelimit-remaining-tokens"] == "40"
    auth.run(auth.components.limiter.record_usage(key_id, 45))
    auth.clock.advance(30)
    headers, error = _refusal(auth.check(secret, extra=_rid(3)))
    assert error["type"] == "tokens" and "Used 105" in error["message"]
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == "30s" and headers["retry-after"] == "30"
    auth.clock.advance(29)
    _refusal(auth.check(secret, extra=_rid(4)))
    auth.clock.advance(1)
    assert _ok_headers(auth.check(secret, extra=_rid(5)))["x-ratelimit-remaining-tokens"] == "100"


def test_check_takes_no_concurrency_slot(auth: Any) -> None:
    """Check runs only where the endpoint picker does not (its concurrency is the picker's,
    released once at the stream's end): a key limited to one request at a time passes any
    number of Checks, and nothing is held for them."""
    secret, key_id = _key(auth, max_concurrent_requests=1)
    for n in range(3):
        assert auth.check(secret, extra=_rid(n)).status.code == 0
    store = auth.components.counters
    assert store is not None
    outcome = store.try_admit(key_id, "probe", Limits(max_concurrent_requests=1), 0, 0.0, 60.0)
    assert outcome.refused is None  # no lease held: the one slot is free


def test_rate_window_seconds_shortens_the_window(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    """`rate_window_seconds` (tests of a whole stack) makes a token limit reset sooner."""
    from inferplane.auth.app import build_components
    from inferplane.runtime import ConfigError

    with pytest.raises(ConfigError, match="rate_window_seconds"):
        build_components(make_settings(tmp_path, rate_window_seconds=0))
    clock = FakeClock()  # on a window boundary (the epoch's multiple of 10 s)
    with start_auth(make_settings(tmp_path, rate_window_seconds=10), clock) as auth:
        secret, key_id = _key(auth, tokens_per_minute=50)
        auth.run(auth.components.limiter.record_usage(key_id, 80))
        headers, _ = _refusal(auth.check(secret, extra=_rid(1)))
        assert headers["x-ratelimit-reset-tokens"] == "10s"
        clock.advance(10)
        assert auth.check(secret, extra=_rid(2)).status.code == 0


def test_two_instances_sharing_one_database_never_admit_past_the_limits(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    """Counters live in the shared database: two auth instances hammered at once admit
    exactly the limit between them, and usage reported to one is seen by the other."""
    clock = FakeClock()
    with (
        start_auth(make_settings(tmp_path), clock) as a,
        start_auth(make_settings(tmp_path), clock) as b,
    ):
        secret, _ = _key(a, requests_per_minute=7)
        pool = concurrent.futures.ThreadPoolExecutor(8)
        results = list(
            pool.map(lambda n: (a, b)[n % 2].check(secret, extra=_rid(n)).status.code, range(20))
        )
        assert results.count(0) == 7 and results.count(RESOURCE_EXHAUSTED) == 13

        tok_secret, tok_id = _key(a, tokens_per_minute=50)
        a.run(a.components.limiter.record_usage(tok_id, 80))
        _refusal(b.check(tok_secret, extra=_rid(300)))
        pool.shutdown()


POSTGRES_URL = os.environ.get("INFERPLANE_TEST_POSTGRES_URL", "")


def _store(kind: str, tmp_path: Path) -> MemoryCounterStore | SqlCounterStore:
    if kind == "memory":
        return MemoryCounterStore()
    if kind == "sqlite":
        return SqlCounterStore(f"sqlite:///{tmp_path / 'c.db'}")
    if not POSTGRES_URL:
        pytest.skip("set INFERPLANE_TEST_POSTGRES_URL to run the counter tests on PostgreSQL")
    return SqlCounterStore(POSTGRES_URL)


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgresql"])
def test_counter_stores_agree(kind: str, tmp_path: Path) -> None:
    store = _store(kind, tmp_path)
    store.create_schema()
    k = uuid.uuid4().hex  # a shared PostgreSQL database keeps earlier runs' rows
    limits = Limits(requests_per_minute=3, tokens_per_minute=10, max_concurrent_requests=2)
    outcomes = [store.try_admit(k, f"r{i}", limits, 5, 0.0, 100.0).refused for i in range(3)]
    assert outcomes == [None, None, "concurrency"]
    store.release(k, "r0")
    assert store.try_admit(k, "r3", limits, 5, 0.0, 100.0).refused is None
    assert store.try_admit(k, "r4", limits, 5, 200.0, 300.0).refused == "requests"
    assert store.try_admit(k, "r5", limits, 6, 200.0, 300.0).refused is None  # leases expired
    store.add_tokens(k, 6, 10)
    refused = store.try_admit(k, "r6", limits, 6, 200.0, 300.0)
    assert refused.refused == "tokens" and refused.tokens == 10
    store.purge(7, 1000.0)
    assert store.try_admit(k, "r7", limits, 7, 1000.0, 1100.0).refused is None
    store.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgresql"])
def test_a_repeated_check_of_one_request_holds_one_slot_and_refusals_change_nothing(
    kind: str, tmp_path: Path
) -> None:
    """Envoy may call Check twice for one request (same x-request-id): one lease, and a
    refusal counts nothing (the request counter and leases are as before it)."""
    store = _store(kind, tmp_path)
    store.create_schema()
    k = uuid.uuid4().hex
    limits = Limits(requests_per_minute=100, max_concurrent_requests=1)
    first = store.try_admit(k, "r1", limits, 1, 0.0, 100.0)
    again = store.try_admit(k, "r1", limits, 1, 0.0, 100.0)
    assert first.refused is None and again.refused is None
    refused = store.try_admit(k, "r2", limits, 1, 0.0, 100.0)
    assert refused.refused == "concurrency"
    store.release(k, "r1")
    admitted = store.try_admit(k, "r2", limits, 1, 0.0, 100.0)
    # r1 twice + r2 once: the refused attempt did not count.
    assert admitted.refused is None and admitted.requests == 3
    assert store.try_admit(k, "r3", Limits(tokens_per_minute=5), 1, 0.0, 100.0).tokens == 0
    store.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_sql_stores_of_two_instances_never_admit_past_the_limits(kind: str, tmp_path: Path) -> None:
    """Two stores (as two auth instances) on one database, eight threads at once: exactly the
    concurrency limit is admitted, then exactly the request limit once leases are released."""
    a, b = _store(kind, tmp_path), _store(kind, tmp_path)
    a.create_schema()
    k = uuid.uuid4().hex
    conc = Limits(max_concurrent_requests=3)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda n: (a, b)[n % 2].try_admit(k, f"c{n}", conc, 1, 0.0, 100.0).refused,
                range(24),
            )
        )
        assert results.count(None) == 3, results
        rpm = Limits(requests_per_minute=7, max_concurrent_requests=100)
        results = list(
            pool.map(
                lambda n: (a, b)[n % 2].try_admit(k, f"q{n}", rpm, 2, 0.0, 100.0).refused,
                range(24),
            )
        )
    # Three leases are still held (c*), so 7 requests fit under 100 concurrent.
    assert results.count(None) == 7 and results.count("requests") == 17, results
    a.close()
    b.close()


def test_reset_format_matches_openai() -> None:
    assert [format_reset(s) for s in (0.25, 1, 1.2, 59.5, 60, 360, 61)] == [
        "250ms",
        "1s",
        "2s",
        "1m0s",
        "1m0s",
        "6m0s",
        "1m1s",
    ]


def test_check_latency_added_by_limits(auth: Any) -> None:
    """Measures Check p50 over real gRPC for cached keys without limits, with rpm+tpm (one
    upsert) and with all three (plus a lease insert) on SQLite, interleaved; prints them.
    The issue's budget is ≤ 1 ms added at p50; the assertion is looser because this machine's
    two cores are shared with running engines — the printed figures are what counts."""
    plain, _ = _key(auth)
    rate, _ = _key(auth, requests_per_minute=10**6, tokens_per_minute=10**9)
    full, _ = _key(
        auth, requests_per_minute=10**6, tokens_per_minute=10**9, max_concurrent_requests=10**6
    )
    samples: dict[str, list[float]] = {"none": [], "rpm_tpm": [], "all": []}
    n = 0
    for round_ in range(400):
        for name, secret in (("none", plain), ("rpm_tpm", rate), ("all", full)):
            n += 1
            rid = _rid(n)
            start = time.perf_counter()
            auth.check(secret, extra=rid)
            if round_ >= 50:
                samples[name].append(time.perf_counter() - start)
    p50 = {k: statistics.median(v) * 1000 for k, v in samples.items()}
    print(
        f"\ncheck_p50_ms_no_limits: {p50['none']:.3f}"
        f"\ncheck_p50_added_ms_rpm_tpm: {p50['rpm_tpm'] - p50['none']:.3f}"
        f"\ncheck_p50_added_ms_all_limits: {p50['all'] - p50['none']:.3f}"
    )
    assert p50["rpm_tpm"] - p50["none"] < 5.0


def test_an_unreachable_counter_database_is_unavailable_then_recovers(tmp_path: Path) -> None:
    """A counter store that cannot reach its database raises UnavailableError (the edge answers
    503, never allows), and works again once the database is back."""
    down = SqlCounterStore(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    with pytest.raises(UnavailableError):
        down.try_admit("k", "r1", Limits(requests_per_minute=1), 1, 0.0, 100.0)
    with pytest.raises(UnavailableError):
        down.release("k", "r1")
    down.close()

    path = tmp_path / "c.db"
    store = SqlCounterStore(f"sqlite:///{path}")
    store.create_schema()
    limits = Limits(requests_per_minute=5, max_concurrent_requests=5)
    assert store.try_admit("k", "r1", limits, 1, 0.0, 100.0).refused is None
    blocker = sqlite3.connect(path, timeout=0)
    blocker.execute("BEGIN EXCLUSIVE")  # another writer holds it past busy_timeout (5 s)
    try:
        with pytest.raises(UnavailableError):
            store.try_admit("k", "r2", limits, 1, 0.0, 100.0)
    finally:
        blocker.rollback()
        blocker.close()
    outcome = store.try_admit("k", "r3", limits, 1, 0.0, 100.0)
    assert outcome.refused is None and outcome.requests == 2  # r2 changed nothing
    store.close()
