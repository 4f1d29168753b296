"""`inferplane deployments compat list|forced` and `create/update --force --force-reason`
against a running orchestrator (in-process, plaintext)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.cli import app

PLAINTEXT = {"INFERPLANE_PLAINTEXT": "1"}
KIMI_YAML = """\
deployment_id: kimi
profile:
  model_source: /models/kimi-tiny
  engine: vllm-cpu
  precision: fp32
  parameter_count: 750000
  num_layers: 2
  num_kv_heads: 2
  head_dim: 32
  max_model_len: 2048
  max_num_seqs: 8
  reasoning_parser: kimi_k2
  tool_parser: kimi_k2
"""
PIN_YAML = """\
deployment_id: kimi
profile:
  engine_version: 0.31.0
"""


def artifacts(version: str) -> replica_pb2.ReplicaArtifacts:
    return replica_pb2.ReplicaArtifacts(
        engine="vllm-cpu",
        engine_version=version,
        model_digest="sha256:kimi",
        chat_template_digest="sha256:template",
        parser="kimi_k2/kimi_k2",
    )


def record(orch: Any, verdict: str, version: str) -> None:
    orch.components.compat.matrix.record(
        pb.CompatibilityEntry(
            artifacts=artifacts(version),
            verdict=verdict,
            gates=[pb.GateVerdict(gate="conformance", result="failed", reason="8/10 parsed")]
            if verdict == "failed"
            else [],
            deployment="canary",
            revision="r7",
        )
    )


def cli_lines(output: str) -> list[str]:
    """The CLI's own lines (the in-process server's log lines share stdout here)."""
    return [line for line in output.splitlines() if not line[:4].isdigit()]


def test_compat_list_and_forced_changes(orch: Any, fx: Any, tmp_path: Path) -> None:
    status = fx.cpu_status("laptop", versions=("0.32.0", "0.31.0"))
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=status), timeout=10)
    status.replicas.append(
        nodeagent_pb2.Replica(
            name="replicas/other-0",
            state=nodeagent_pb2.Replica.STATE_READY,
            spec=nodeagent_pb2.ReplicaSpec(
                deployment="other", revision="r1", model_source="/models/kimi-tiny"
            ),
            artifacts=artifacts("0.32.0"),
        )
    )
    list(orch.nodes.StreamHeartbeats(iter([pb.StreamHeartbeatsRequest(status=status)]), timeout=10))
    record(orch, "qualified", "0.32.0")
    record(orch, "failed", "0.31.0")
    runner = CliRunner(env=PLAINTEXT)
    address = ["--address", orch.address]
    kimi, pin = tmp_path / "kimi.yaml", tmp_path / "pin.yaml"
    kimi.write_text(KIMI_YAML)
    pin.write_text(PIN_YAML)

    listed = runner.invoke(app, ["compat", "list", *address])
    assert listed.exit_code == 0, listed.output
    assert "failed" in listed.output and "conformance: 8/10 parsed" in listed.output
    as_json = runner.invoke(
        app,
        ["compat", "list", "--verdict", "failed", "--engine-version", "0.31.0", "--json", *address],
    )
    assert as_json.exit_code == 0, as_json.output
    (entry,) = [json.loads(line) for line in cli_lines(as_json.output) if line.startswith("{")]
    assert (entry["verdict"], entry["artifacts"]["engineVersion"]) == ("failed", "0.31.0")
    none = runner.invoke(app, ["compat", "list", "--deployment", "nope", "--json", *address])
    assert [line for line in cli_lines(none.output) if line.startswith("{")] == []

    created = runner.invoke(app, ["create", "--file", str(kimi), *address])
    assert created.exit_code == 0, created.output  # 0.32.0 is qualified
    refused = runner.invoke(app, ["update", "--file", str(pin), *address])
    assert refused.exit_code == 1
    assert "INVALID_ARGUMENT" in refused.output and "8/10 parsed" in refused.output
    no_reason = runner.invoke(app, ["update", "--file", str(pin), "--force", *address])
    assert no_reason.exit_code == 1 and "force_reason is required" in no_reason.output
    forced = runner.invoke(
        app, ["update", "--file", str(pin), "--force", "--force-reason", "CVE fix", *address]
    )
    assert forced.exit_code == 0, forced.output
    assert "deployments/kimi updated (profile.engine_version)" in forced.output

    changes = runner.invoke(app, ["compat", "forced", "--json", *address])
    assert changes.exit_code == 0, changes.output
    (change,) = [json.loads(line) for line in cli_lines(changes.output) if line.startswith("{")]
    assert (change["deployment"], change["actor"], change["reason"]) == (
        "kimi",
        "anonymous",
        "CVE fix",
    )
    table = runner.invoke(app, ["compat", "forced", "--deployment", "kimi", *address])
    assert table.exit_code == 0 and "CVE fix" in table.output
