"""GuideLLM, the load tool platform teams benchmark releases with, against the whole stack
(issue 27: it used to fail 100% of its requests, on `stream_options.continuous_usage_stats`).

GuideLLM 0.8 (its own environment, `.venv-guidellm`, made by scripts/setup.sh from
bench/guidellm.lock) with its default `openai_http` backend (streamed chat completions, vLLM's
`continuous_usage_stats` and `ignore_eos` in every body), the stack's key, synthetic prompts
sized for kimi-tiny's context, a concurrency sweep of 1, 4 and 8 streams, 10 s each:
the report counts no errored request at any level, and the sweep completed requests.
bench/README.md ("GuideLLM") has the full how-to-run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
STREAMS = (1, 4, 8)
SECONDS_PER_LEVEL = 10


def test_guidellm_concurrency_sweep_has_no_errors(
    stack: Stack, api_key: str, tmp_path: Path
) -> None:
    if not GUIDELLM.exists():
        pytest.fail(f"{GUIDELLM} is missing: scripts/setup.sh installs it (bench/guidellm.lock)")
    report = tmp_path / "guidellm.json"
    target = stack.config.base_url.removesuffix("/").removesuffix("/v1")
    command = [
        str(GUIDELLM),
        "run",
        "--backend",
        f"kind=openai_http,target={target},model={MODEL_NAME},api_key={api_key}",
        "--profile",
        "kind=concurrent," + ",".join(f"streams[{i}]={n}" for i, n in enumerate(STREAMS)),
        "--constraint",
        f"kind=max_duration,seconds={SECONDS_PER_LEVEL}",
        "--data",
        "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--tokenizer",
        f"kind=huggingface_auto,model={kimi_tiny.model_path()}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == len(STREAMS), done.stdout[-2000:]
    successful = 0
    for benchmark in benchmarks:
        totals = benchmark["metrics"]["request_totals"]
        errors = [r.get("info", {}).get("error") for r in benchmark["requests"]["errored"]]
        assert totals["errored"] == 0, errors[:3]
        assert totals["total"] > 0, totals
        successful += totals["successful"]
    # Requests still running when a level's time is up are "incomplete" (GuideLLM cancels
    # them), not errors; on two shared cores a level can end before its first completes.
    assert successful > 0
