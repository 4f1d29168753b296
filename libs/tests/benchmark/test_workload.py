"""Workload specs (`inferplane.benchmark.workload`): the committed ones load and map onto
GuideLLM's scenario; a bad spec is refused naming the field; the digest pins the content."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from inferplane.benchmark import (
    DEFAULT_WORKLOAD,
    WORKLOADS_DIR,
    WorkloadError,
    load_workload,
    validate_workload,
)
from inferplane.benchmark.runner import edge_target, scenario
from inferplane.wire.headers import REVISION


def _spec() -> dict[str, Any]:
    return json.loads((WORKLOADS_DIR / f"{DEFAULT_WORKLOAD}.json").read_text("utf-8"))


@pytest.mark.parametrize("path", sorted(WORKLOADS_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_every_committed_workload_loads(path: Path) -> None:
    workload = load_workload(path.stem)
    assert workload.name == path.stem
    assert workload.tokenizer_path().is_dir(), workload.tokenizer_path()


def test_the_default_workload_is_agentic_and_bounded() -> None:
    """agentic-v1: shared system prompts, multi-turn histories, Poisson arrivals, a seed, and
    bounds that keep one side well under a minute of requests."""
    workload = load_workload(DEFAULT_WORKLOAD)
    data = workload.guidellm_data()
    assert data["kind"] == "synthetic_text"
    assert data["turns"] > 1 and data["prefix_count"] >= 1 and data["prefix_tokens"] > 0
    assert workload.guidellm_profile()["kind"] == "poisson"
    assert workload.max_seconds < 60
    assert workload.seed == _spec()["seed"]


def test_the_digest_is_the_content_not_the_layout(tmp_path: Path) -> None:
    """Re-indenting or reordering keys keeps the digest; changing one figure changes it."""
    spec = _spec()
    same = tmp_path / f"{DEFAULT_WORKLOAD}.json"
    same.write_text(json.dumps(dict(reversed(list(spec.items()))), indent=4), "utf-8")
    assert load_workload(same).digest == load_workload(DEFAULT_WORKLOAD).digest
    changed = copy.deepcopy(spec)
    changed["arrivals"]["rate"] += 0.5
    assert validate_workload(changed).digest != load_workload(DEFAULT_WORKLOAD).digest


def test_the_scenario_is_deterministic_and_carries_the_pin(tmp_path: Path) -> None:
    """Two scenarios of one spec are equal (same seed, data, profile); the revision goes as
    the pin header, none without a revision; the target drops `/v1`."""
    workload = load_workload(DEFAULT_WORKLOAD)
    args: dict[str, Any] = {
        "base_url": "http://127.0.0.1:8080/v1",
        "api_key": "ip-key",
        "model": "kimi-tiny",
        "tokenizer": tmp_path,
        "report_path": tmp_path / "out.json",
    }
    one = scenario(workload, revision="rev-a", **args)
    assert one == scenario(workload, revision="rev-a", **args)
    spec = one["spec"]
    assert spec["seed"] == {"kind": "static", "value": workload.seed}
    assert spec["backend"]["target"] == "http://127.0.0.1:8080"
    assert spec["backend"]["extras"]["headers"] == {REVISION: "rev-a"}
    assert "extras" not in scenario(workload, revision="", **args)["spec"]["backend"]
    assert spec["constraints"] == [
        {"kind": "max_requests", "count": workload.spec["bounds"]["max_requests"]},
        {"kind": "max_duration", "seconds": workload.max_seconds},
    ]
    assert edge_target("https://edge.example/v1/") == "https://edge.example"


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda s: s.pop("seed"), "(root)"),
        (lambda s: s["arrivals"].update(kind="burst"), "arrivals.kind"),
        (lambda s: s["arrivals"].update(rate=0), "arrivals.rate"),
        (lambda s: s["conversations"].update(turns=0), "conversations.turns"),
        (lambda s: s["conversations"]["output_tokens"].update(min=1000), "output_tokens"),
        (lambda s: s.update(extra=1), "(root)"),
    ],
    ids=["no-seed", "unknown-arrivals", "zero-rate", "no-turns", "min-above-mean", "unknown"],
)
def test_a_bad_spec_is_refused_naming_the_field(edit: Any, field: str) -> None:
    spec = _spec()
    edit(spec)
    with pytest.raises(WorkloadError, match=field.replace("(", r"\(").replace(")", r"\)")):
        validate_workload(spec, "x.json")


def test_unknown_workload_names_the_known_ones() -> None:
    with pytest.raises(WorkloadError, match=f"known: .*{DEFAULT_WORKLOAD}"):
        load_workload("no-such-workload")


def test_a_name_that_differs_from_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps(_spec()), "utf-8")
    with pytest.raises(WorkloadError, match="differs from the file's stem"):
        load_workload(path)
