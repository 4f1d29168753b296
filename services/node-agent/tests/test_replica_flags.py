"""The node-agent's settings → the flags every replica process gets (`ReplicaFlags`, the
supervisor ⇄ replica contract): the settings that name a replica flag default to the
contract's default, and reach the command line `plan_launch` writes."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.settings import NodeAgentSettings
from inferplane.node_agent.supervisor.process import REPLICA_COMMAND, plan_launch
from inferplane.replica_contract import DEFAULT_FLAGS, ReplicaFlags

NODE_WIDE = (
    "telemetry_address",
    "strict_tool_calls",
    "owned_by",
    "gc_freeze",
    "startup_timeout_seconds",
    "drain_grace_seconds",
    "identity",
    "tls_dir",
)


def test_default_settings_pass_the_contracts_defaults() -> None:
    flags = NodeAgentSettings(node_name="n1").replica_flags()
    for name in NODE_WIDE:
        assert getattr(flags, name) == getattr(DEFAULT_FLAGS, name), name
    assert flags.node_name == "n1"


def test_settings_reach_the_replica_command_line(tmp_path: Path) -> None:
    settings = NodeAgentSettings(
        node_name="n1",
        telemetry_address="127.0.0.1:7000",
        strict_tool_calls=True,
        owned_by="acme",
        gc_freeze=False,
        engine_startup_timeout_seconds=42.5,
        replica_drain_grace_seconds=2,
    )
    spec = nodeagent_pb2.ReplicaSpec(model_source="/m", transport="inproc")
    plan = plan_launch("r1", spec, data_dir=tmp_path, cpu=True, options=settings.replica_flags())
    parser = argparse.ArgumentParser()
    ReplicaFlags.add_to(parser)
    flags = ReplicaFlags.from_args(parser.parse_args(list(plan.argv[len(REPLICA_COMMAND) :])))
    assert flags == dataclasses.replace(
        settings.replica_flags(),
        replica_id="r1",
        spec_file=plan.spec_path,
        port=flags.port,
        metrics_port=flags.metrics_port,
        cache_root=tmp_path / "replicas" / "r1" / "cache",
        device="cpu",
    )
    assert (flags.owned_by, flags.gc_freeze, flags.startup_timeout_seconds) == ("acme", False, 42.5)
