"""The usage ledger's `adapter` column (issue 29): a router's report names the LoRA adapter that
served a request, the ledger keeps it (migration 0005), rows show it and `group_by: adapter`
totals by it ("" = the base model). Real parts: the auth service over gRPC, SQLite (and
PostgreSQL when configured) for the store."""

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


def test_the_ledger_keeps_the_adapter_and_groups_by_it(ledger: SqlUsageLedger) -> None:
    rows = [
        LedgerRow(f"r{i}", "k1", "acme", model, T0, prompt_tokens=10, adapter=adapter)
        for i, (model, adapter) in enumerate(
            [("kimi-tiny", ""), ("kimi-tiny:pirate", "pirate"), ("arr", "pirate")]
        )
    ]
    ledger.record(rows)
    page = ledger.query(UsageQuery())
    adapters = {r.request_id: r.adapter for r in page.rows}
    assert adapters == {"r0": "", "r1": "pirate", "r2": "pirate"}
    grouped = ledger.query(UsageQuery(group_by="adapter"))
    assert [(g.group, g.requests, g.prompt_tokens) for g in grouped.groups] == [
        ("", 1, 10),
        ("pirate", 2, 20),
    ]


def test_a_report_s_adapter_reaches_the_admin_query(auth: Any) -> None:
    created = auth.keys.CreateApiKey(
        auth_pb2.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(tenant="acme")),
        metadata=auth.admin_md(),
    )
    key_id = created.api_key.name.split("/")[1]
    usage_pb2_grpc.UsageServiceStub(auth.channel).ReportUsage(
        usage_pb2.ReportUsageRequest(
            usage=[
                usage_pb2.RequestUsage(
                    key_id=key_id, request_id="a", model="kimi-tiny:pirate", adapter="pirate"
                ),
                usage_pb2.RequestUsage(key_id=key_id, request_id="b", model="kimi-tiny"),
            ]
        ),
        timeout=5,
    )
    ledger = usage_pb2_grpc.UsageLedgerServiceStub(auth.channel)
    answer = ledger.QueryUsage(usage_pb2.QueryUsageRequest(), metadata=auth.admin_md(), timeout=5)
    assert {r.request_id: r.adapter for r in answer.rows} == {"a": "pirate", "b": ""}
