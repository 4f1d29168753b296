"""What auth accounted: its `usage_accounted` debug lines, by the edge's request id; and the
streams replicas moved to a sibling when their engine died (`moved_streams`)."""

from __future__ import annotations

import collections
import contextlib
import re
import time
from collections.abc import Sequence
from pathlib import Path

from .streams import Request

_ACCOUNTED = re.compile(r"usage_accounted\b.*?request_id[\"'=:\s]+([0-9A-Za-z_.:-]+)")
_REPLACED = re.compile(r"replaced[\"'=:\s]+(?:True|true)\b")


class UsageLedger:
    """Request ids auth accounted, read from its log (every instance's lines: a restarted
    auth appends to the same file), by the `usage_accounted` debug line. A line with
    `replaced=True` amends a provisional row (the replica's late report): not a copy."""

    def __init__(self, log_path: Path) -> None:
        self._path = log_path

    def counts(self) -> collections.Counter[str]:
        """Request id → how many times auth accounted it (amendments not counted)."""
        counts: collections.Counter[str] = collections.Counter()
        with contextlib.suppress(OSError), self._path.open(errors="replace") as log:
            for line in log:
                if "usage_accounted" not in line or _REPLACED.search(line):
                    continue  # a provisional row replaced by the late report: not a copy
                if match := _ACCOUNTED.search(line):
                    counts[match.group(1)] += 1
        return counts


def moved_streams(data_dir: Path) -> int:
    """How many streams the replicas under `data_dir` moved to a sibling so far: their
    `stream_migrated` log lines (mid-stream migration, issue 31)."""
    moved = 0
    for log in data_dir.rglob("replica.log"):
        with contextlib.suppress(OSError), log.open(errors="replace") as lines:
            moved += sum(1 for line in lines if '"stream_migrated"' in line)
    return moved


def settle_usage(
    ledger: UsageLedger, requests: Sequence[Request], timeout_s: float
) -> collections.Counter[str]:
    """Waits until auth accounted every served request (or `timeout_s`); returns the counts."""
    served = {r.request_id for r in requests if r.status == 200 and r.request_id}
    deadline = time.monotonic() + timeout_s
    while True:
        counts = ledger.counts()
        if served <= set(counts) or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)
