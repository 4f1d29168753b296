"""The placement's KV budget reaches vLLM in bytes (`--kv-cache-memory-bytes`), on every
transport, and vLLM's GiB variable never overrides it (issue 29, item 5).

vLLM 0.32's CPU platform replaces `kv_cache_memory_bytes` with `VLLM_CPU_KVCACHE_SPACE` GiB
whenever that variable is set, so the variable is removed wherever the engine environment is
made. The real engine's block count for a byte budget is checked by tests/e2e/test_kv_fit.py.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica.engines import launcher
from inferplane.replica.engines.environment import (
    CPU_KVCACHE_SPACE,
    DEFAULT_CPU_KV_CACHE_BYTES,
    apply_engine_environment,
    engine_environment,
    kv_cache_args,
)
from inferplane.replica.engines.inproc import engine_argv

MIB = 1 << 20


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_kv_cache_args_give_the_bytes_exactly_on_cpu_and_nothing_on_gpu() -> None:
    assert kv_cache_args(8 * MIB + 1, cpu=True) == ["--kv-cache-memory-bytes", str(8 * MIB + 1)]
    assert kv_cache_args(0, cpu=True) == [
        "--kv-cache-memory-bytes",
        str(DEFAULT_CPU_KV_CACHE_BYTES),
    ]
    assert kv_cache_args(8 * MIB, cpu=False) == []


def test_the_environment_never_carries_the_gib_variable() -> None:
    base = {CPU_KVCACHE_SPACE: "4", "PATH": "/bin"}
    env = engine_environment(base, cpu=True, cache_root=None)
    assert CPU_KVCACHE_SPACE not in env
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    environ = dict(base)
    apply_engine_environment(environ, cpu=True, cache_root=Path("/tmp/x"))
    assert CPU_KVCACHE_SPACE not in environ  # removed, not just left out of the update
    assert environ["VLLM_CACHE_ROOT"] == "/tmp/x"


def test_inproc_engine_argv_carries_the_spec_budget_or_the_override() -> None:
    spec = nodeagent_pb2.ReplicaSpec(model_source="/m", kv_cache_bytes=3 * MIB + 7)
    assert _value(engine_argv(spec, cpu=True), "--kv-cache-memory-bytes") == str(3 * MIB + 7)
    override = engine_argv(spec, cpu=True, kv_cache_bytes=5 * MIB)
    assert _value(override, "--kv-cache-memory-bytes") == str(5 * MIB)
    assert "--kv-cache-memory-bytes" not in engine_argv(spec, cpu=False)


def test_inproc_engine_args_parse_the_bytes_into_vllms_engine_args() -> None:
    pytest.importorskip("vllm")
    from inferplane.fixtures import kimi_tiny
    from inferplane.replica.engines.inproc import engine_args

    model = str(kimi_tiny.model_path())  # a real folder: vLLM reads it
    spec = nodeagent_pb2.ReplicaSpec(model_source=model, kv_cache_bytes=8 * MIB)
    assert engine_args(engine_argv(spec, cpu=True)).kv_cache_memory_bytes == 8 * MIB


def test_the_launcher_appends_the_bytes_to_vllms_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("vllm.entrypoints.cli.main")
    fake.main = lambda: seen.append(list(sys.argv))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", fake)
    monkeypatch.setattr(launcher, "patch_vllm_version", lambda cpu: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    environ = {CPU_KVCACHE_SPACE: "1"}
    argv = ["--no-parent-guard", "--device", "cpu", "--kv-cache-bytes", str(12 * MIB), "--"]
    assert launcher.main([*argv, "serve", "/m", "--grpc"], environ) == 0
    (vllm_argv,) = seen
    assert vllm_argv[:4] == ["vllm", "serve", "/m", "--grpc"]
    assert _value(vllm_argv, "--kv-cache-memory-bytes") == str(12 * MIB)
    assert CPU_KVCACHE_SPACE not in environ
    # A manual run that sizes the cache itself keeps its own value, once.
    seen.clear()
    own = [*argv, "serve", "/m", "--kv-cache-memory-bytes", "999"]
    assert launcher.main(own, {}) == 0
    assert seen[0].count("--kv-cache-memory-bytes") == 1
    assert _value(seen[0], "--kv-cache-memory-bytes") == "999"
