"""The runner and `inferplane bench` around a stand-in GuideLLM (`INFERPLANE_GUIDELLM`: a
script that keeps the scenario it was given and writes the recorded report where the
scenario says): the scenario file (the key, the pin header, 0600, removed after), the report,
GuideLLM failing or hanging, and the command's output and stored report. The real GuideLLM
through the real edge: tests/e2e/test_bench.py."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from inferplane.benchmark import BenchmarkError, BenchReport, load_workload, run_workload
from inferplane.cli._app import app
from inferplane.wire.headers import REVISION

RECORDED = Path(__file__).parent / "data" / "guidellm-agentic-v1.json"
KEY = "ip-operator-secret-0123456789"

FAKE = """#!{python}
import json, os, shutil, stat, sys, time
path = sys.argv[sys.argv.index("-c") + 1]
capture = os.environ["FAKE_GUIDELLM_CAPTURE"]
with open(capture, "w") as out:
    json.dump({{"argv": sys.argv[1:], "mode": stat.S_IMODE(os.stat(path).st_mode),
               "scenario": json.load(open(path)), "path": path,
               "workers": os.environ.get("GUIDELLM__MAX_WORKER_PROCESSES")}}, out)
behaviour = os.environ.get("FAKE_GUIDELLM", "ok")
if behaviour == "fail":
    print("boom: cannot reach the target")
    sys.exit(2)
if behaviour == "hang":
    time.sleep(60)
target = json.load(open(path))["spec"]["outputs"][0]["path"]
shutil.copy({recorded!r}, target)
"""


@pytest.fixture
def fake_guidellm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "guidellm"
    script.write_text(FAKE.format(python=sys.executable, recorded=str(RECORDED)), "utf-8")
    script.chmod(0o755)
    capture = tmp_path / "capture.json"
    monkeypatch.setenv("INFERPLANE_GUIDELLM", str(script))
    monkeypatch.setenv("FAKE_GUIDELLM_CAPTURE", str(capture))
    return capture


def _captured(capture: Path) -> dict[str, Any]:
    return dict(json.loads(capture.read_text("utf-8")))


def test_a_run_passes_the_whole_spec_and_reads_the_report(fake_guidellm: Path) -> None:
    workload = load_workload("agentic-v1")
    report = run_workload(
        "http://127.0.0.1:9/v1",
        KEY,
        "kimi-tiny",
        workload,
        "rev-a",
        30,
        environment={"engine_versions": {"rev-a": "0.32.0"}},
    )
    seen = _captured(fake_guidellm)
    assert seen["argv"][:2] == ["run", "-c"] and seen["mode"] == 0o600
    assert not Path(seen["path"]).exists()  # the key's file is gone with its folder
    backend = seen["scenario"]["spec"]["backend"]
    assert backend["api_key"] == KEY and backend["target"] == "http://127.0.0.1:9"
    assert backend["extras"]["headers"] == {REVISION: "rev-a"}
    assert seen["workers"] == str(workload.worker_processes)
    assert isinstance(report, BenchReport)
    assert (report.revision, report.workload_digest) == ("rev-a", workload.digest)
    assert report.requests_successful > 0 and report.ttft_p99_seconds > 0
    assert report.environment["engine_versions"] == {"rev-a": "0.32.0"}
    assert report.environment["guidellm_version"] == "0.8.1"
    assert report.wall_seconds > 0


def test_guidellm_failing_is_a_benchmark_error_with_its_output(
    fake_guidellm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_GUIDELLM", "fail")
    with pytest.raises(BenchmarkError, match="exited with 2: boom"):
        run_workload("http://127.0.0.1:9/v1", KEY, "m", load_workload("agentic-v1"), None, 30)


def test_guidellm_hanging_is_killed_at_the_timeout(
    fake_guidellm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_GUIDELLM", "hang")
    started = time.monotonic()
    with pytest.raises(BenchmarkError, match="did not finish within 1 s"):
        run_workload("http://127.0.0.1:9/v1", KEY, "m", load_workload("agentic-v1"), None, 1.0)
    assert time.monotonic() - started < 10


def test_a_missing_guidellm_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERPLANE_GUIDELLM", "/nonexistent/guidellm")
    with pytest.raises(BenchmarkError, match=r"scripts/setup\.sh"):
        run_workload("http://127.0.0.1:9/v1", KEY, "m", load_workload("agentic-v1"), None, 5)


def test_inferplane_bench_prints_and_stores_the_report(fake_guidellm: Path, tmp_path: Path) -> None:
    """`inferplane bench` with the local stack's defaults (its stack.json and operator key
    file) prints the figures and stores a 0600 report that reads back."""
    data = tmp_path / "state"
    (data / "orchestrator").mkdir(parents=True)
    (data / "stack.json").write_text(json.dumps({"base_url": "http://127.0.0.1:9/v1"}), "utf-8")
    (data / "orchestrator" / "benchmark-api-key").write_text(KEY + "\n", "utf-8")
    out = tmp_path / "reports"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--model",
            "kimi-tiny",
            "--revision",
            "rev-a",
            "--data-dir",
            str(data),
            "--out",
            str(out),
        ],
        env={"INFERPLANE_API_KEY": ""},
    )
    assert result.exit_code == 0, result.output
    assert "TTFT p50 / p99" in result.output and "output tokens/s" in result.output
    assert _captured(fake_guidellm)["scenario"]["spec"]["backend"]["api_key"] == KEY
    (stored,) = out.glob("*.json")
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    back = BenchReport.from_json(json.loads(stored.read_text("utf-8")))
    assert (back.model, back.revision, back.workload) == ("kimi-tiny", "rev-a", "agentic-v1")
    assert back.raw["metadata"]["guidellm_version"] == "0.8.1"


def test_inferplane_bench_without_a_target_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["bench", "--model", "m", "--data-dir", str(tmp_path)], env={"INFERPLANE_API_KEY": ""}
    )
    assert result.exit_code == 2 and "no --base-url" in result.output
