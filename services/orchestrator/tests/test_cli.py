"""`inferplane deployments create/list/explain` against a running orchestrator."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.cli import app

DEPLOYMENT_YAML = """\
deployment_id: llama-8b
aliases: [meta-llama/Llama-3.1-8B-Instruct]
replicas: 2
profile:
  model_source: meta-llama/Llama-3.1-8B-Instruct
  precision: bf16
  parameter_count: 8030000000
  num_layers: 32
  num_kv_heads: 8
  head_dim: 128
  max_model_len: 8192
  max_num_seqs: 8
"""

# The in-process test service runs plaintext: the CLI is told so explicitly.
PLAINTEXT = {"INFERPLANE_PLAINTEXT": "1"}


def cli_lines(output: str) -> list[str]:
    """The CLI's own lines (the in-process server's log lines share stdout here)."""
    return [line for line in output.splitlines() if not line[:4].isdigit()]


def test_create_list_explain(orch: Any, fx: Any, tmp_path: Path) -> None:
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status("g", gpus=2)), timeout=10)
    spec = tmp_path / "deployment.yaml"
    spec.write_text(DEPLOYMENT_YAML)
    runner = CliRunner(env=PLAINTEXT)
    address = ["--address", orch.address]

    created = runner.invoke(app, ["create", "--file", str(spec), *address])
    assert created.exit_code == 0, created.output
    lines = cli_lines(created.output)
    assert re.fullmatch(
        r"deployments/llama-8b created: revision [0-9a-f]{16}, Progressing: "
        r"2 of 2 replicas placed, 0 ready",
        lines[0],
    )
    assert "llama-8b-0 → g GPU 0: 28 GB per GPU = 0.3503 of 80 GB" in created.output
    # one node: best fit shares GPU 0 (spread is across nodes; GPU 1 stays whole)
    assert "llama-8b-1 → g GPU 0: 28 GB per GPU" in created.output

    listed = runner.invoke(app, ["list", *address])
    assert listed.exit_code == 0, listed.output
    assert "llama-8b" in listed.output and "0/2" in listed.output and "Progressing" in listed.output

    explained = runner.invoke(app, ["explain", "meta-llama/Llama-3.1-8B-Instruct", *address])
    assert explained.exit_code == 0, explained.output
    assert cli_lines(explained.output)[0].startswith("deployments/llama-8b (revision ")

    again = runner.invoke(app, ["create", "--file", str(spec), *address])
    assert again.exit_code == 1
    assert "error: ALREADY_EXISTS: deployment id 'llama-8b' is already used" in again.output


def test_unplaceable_replicas_say_exactly_why(orch: Any, fx: Any, tmp_path: Path) -> None:
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status("g", gpus=1)), timeout=10)
    spec = tmp_path / "d.yaml"
    spec.write_text(DEPLOYMENT_YAML.replace("replicas: 2", "replicas: 3"))
    result = CliRunner(env=PLAINTEXT).invoke(
        app, ["create", "-f", str(spec), "--address", orch.address]
    )
    assert result.exit_code == 0, result.output
    assert "Degraded: 2 of 3 replicas placed; llama-8b-2 cannot be placed" in result.output
    assert cli_lines(result.output)[-1] == (
        "llama-8b-2 cannot be placed: needs 1 GPU with 28 GB free (8.03B at bf16 needs 16.1 GB "
        "of weights + 8.6 GB KV budget + 3.4 GB overhead = 28 GB per GPU at TP=1); 0 of 1 GPU "
        "nodes can host it: 1 lack free memory (closest: g has 0 GPUs with ≥ 28 GB free; its "
        "freest GPU has 23.9 GB)"
    )


def test_bad_file_and_unknown_deployment(orch: Any, tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("deployment_id: x\nprofile: {precission: fp8}\n")
    runner = CliRunner(env=PLAINTEXT)
    bad = runner.invoke(app, ["create", "-f", str(spec), "--address", orch.address])
    assert bad.exit_code == 2 and "precission" in bad.output
    missing = runner.invoke(app, ["explain", "nope", "--address", orch.address])
    assert missing.exit_code == 1
    assert "error: NOT_FOUND: deployments/nope not found" in missing.output
