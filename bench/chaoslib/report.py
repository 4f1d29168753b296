"""One fault's figures (`Row`) and how the bench prints them: the table, the evidence, the
last lines."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Sequence

from .faults import Fault
from .streams import (
    AFTER_FIRST_BYTE,
    COMPLETED,
    CUT_SILENTLY,
    ENDED_BY_ERROR_EVENT,
    FAILED_BEFORE_FIRST_TOKEN,
    RESET_AFTER_FIRST_BYTE,
    Request,
)


@dataclasses.dataclass
class Row:
    """One fault's requests and what auth accounted of them."""

    fault: Fault
    requests: list[Request]
    accounted: collections.Counter[str]
    retries: int  # Envoy's upstream_rq_retry of the replicas cluster over the phase
    fault_at: float  # monotonic
    recovery_s: float | None  # fault → the first probe started after it completed
    wall_s: float
    migrated: int = 0  # streams the replicas moved to a sibling during the phase

    def outcomes(self, *outcomes: str) -> list[Request]:
        """The requests that ended as any of `outcomes` (streams.py's constants)."""
        return [r for r in self.requests if r.outcome in outcomes]

    @property
    def lost(self) -> list[Request]:
        """Served (HTTP 200) requests auth never accounted."""
        return [r for r in self.requests if r.status == 200 and not self.accounted[r.request_id]]

    @property
    def doubled(self) -> list[Request]:
        """Requests auth accounted more than once."""
        return [r for r in self.requests if r.request_id and self.accounted[r.request_id] > 1]

    def in_flight(self) -> str:
        """How the load's streams in flight at the fault ended, e.g. `4: completed ×4`."""
        cut = [
            r
            for r in self.requests
            if r.client == "load" and r.started_at < self.fault_at < (r.ended_at or math.inf)
        ]
        outcomes = collections.Counter(r.outcome for r in cut)
        return f"{len(cut)}: " + ", ".join(f"{o} ×{n}" for o, n in outcomes.most_common())

    def protocols(self) -> str:
        """The HTTP versions the responses came on, e.g. `HTTP/2 ×40`."""
        versions = collections.Counter(r.http_version for r in self.requests if r.http_version)
        return ", ".join(f"{v} ×{n}" for v, n in versions.most_common())

    def refusals(self) -> str:
        codes = collections.Counter(r.error_code for r in self.outcomes(FAILED_BEFORE_FIRST_TOKEN))
        return ", ".join(f"{code} ×{n}" for code, n in codes.most_common())

    def figures(self) -> dict[str, int]:
        """The bench's per-fault last-line figures."""
        return {
            "silent_truncations": len(self.outcomes(CUT_SILENTLY)),
            "reset_streams": len(self.outcomes(RESET_AFTER_FIRST_BYTE)),
            "lost_usage_records": len(self.lost),
            "failed_after_first_byte": len(self.outcomes(*AFTER_FIRST_BYTE)),
            "migrated_streams": self.migrated,
        }


HEADER = (
    "| fault | sent | completed | failed before 1st token (codes) | ended by error event "
    "| reset after 1st byte | cut silently | usage lost / doubled | Envoy retries | recovery s |"
)
SEPARATOR = "|" + "---|" * 10


def table_row(row: Row) -> str:
    failed = row.outcomes(FAILED_BEFORE_FIRST_TOKEN)
    refusals = f" ({row.refusals()})" if failed else ""
    recovery = f"{row.recovery_s:.1f}" if row.recovery_s is not None else "not recovered"
    return (
        f"| {row.fault.what} | {len(row.requests)} | {len(row.outcomes(COMPLETED))} "
        f"| {len(failed)}{refusals} | {len(row.outcomes(ENDED_BY_ERROR_EVENT))} "
        f"| {len(row.outcomes(RESET_AFTER_FIRST_BYTE))} | {len(row.outcomes(CUT_SILENTLY))} "
        f"| {len(row.lost)} / {len(row.doubled)} | {row.retries} | {recovery} |"
    )


def evidence(row: Row, limit: int = 3) -> Iterable[str]:
    """Lines describing the requests that failed after the first byte or missed a usage goal
    (reset, cut silently, usage lost/doubled)."""
    for label, requests in (
        ("reset after the first byte", row.outcomes(RESET_AFTER_FIRST_BYTE)),
        ("cut silently", row.outcomes(CUT_SILENTLY)),
        ("usage lost", row.lost),
        ("usage doubled", row.doubled),
    ):
        for request in requests[:limit]:
            described = request.describe(row.fault_at)
            yield f"  {row.fault.name}: {label}: {described} ({request.outcome})"
        if len(requests) > limit:
            yield f"  {row.fault.name}: {label}: ... and {len(requests) - limit} more"


def last_lines(rows: Sequence[Row]) -> list[str]:
    """`<figure> <fault>: N` per fault, then `doubled_usage_records` and the totals:
    `silent_truncations` (goal 0), `reset_streams`, `lost_usage_records` (goal 0),
    `failed_after_first_byte`, `migrated_streams` (moved to a sibling when their engine died)."""
    lines = [
        f"{name} {row.fault.name}: {value}" for row in rows for name, value in row.figures().items()
    ]
    lines.append(f"doubled_usage_records: {sum(len(r.doubled) for r in rows)}")
    for name in (
        "silent_truncations",
        "reset_streams",
        "lost_usage_records",
        "failed_after_first_byte",
        "migrated_streams",
    ):
        lines.append(f"{name}: {sum(r.figures()[name] for r in rows)}")
    return lines
