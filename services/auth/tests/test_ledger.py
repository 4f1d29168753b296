"""The usage ledger: idempotent batched writes, monthly totals, queries with filters, grouping
and pagination (SQLite, and PostgreSQL when `INFERPLANE_TEST_POSTGRES_URL` is set); through the
service: re-sent batches written and accounted once, `QueryUsage` over gRPC, and monthly token
budgets refusing with OpenAI's `insufficient_quota`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import timestamp_pb2

from inferplane.api.auth.v1 import auth_pb2, usage_pb2, usage_pb2_grpc
from inferplane.auth.ledger import (
    LedgerRow,
    SqlUsageLedger,
    UsageQuery,
    Written,
    month_end,
    month_of,
)
from inferplane.runtime import InvalidArgumentError
from inferplane.testing.databases import database_or_skip

T0 = datetime(2026, 11, 30, 22, 30, tzinfo=UTC)
RESOURCE_EXHAUSTED = 8


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlUsageLedger]:
    with database_or_skip(request.param, tmp_path) as url:
        store = SqlUsageLedger(url)
        store.create_schema()
        try:
            yield store
        finally:
            store.close()


def _row(
    n: int, *, key: str = "k1", tenant: str = "acme", model: str = "m", **kw: Any
) -> LedgerRow:
    values: dict[str, Any] = {
        "request_id": f"r{n:04d}",
        "key_id": key,
        "tenant": tenant,
        "model": model,
        "end_time": T0 + timedelta(minutes=n),
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "gpu_seconds": 0.5,
    }
    values.update(kw)
    return LedgerRow(**values)


def test_month_helpers() -> None:
    assert month_of(datetime(2026, 12, 31, 23, 59, tzinfo=UTC)) == "2026-12"
    assert month_end(datetime(2026, 12, 31, 23, 59, tzinfo=UTC)) == datetime(2027, 1, 1, tzinfo=UTC)
    assert month_end(datetime(2026, 2, 1, tzinfo=UTC)) == datetime(2026, 3, 1, tzinfo=UTC)


def test_a_batch_is_written_once_however_often_it_is_sent(ledger: SqlUsageLedger) -> None:
    batch = [_row(n) for n in range(5)]
    assert list(ledger.record(batch)) == [r.request_id for r in batch]
    # A re-send (the router's call failed after the commit), and one overlapping it.
    assert ledger.record(batch) == {}
    assert ledger.record([batch[4], _row(5)]) == {"r0005": Written(15, replaced=False)}
    page = ledger.query(UsageQuery(page_size=100))
    assert [r.request_id for r in page.rows] == [f"r{n:04d}" for n in range(6)]
    assert page.rows[0] == batch[0]  # every field round-trips
    # 90 minutes from 22:30 on Nov 30: r0000..r0001 end in November, the rest too (< 24:00).
    assert ledger.month_tokens("k1", T0) == 6 * 15
    assert ledger.month_tokens("k2", T0) == 0


def test_a_provisional_row_is_replaced_once_by_the_request_s_report(
    ledger: SqlUsageLedger,
) -> None:
    """A router that concluded a request without hearing how it ended wrote it provisional
    (cancelled, no tokens); the replica's late report replaces it once, moving the month's
    tokens; a copy of either report, or a second provisional one, changes nothing."""
    guessed = _row(1, status="cancelled", prompt_tokens=0, completion_tokens=0, provisional=True)
    assert ledger.record([guessed]) == {"r0001": Written(0, replaced=False)}
    assert ledger.month_tokens("k1", T0) == 0
    # The report ended in the next month (its end time is the router's, later).
    heard = _row(1, end_time=T0 + timedelta(hours=3), prompt_tokens=30, completion_tokens=100)
    assert ledger.record([guessed, heard, _row(2)]) == {
        "r0001": Written(130, replaced=True),
        "r0002": Written(15, replaced=False),
    }
    assert ledger.record([heard, guessed]) == {}
    rows = {r.request_id: r for r in ledger.query(UsageQuery(page_size=10)).rows}
    assert rows["r0001"] == heard and not rows["r0001"].provisional
    assert ledger.month_tokens("k1", T0) == 15
    assert ledger.month_tokens("k1", T0 + timedelta(hours=3)) == 130
    # A provisional row that had tokens: the replacement adds only the difference, and a
    # batch holding both adds their sum once.
    both = [
        _row(3, status="cancelled", completion_tokens=2, provisional=True),
        _row(3, completion_tokens=9),
    ]
    assert ledger.record(both) == {"r0003": Written(19, replaced=True)}
    assert ledger.month_tokens("k1", T0) == 15 + 19


def test_monthly_totals_follow_each_request_s_end_time(ledger: SqlUsageLedger) -> None:
    late = [_row(n, end_time=T0 + timedelta(minutes=60 + n)) for n in range(3)]  # 23:30..
    early = [_row(10 + n, end_time=T0 + timedelta(hours=2, minutes=n)) for n in range(2)]
    ledger.record(late + early)
    assert ledger.month_tokens("k1", T0) == 3 * 15
    assert ledger.month_tokens("k1", T0 + timedelta(days=1)) == 2 * 15
    # Several keys at once (the key table's budget state): keys without usage are absent.
    ledger.record([_row(20, key="k2")])
    assert ledger.month_tokens_of(["k1", "k2", "k3"], T0) == {"k1": 3 * 15, "k2": 15}
    assert ledger.month_tokens_of(["k1", "k2"], T0 + timedelta(days=1)) == {"k1": 2 * 15}


def test_query_filters_and_pages(ledger: SqlUsageLedger) -> None:
    rows = [
        _row(n, key=f"k{n % 3}", tenant="acme" if n % 2 else "beta", model=f"m{n % 2}")
        for n in range(25)
    ]
    ledger.record(rows)
    seen: list[str] = []
    token = ""
    while True:
        page = ledger.query(UsageQuery(key_id="k1", page_size=3, page_token=token))
        seen += [r.request_id for r in page.rows]
        token = page.next_page_token
        if not token:
            break
    assert seen == [r.request_id for r in rows if r.key_id == "k1"]
    window = ledger.query(
        UsageQuery(start=T0 + timedelta(minutes=5), end=T0 + timedelta(minutes=10), tenant="acme")
    )
    assert [r.request_id for r in window.rows] == ["r0005", "r0007", "r0009"]
    assert [r.request_id for r in ledger.query(UsageQuery(model="m0", page_size=2)).rows] == [
        "r0000",
        "r0002",
    ]
    with pytest.raises(InvalidArgumentError) as info:
        ledger.query(UsageQuery(key_id="k2", page_size=3, page_token=token or "x"))
    assert info.value.param == "page_token"
    first = ledger.query(UsageQuery(key_id="k1", page_size=3))
    with pytest.raises(InvalidArgumentError):  # a token of other filters
        ledger.query(UsageQuery(key_id="k2", page_size=3, page_token=first.next_page_token))
    with pytest.raises(InvalidArgumentError):
        ledger.query(UsageQuery(group_by="week"))
    with pytest.raises(InvalidArgumentError):
        ledger.query(UsageQuery(page_size=1001))


def test_grouping_sums_tokens_and_gpu_seconds(ledger: SqlUsageLedger) -> None:
    rows = [
        _row(n, model="a" if n < 70 else "b", status="completed" if n % 10 else "failed")
        for n in range(100)
    ]
    ledger.record(rows)
    by_model = ledger.query(UsageQuery(group_by="model")).groups
    assert [(g.group, g.requests, g.failed_requests) for g in by_model] == [
        ("a", 70, 7),
        ("b", 30, 3),
    ]
    assert by_model[0].prompt_tokens == 700 and by_model[0].completion_tokens == 350
    assert by_model[0].gpu_seconds == pytest.approx(35.0)
    by_hour = ledger.query(UsageQuery(group_by="hour")).groups
    # 22:30 + 0..99 minutes: 30 in the 22h bucket, 60 in 23h, 10 on the next day's 00h.
    assert [(g.group, g.requests) for g in by_hour] == [
        ("2026-11-30T22:00:00Z", 30),
        ("2026-11-30T23:00:00Z", 60),
        ("2026-12-01T00:00:00Z", 10),
    ]
    by_day = ledger.query(UsageQuery(group_by="day")).groups
    assert [(g.group, g.requests) for g in by_day] == [
        ("2026-11-30T00:00:00Z", 90),
        ("2026-12-01T00:00:00Z", 10),
    ]
    first = ledger.query(UsageQuery(group_by="hour", page_size=2))
    assert len(first.groups) == 2 and first.next_page_token
    rest = ledger.query(UsageQuery(group_by="hour", page_size=2, page_token=first.next_page_token))
    assert [g.group for g in rest.groups] == ["2026-12-01T00:00:00Z"]
    assert not rest.next_page_token
    assert [g.group for g in ledger.query(UsageQuery(group_by="tenant")).groups] == ["acme"]
    assert [g.group for g in ledger.query(UsageQuery(group_by="key")).groups] == ["k1"]


# --- through the service ----------------------------------------------------------------


def _key(auth: Any, tenant: str = "acme", **limits: int) -> tuple[str, str]:
    created = auth.keys.CreateApiKey(
        auth_pb2.CreateApiKeyRequest(
            api_key=auth_pb2.ApiKey(tenant=tenant, limits=auth_pb2.Limits(**limits))
        ),
        metadata=auth.admin_md(),
    )
    return created.secret, created.api_key.name.split("/")[1]


def _usage(key_id: str, request_id: str, tokens: int, **kw: Any) -> usage_pb2.RequestUsage:
    usage = usage_pb2.RequestUsage(
        key_id=key_id,
        request_id=request_id,
        model="kimi-tiny",
        prompt_tokens=tokens // 2,
        completion_tokens=tokens - tokens // 2,
        **kw,
    )
    return usage


def _report(auth: Any, *usage: usage_pb2.RequestUsage) -> None:
    usage_pb2_grpc.UsageServiceStub(auth.channel).ReportUsage(
        usage_pb2.ReportUsageRequest(usage=list(usage)), timeout=5
    )


def test_reports_land_in_the_ledger_once_with_what_the_router_knew(auth: Any) -> None:
    _, key_id = _key(auth, tenant="acme")
    end = timestamp_pb2.Timestamp()
    end.FromDatetime(auth.clock.now())
    full = _usage(
        key_id,
        "req-1",
        30,
        deployment="kimi-tiny",
        replica="kimi-tiny-0-abc",
        cached_tokens=4,
        reasoning_tokens=3,
        ttft_seconds=0.25,
        duration_seconds=1.5,
        gpu_seconds=0.75,
        status="cancelled",
        end_time=end,
        api="messages",
    )
    _report(auth, full, _usage(key_id, "req-2", 10, status="bogus"))
    _report(auth, full)  # re-sent: written and accounted once
    ledger = usage_pb2_grpc.UsageLedgerServiceStub(auth.channel)
    answer = ledger.QueryUsage(usage_pb2.QueryUsageRequest(), metadata=auth.admin_md(), timeout=5)
    rows = {r.request_id: r for r in answer.rows}
    assert set(rows) == {"req-1", "req-2"}
    one = rows["req-1"]
    assert (one.tenant, one.deployment, one.replica, one.status) == (
        "acme",
        "kimi-tiny",
        "kimi-tiny-0-abc",
        "cancelled",
    )
    assert (one.prompt_tokens, one.completion_tokens, one.cached_tokens) == (15, 15, 4)
    assert (one.ttft_seconds, one.duration_seconds, one.gpu_seconds) == (0.25, 1.5, 0.75)
    assert rows["req-2"].status == "failed"  # an unknown status is not counted as completed
    assert (one.api, rows["req-2"].api) == ("messages", "")  # "": an older router
    by_api = ledger.QueryUsage(
        usage_pb2.QueryUsageRequest(group_by="api"), metadata=auth.admin_md(), timeout=5
    )
    assert [(g.group, g.requests) for g in by_api.groups] == [("", 1), ("messages", 1)]
    only = ledger.QueryUsage(
        usage_pb2.QueryUsageRequest(api="messages"), metadata=auth.admin_md(), timeout=5
    )
    assert [r.request_id for r in only.rows] == ["req-1"]
    metrics = auth.components.registry
    sample = metrics.get_sample_value
    assert sample("inferplane_auth_usage_requests_total", {"outcome": "accounted"}) == 2.0
    assert sample("inferplane_auth_usage_requests_total", {"outcome": "duplicate"}) == 1.0
    grouped = ledger.QueryUsage(
        usage_pb2.QueryUsageRequest(group_by="tenant"), metadata=auth.admin_md(), timeout=5
    )
    assert [(g.group, g.requests, g.failed_requests) for g in grouped.groups] == [("acme", 2, 2)]
    with pytest.raises(grpc.RpcError) as info:
        ledger.QueryUsage(
            usage_pb2.QueryUsageRequest(group_by="week"), metadata=auth.admin_md(), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:  # only admins read the ledger
        ledger.QueryUsage(usage_pb2.QueryUsageRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    secret, _ = _key(auth)
    with pytest.raises(grpc.RpcError) as info:
        ledger.QueryUsage(usage_pb2.QueryUsageRequest(), metadata=auth.admin_md(secret), timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_spent_monthly_budget_is_insufficient_quota_until_the_month_ends(auth: Any) -> None:
    secret, key_id = _key(auth, monthly_token_budget=100)
    other_secret, other_id = _key(auth)
    assert auth.check(secret, extra={"x-request-id": "a"}).status.code == 0
    _report(auth, _usage(key_id, "a", 60), _usage(other_id, "o", 500))
    assert auth.check(secret, extra={"x-request-id": "b"}).status.code == 0  # 60 < 100
    _report(auth, _usage(key_id, "b", 40))
    refused = auth.check(secret, extra={"x-request-id": "c"})
    assert refused.status.code == RESOURCE_EXHAUSTED
    assert refused.denied_response.status.code == 429
    body = json.loads(refused.denied_response.body)
    assert body["error"]["code"] == body["error"]["type"] == "insufficient_quota"
    assert "100" in body["error"]["message"]
    headers = {h.header.key: h.header.value for h in refused.denied_response.headers}
    reset = month_end(auth.clock.now())
    left = (reset - auth.clock.now()).total_seconds()
    assert left <= int(headers["retry-after"]) <= left + 1
    assert auth.check(other_secret, extra={"x-request-id": "d"}).status.code == 0
    # The budget is per calendar month: the first request of the next month is served.
    auth.clock.advance((reset - auth.clock.now()).total_seconds() + 1)
    assert auth.check(secret, extra={"x-request-id": "e"}).status.code == 0
    # The budget is part of the key's limits, readable and updatable like the others.
    got = auth.keys.GetApiKey(
        auth_pb2.GetApiKeyRequest(name=f"api-keys/{key_id}"), metadata=auth.admin_md()
    )
    assert got.api_key.limits.monthly_token_budget == 100


def test_a_late_report_replaces_the_provisional_row_and_its_tokens_count(auth: Any) -> None:
    """A router that concluded a request without hearing how it ended reports it provisional
    (cancelled, no tokens); the replica's late report, sent again by the router, replaces the
    row and its tokens reach the key's monthly budget; a copy of it is a duplicate."""
    secret, key_id = _key(auth, monthly_token_budget=100)
    ledger = usage_pb2_grpc.UsageLedgerServiceStub(auth.channel)

    def row() -> usage_pb2.UsageRow:
        query = usage_pb2.QueryUsageRequest(key_id=key_id)
        (only,) = ledger.QueryUsage(query, metadata=auth.admin_md(), timeout=5).rows
        return only

    _report(auth, _usage(key_id, "p", 0, status="cancelled", provisional=True))
    assert (row().status, row().provisional) == ("cancelled", True)
    assert auth.check(secret, extra={"x-request-id": "q"}).status.code == 0
    heard = _usage(key_id, "p", 120, status="completed")
    _report(auth, heard)
    _report(auth, heard)
    refused = auth.check(secret, extra={"x-request-id": "r"})
    assert refused.status.code == RESOURCE_EXHAUSTED  # 120 of 100
    amended = row()
    assert (amended.status, amended.prompt_tokens + amended.completion_tokens) == ("completed", 120)
    assert not amended.provisional
    sample = auth.components.registry.get_sample_value
    assert sample("inferplane_auth_usage_requests_total", {"outcome": "accounted"}) == 1.0
    assert sample("inferplane_auth_usage_requests_total", {"outcome": "amended"}) == 1.0
    assert sample("inferplane_auth_usage_requests_total", {"outcome": "duplicate"}) == 1.0


