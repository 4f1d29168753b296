"""Trims a GuideLLM 0.8 JSON report into a committed test fixture: one request kept per list,
the per-modality and per-turn metrics dropped.

    python libs/tests/benchmark/data/trim_report.py GUIDELLM.json OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(source: Path, target: Path) -> None:
    report = json.loads(source.read_text("utf-8"))
    benchmark = report["benchmarks"][0]
    for kind in ("successful", "incomplete", "errored"):
        benchmark["requests"][kind] = benchmark["requests"][kind][:1]
    for metric in ("text", "turns", "image", "video", "audio", "tool_call"):
        benchmark["metrics"].pop(metric, None)
    target.write_text(json.dumps(report, separators=(",", ":")), "utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
