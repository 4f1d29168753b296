"""LoRA in both engine command lines (issue 29): a spec with `max_loras` gives the child
engine (`http-completions`, from the node-agent's launch plan) and the in-process engine
(`inproc`, the replica's `engine_argv`, parsed by vLLM's own engine-argument parser) the same
`replica_contract.lora_args`; `grpc` is refused by the plan; a spec without LoRA gets none."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferplane.node_agent.supervisor.process import plan_launch
from inferplane.replica.engines.inproc import engine_args, engine_argv
from inferplane.replica.testing.pipeline import kimi_tiny_spec
from inferplane.replica_contract import lora_args

LORA = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


def lora_spec(transport: str):  # type: ignore[no-untyped-def]
    spec = kimi_tiny_spec()
    spec.transport, spec.max_loras, spec.max_lora_rank, spec.lora_root = transport, 2, 8, "/x"
    return spec


def test_the_child_engine_gets_the_lora_arguments(tmp_path: Path) -> None:
    plan = plan_launch("r", lora_spec("http-completions"), data_dir=tmp_path, cpu=True)
    engine = list(plan.argv[plan.argv.index("--") + 1 :])
    start = engine.index("--enable-lora")
    assert engine[start : start + len(LORA)] == LORA == lora_args(lora_spec("inproc"))
    plain = plan_launch("p", kimi_tiny_spec(), data_dir=tmp_path, cpu=True)
    assert "--enable-lora" not in plain.argv


def test_grpc_cannot_serve_lora(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot serve LoRA adapters"):
        plan_launch("r", lora_spec("grpc"), data_dir=tmp_path, cpu=True)


def test_the_inproc_engine_parses_them_as_vllm_does() -> None:
    pytest.importorskip("vllm")
    argv = engine_argv(lora_spec("inproc"), cpu=True)
    assert all(a in argv for a in LORA) and "--enforce-eager" in argv
    parsed = engine_args(argv)
    assert (parsed.enable_lora, parsed.max_loras, parsed.max_lora_rank) == (True, 2, 8)
    assert parsed.enforce_eager