# --- inferplane usage ----------------------------------------------------------------------


def _cli(auth: Any, *args: str) -> Any:
    from typer.testing import CliRunner

    from inferplane.auth.usage_cli import app

    env = {
        "INFERPLANE_ADMIN_KEY": auth.admin_key,
        "COLUMNS": "250",
        "INFERPLANE_PLAINTEXT": "1",  # the test service runs plaintext
    }
    return CliRunner().invoke(
        app, [*args, "--address", f"127.0.0.1:{auth.server.port}"], env=env, catch_exceptions=False
    )


def test_the_usage_cli_prints_rows_and_totals_as_table_csv_and_json(auth: Any) -> None:
    _, key_id = _key(auth, tenant="acme")
    _report(auth, *(_usage(key_id, f"cli-{n}", 10 + n, deployment="kimi-tiny") for n in range(3)))
    table = _cli(auth)
    assert table.exit_code == 0, table.output
    assert all(f"cli-{n}" in table.output for n in range(3)) and "kimi-tiny" in table.output
    rows = _cli(auth, "--format", "csv", "--tenant", "acme")
    lines = rows.output.strip().splitlines()
    assert lines[0].startswith("end_time,request_id,key_id,tenant") and len(lines) == 4
    grouped = _cli(auth, "--group-by", "key", "--format", "json")
    assert grouped.exit_code == 0, grouped.output
    (total,) = [json.loads(line) for line in grouped.output.splitlines()]
    assert total["group"] == key_id and total["requests"] == "3"  # uint64 as JSON text
    assert int(total["prompt_tokens"]) + int(total["completion_tokens"]) == 33
    assert _cli(auth, "--limit", "1", "--format", "csv").output.count("cli-") == 1
    bad = _cli(auth, "--group-by", "week")
    assert bad.exit_code == 1 and "INVALID_ARGUMENT" in bad.output
    since = _cli(auth, "--since", "not-a-time")
    assert since.exit_code == 2


def test_time_arguments() -> None:
    from inferplane.auth.usage_cli import parse_time

    now = datetime(2026, 11, 26, 12, tzinfo=UTC)
    assert parse_time("", now) is None
    assert parse_time("24h", now) == datetime(2026, 11, 25, 12, tzinfo=UTC)
    assert parse_time("7d", now) == datetime(2026, 11, 19, 12, tzinfo=UTC)
    assert parse_time("2026-11-01", now) == datetime(2026, 11, 1, tzinfo=UTC)
    assert parse_time("2026-11-01T02:00:00+02:00", now) == datetime(2026, 11, 1, tzinfo=UTC)
