"""Usage merged across regions (`inferplane.sdk.merge_usage`): each request id once, the copy
`MERGE_RULE` names kept whichever region it came from, rows labelled with their region, totals
and groups summed from the merged rows; a missing region keeps the report incomplete."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from inferplane.api.auth.v1 import usage_pb2
from inferplane.sdk import (
    MultiRegionUsage,
    UnavailableError,
    incomplete_usage_error,
    merge_usage,
)

T0 = datetime(2026, 11, 30, 22, 30, tzinfo=UTC)


def _row(request_id: str, minute: int = 0, tokens: int = 30, **kw: Any) -> usage_pb2.UsageRow:
    row = usage_pb2.UsageRow(
        request_id=request_id,
        key_id=kw.pop("key_id", "k1"),
        tenant="acme",
        model=kw.pop("model", "kimi-tiny"),
        status=kw.pop("status", "completed"),
        prompt_tokens=tokens // 3,
        completion_tokens=tokens - tokens // 3,
        gpu_seconds=kw.pop("gpu_seconds", 0.5),
        **kw,
    )
    row.end_time.FromDatetime(T0 + timedelta(minutes=minute))
    return row


def test_rows_of_distinct_requests_are_all_kept_labelled_and_ordered_by_end_time() -> None:
    merged = merge_usage(
        {"eu": [_row("eu-a", 0), _row("eu-b", 5)], "us": [_row("us-a", 2), _row("us-b", 7)]}
    )
    assert [(r.region, r.row.request_id) for r in merged.rows] == [
        ("eu", "eu-a"), ("us", "us-a"), ("eu", "eu-b"), ("us", "us-b"),
    ]  # fmt: skip
    assert merged.complete and merged.duplicates == 0 and merged.regions == ("eu", "us")
    totals = merged.totals()
    assert (totals.requests, totals.prompt_tokens + totals.completion_tokens) == (4, 120)
    assert totals.gpu_seconds == pytest.approx(2.0)


def test_a_request_in_two_regions_counts_once_and_the_final_copy_wins() -> None:
    # One id in both ledgers: a provisional, tokenless row in eu, the served request in us.
    provisional = _row("r1", 1, tokens=0, status="cancelled", provisional=True)
    served = _row("r1", 2, tokens=90)
    for regions in ({"eu": [provisional], "us": [served]}, {"us": [served], "eu": [provisional]}):
        merged = merge_usage(regions)
        (only,) = merged.rows
        assert (only.region, only.row.status, only.row.provisional) == ("us", "completed", False)
        assert merged.duplicates == 1
        assert merged.totals().requests == 1
        assert merged.totals().prompt_tokens + merged.totals().completion_tokens == 90


def test_completed_beats_failed_then_more_tokens_then_the_first_region_name() -> None:
    failed = _row("r", tokens=500, status="failed")
    done = _row("r", tokens=10)
    assert merge_usage({"eu": [failed], "us": [done]}).rows[0].region == "us"
    more = _row("r", tokens=40)
    assert merge_usage({"eu": [done], "us": [more]}).rows[0].region == "us"
    same = _row("r", tokens=10)
    assert merge_usage({"us": [done], "eu": [same]}).rows[0].region == "eu"
    assert merge_usage({"eu": [same], "us": [done]}).rows[0].region == "eu"
    # Non-provisional beats provisional even when the provisional copy says completed.
    guessed = _row("r", tokens=900, provisional=True)
    assert merge_usage({"eu": [guessed], "us": [failed]}).rows[0].region == "us"


def test_totals_and_groups_come_from_the_merged_rows() -> None:
    merged = merge_usage(
        {
            "eu": [_row("a", 0, 30, model="m1"), _row("b", 70, 60, model="m2", status="failed")],
            "us": [_row("a", 1, 30, model="m1"), _row("c", 130, 90, model="m1", key_id="k2")],
        }
    )
    assert merged.duplicates == 1 and len(merged.rows) == 3
    totals = merged.totals()
    assert (totals.requests, totals.failed_requests) == (3, 1)
    assert totals.prompt_tokens + totals.completion_tokens == 180
    by_region = {g.group: g.requests for g in merged.groups("region")}
    assert by_region == {"eu": 2, "us": 1}  # "a": equal copies, the first region name keeps it
    by_model = {g.group: g.prompt_tokens + g.completion_tokens for g in merged.groups("model")}
    assert by_model == {"m1": 120, "m2": 60}
    assert [g.group for g in merged.groups("key")] == ["k1", "k2"]
    # The ledger's labels: RFC 3339 bucket starts, UTC.
    assert [g.group for g in merged.groups("hour")] == [
        "2026-11-30T22:00:00Z", "2026-11-30T23:00:00Z", "2026-12-01T00:00:00Z",
    ]  # fmt: skip
    assert [g.group for g in merged.groups("day")] == [
        "2026-11-30T00:00:00Z",
        "2026-12-01T00:00:00Z",
    ]
    assert sum(g.requests for g in merged.groups("day")) == totals.requests
    with pytest.raises(ValueError, match="group_by"):
        merged.groups("week")


def test_a_missing_region_keeps_the_report_incomplete() -> None:
    down = UnavailableError("connection refused")
    merged = merge_usage({"eu": [_row("a")]}, missing={"us": down})
    assert not merged.complete and merged.missing == {"us": down}
    assert merged.regions == ("eu", "us")
    error = incomplete_usage_error(merged)
    assert isinstance(error, UnavailableError) and error.reason == "USAGE_INCOMPLETE"
    assert "region us (UNAVAILABLE: connection refused)" in error.message
    assert error.metadata == {"missing_regions": "us"}


def test_multi_region_usage_checks_region_names() -> None:
    with pytest.raises(ValueError, match="at least one region"):
        MultiRegionUsage({})
    with pytest.raises(ValueError, match="invalid region name"):
        MultiRegionUsage({"EU-1": "127.0.0.1:1"})
