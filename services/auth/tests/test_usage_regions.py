"""`inferplane usage --region NAME=HOST:PORT ...` and the SDK's `AsyncMultiRegionUsage` against
two real auth services on loopback, one per region, each with its own ledger: every request
once (a request in both ledgers, provisional in one, counts once with the other's tokens),
a region column, totals from the merged rows, and a region that cannot be read failing the
command (or, with `--partial`, a report marked INCOMPLETE with exit code 3)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferplane.api.auth.v1 import auth_pb2, usage_pb2, usage_pb2_grpc
from inferplane.sdk import AsyncMultiRegionUsage, UnavailableError

PLAINTEXT = {"INFERPLANE_PLAINTEXT": "1"}  # the test services run plaintext


@pytest.fixture
def regions(tmp_path: Path, make_settings: Any, start_auth: Any) -> Iterator[dict[str, Any]]:
    """Two auth services, "eu" and "us", with usage in each; "r-dup" is in both ledgers (a
    provisional, tokenless row in eu; the served request, 90 tokens, in us)."""
    with (
        start_auth(make_settings(tmp_path / "eu")) as eu,
        start_auth(make_settings(tmp_path / "us")) as us,
    ):
        for auth, rows in (
            (eu, [("eu-1", 30, {}), ("r-dup", 0, {"status": "cancelled", "provisional": True})]),
            (us, [("us-1", 60, {}), ("us-2", 12, {"status": "failed"}), ("r-dup", 90, {})]),
        ):
            key = auth.keys.CreateApiKey(
                auth_pb2.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(tenant="acme")),
                metadata=auth.admin_md(),
            ).api_key.name.split("/")[1]
            usage = [
                usage_pb2.RequestUsage(
                    key_id=key,
                    request_id=rid,
                    model="kimi-tiny",
                    prompt_tokens=t // 3,
                    completion_tokens=t - t // 3,
                    **kw,
                )
                for rid, t, kw in rows
            ]
            usage_pb2_grpc.UsageServiceStub(auth.channel).ReportUsage(
                usage_pb2.ReportUsageRequest(usage=usage), timeout=5
            )
        yield {"eu": eu, "us": us}


def _address(auth: Any) -> str:
    return f"127.0.0.1:{auth.server.port}"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(auth: Any, *args: str) -> Any:
    from typer.testing import CliRunner

    from inferplane.auth.usage_cli import app

    env = {"INFERPLANE_ADMIN_KEY": auth.admin_key, "COLUMNS": "300", **PLAINTEXT}
    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)


def _region_args(regions: dict[str, Any]) -> list[str]:
    return [
        arg for name, auth in regions.items() for arg in ("--region", f"{name}={_address(auth)}")
    ]


def test_the_usage_cli_merges_every_regions_ledger_each_request_once(
    regions: dict[str, Any],
) -> None:
    eu = regions["eu"]
    rows = _cli(eu, *_region_args(regions), "--format", "json")
    assert rows.exit_code == 0, rows.output
    found = [json.loads(line) for line in rows.stdout.splitlines()]
    assert sorted((r["region"], r["request_id"]) for r in found) == [
        ("eu", "eu-1"), ("us", "r-dup"), ("us", "us-1"), ("us", "us-2"),
    ]  # fmt: skip
    (dup,) = [r for r in found if r["request_id"] == "r-dup"]
    assert dup["status"] == "completed" and not dup["provisional"]
    assert "4 requests, 192 tokens from regions eu, us; duplicates dropped: 1" in rows.stderr

    table = _cli(eu, *_region_args(regions))
    assert table.exit_code == 0, table.output
    header = table.stdout.splitlines()[1]
    assert header.index("region") < header.index("end_time")  # the first column
    csv_rows = _cli(eu, *_region_args(regions), "--format", "csv").stdout.splitlines()
    assert csv_rows[0].startswith("region,end_time,request_id") and len(csv_rows) == 5

    grouped = _cli(eu, *_region_args(regions), "--group-by", "region", "--format", "json")
    assert grouped.exit_code == 0, grouped.output
    totals = {g["group"]: g for g in map(json.loads, grouped.stdout.splitlines())}
    assert {name: int(g["requests"]) for name, g in totals.items()} == {"eu": 1, "us": 3}
    assert int(totals["us"]["failed_requests"]) == 1
    assert (
        sum(int(g["prompt_tokens"]) + int(g["completion_tokens"]) for g in totals.values()) == 192
    )
    by_model = _cli(eu, *_region_args(regions), "--group-by", "model", "--format", "json")
    (model,) = map(json.loads, by_model.stdout.splitlines())
    assert (model["group"], model["requests"]) == ("kimi-tiny", "4")

    bad = _cli(eu, "--region", "EU=127.0.0.1:1")
    assert bad.exit_code == 2 and "invalid region name" in bad.output
    twice = _cli(eu, "--region", f"eu={_address(eu)}", "--region", f"eu={_address(eu)}")
    assert twice.exit_code == 2 and "given twice" in twice.output


def test_a_region_that_cannot_be_read_fails_the_report_or_marks_it_incomplete(
    regions: dict[str, Any],
) -> None:
    eu = regions["eu"]
    args = ["--region", f"eu={_address(eu)}", "--region", f"us=127.0.0.1:{_closed_port()}"]
    failed = _cli(eu, *args, "--timeout", "10", "--format", "csv")
    assert failed.exit_code == 1
    assert failed.stdout == ""  # nothing printed: no partial total passes as complete
    assert "usage report incomplete: could not read region us (UNAVAILABLE" in failed.stderr

    partial = _cli(eu, *args, "--timeout", "10", "--format", "csv", "--partial")
    assert partial.exit_code == 3
    assert [line.split(",")[0] for line in partial.stdout.splitlines()] == ["region", "eu", "eu"]
    assert "INCOMPLETE: could not read region us (UNAVAILABLE" in partial.stderr


def test_the_async_sdk_merges_regions_and_names_the_missing_one(
    regions: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in PLAINTEXT.items():
        monkeypatch.setenv(name, value)
    eu, us = regions["eu"], regions["us"]

    async def read(**addresses: str) -> Any:
        async with AsyncMultiRegionUsage(addresses, admin_key=eu.admin_key, timeout=10) as usage:
            partial = await usage.rows(tenant="acme", partial=True)
            try:
                return partial, await usage.rows(tenant="acme"), None
            except UnavailableError as exc:
                return partial, None, exc

    again, merged, error = asyncio.run(read(eu=_address(eu), us=_address(us)))
    assert merged.complete and error is None and merged.regions == ("eu", "us")
    assert [(r.region, r.row.request_id) for r in merged.rows if r.row.request_id == "r-dup"] == [
        ("us", "r-dup")
    ]
    assert merged.totals().requests == 4 and merged.duplicates == 1 and again == merged

    partial, cut, error = asyncio.run(read(eu=_address(eu), us=f"127.0.0.1:{_closed_port()}"))
    assert cut is None  # never a report without us unless partial=True asked for one
    assert not partial.complete and list(partial.missing) == ["us"]
    assert [r.row.request_id for r in partial.rows] == ["eu-1", "r-dup"]
    assert error is not None and error.reason == "USAGE_INCOMPLETE"
    assert error.metadata == {"missing_regions": "us"}
