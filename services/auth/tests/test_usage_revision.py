"""The usage ledger's `revision` column (issue 30): a router's report names the profile
revision of the replica that served a request, the ledger keeps it (migration 0006), rows show
it and `group_by: revision` totals by it (a canary's usage beside its stable revision's). Real
parts: the auth service over gRPC, SQLite (and PostgreSQL when configured) for the store."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from inferplane.api.auth.v1 import auth_pb2, usage_pb2, usage_pb2_grpc
from inferplane.auth.ledger import LedgerRow, SqlUsageLedger, UsageQuery
from inferplane.testing.databases import database_or_skip

T0 = datetime(2026, 11, 29, 12, tzinfo=UTC)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlUsageLedger]:
    with database_or_skip(request.param, tmp_path) as url:
        store = SqlUsageLedger(url)
        store.create_schema()
        try:
            yield store
        finally:
            store.close()


def test_the_ledger_keeps_the_revision_and_groups_by_it(ledger: SqlUsageLedger) -> None:
    rows = [
        LedgerRow(f"r{i}", "k1", "acme", "kimi-tiny", T0, prompt_tokens=10, revision=revision)
        for i, revision in enumerate(["rev-1", "rev-2", "rev-1", ""])
    ]
    ledger.record(rows)
    page = ledger.query(UsageQuery())
    assert {r.request_id: r.revision for r in page.rows} == {
        "r0": "rev-1",
        "r1": "rev-2",
        "r2": "rev-1",
        "r3": "",
    }
    grouped = ledger.query(UsageQuery(group_by="revision"))
    assert [(g.group, g.requests, g.prompt_tokens) for g in grouped.groups] == [
        ("", 1, 10),
        ("rev-1", 2, 20),
        ("rev-2", 1, 10),
    ]


def test_a_report_s_revision_reaches_the_admin_query_and_its_grouping(auth: Any) -> None:
    created = auth.keys.CreateApiKey(
        auth_pb2.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(tenant="acme")),
        metadata=auth.admin_md(),
    )
    key_id = created.api_key.name.split("/")[1]
    usage_pb2_grpc.UsageServiceStub(auth.channel).ReportUsage(
        usage_pb2.ReportUsageRequest(
            usage=[
                usage_pb2.RequestUsage(
                    key_id=key_id, request_id="a", model="kimi-tiny", revision="rev-canary"
                ),
                usage_pb2.RequestUsage(
                    key_id=key_id, request_id="b", model="kimi-tiny", revision="rev-stable"
                ),
                usage_pb2.RequestUsage(
                    key_id=key_id, request_id="c", model="kimi-tiny", revision="rev-stable"
                ),
            ]
        ),
        timeout=5,
    )
    ledger = usage_pb2_grpc.UsageLedgerServiceStub(auth.channel)
    answer = ledger.QueryUsage(usage_pb2.QueryUsageRequest(), metadata=auth.admin_md(), timeout=5)
    assert {r.request_id: r.revision for r in answer.rows} == {
        "a": "rev-canary",
        "b": "rev-stable",
        "c": "rev-stable",
    }
    grouped = ledger.QueryUsage(
        usage_pb2.QueryUsageRequest(group_by="revision"), metadata=auth.admin_md(), timeout=5
    )
    assert [(g.group, g.requests) for g in grouped.groups] == [
        ("rev-canary", 1),
        ("rev-stable", 2),
    ]
