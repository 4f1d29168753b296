"""Validation errors name the field and give the numbers."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import wave

import pytest

from inferplane.orchestrator.catalog.model import Accelerator, Deployment, DeploymentProfile
from inferplane.orchestrator.catalog.sizing import GB, SizingPolicy, estimate
from inferplane.orchestrator.catalog.validation import validate_deployment
from inferplane.orchestrator.convert import profile_from_proto, profile_to_proto
from inferplane.orchestrator.fleet.model import Gpu, Node
from inferplane.orchestrator.placement.model import Placement
from inferplane.orchestrator.placement.planner import static_fit_error
from inferplane.orchestrator.release.agents import probe_speech_form
from inferplane.orchestrator.release.spec import build_spec
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import read_form

PROFILE = DeploymentProfile(
    model_source="meta-llama/Llama-3.3-70B-Instruct",
    precision="fp16",
    parameter_count=70_000_000_000,
    num_layers=80,
    num_kv_heads=8,
    head_dim=128,
    max_model_len=8192,
    max_num_seqs=10,
)


def dgx(name: str, memory: int = 180 * GB, gpus: int = 8) -> Node:
    return Node(name=name, gpus=tuple(Gpu(i, memory) for i in range(gpus)))


def invalid(**changes: object) -> InvalidArgumentError:
    profile_changes = {k: v for k, v in changes.items() if hasattr(PROFILE, k)}
    other = {k: v for k, v in changes.items() if not hasattr(PROFILE, k)}
    deployment = Deployment(
        "llama",
        dataclasses.replace(PROFILE, **profile_changes),
        **other,  # type: ignore[arg-type]
    ).normalised()
    with pytest.raises(InvalidArgumentError) as info:
        validate_deployment(deployment)
    return info.value


def test_a_valid_deployment_passes() -> None:
    validate_deployment(Deployment("llama-3.3-70b", PROFILE, aliases=("meta/llama",)).normalised())


@pytest.mark.parametrize("transport", ["inproc", "grpc", "http-completions"])
def test_every_replica_transport_is_accepted(transport: str) -> None:
    """The catalogue accepts each engine transport the replica process has (issue 16:
    `inproc` hosts vLLM's AsyncLLM in the replica process)."""
    profile = dataclasses.replace(PROFILE, transport=transport)
    validate_deployment(Deployment("llama-3.3-70b", profile).normalised())


def test_an_unknown_transport_lists_the_known_ones() -> None:
    err = invalid(transport="carrier-pigeon")
    assert err.param == "deployment.profile.transport"
    assert err.message == (
        "unknown transport 'carrier-pigeon'; known: inproc, grpc, http-completions"
    )


def test_unknown_precision_lists_the_known_ones() -> None:
    err = invalid(precision="fp4")
    assert err.param == "deployment.profile.precision"
    assert err.message == (
        "unknown precision 'fp4'; known: fp32, bf16, fp16, fp8, int8, int4-awq, int4-gptq, nvfp4"
    )


def test_a_profile_names_known_parsers_only() -> None:
    """An unknown parser name is refused at CreateDeployment (issue 19), naming the field and
    every known parser; the two parser fields name one parser or one is empty."""
    err = invalid(tool_parser="hermes")
    assert err.param == "deployment.profile.tool_parser"
    assert err.message == (
        "unknown parser 'hermes'; known: deepseek_v31, glm45, gpt_oss, kimi_k2, qwen3"
    )
    assert invalid(reasoning_parser="deepseek_r1").param == "deployment.profile.reasoning_parser"
    assert invalid(reasoning_parser="qwen3", tool_parser="kimi_k2").param == (
        "deployment.profile.tool_parser"
    )
    for names in (("qwen3", "qwen3"), ("", "glm45"), ("deepseek_v31", ""), ("gpt_oss", "gpt_oss")):
        profile = dataclasses.replace(PROFILE, reasoning_parser=names[0], tool_parser=names[1])
        validate_deployment(Deployment("llama-3.3-70b", profile).normalised())


def test_tensor_parallel_size_must_fit_the_kv_heads() -> None:
    err = invalid(tensor_parallel_size=3)
    assert err.message == "tensor_parallel_size 3 must divide num_kv_heads 8 or be a multiple of it"


def test_numbers_placement_needs_are_required() -> None:
    assert invalid(num_layers=0).param == "deployment.profile.num_layers"
    err = invalid(active_parameter_count=80_000_000_000)
    assert "active_parameter_count (80000000000) cannot exceed parameter_count" in err.message


def test_replica_bounds_give_the_numbers() -> None:
    err = invalid(replicas=5, min_replicas=1, max_replicas=3)
    assert err.message == (
        "replicas must satisfy min_replicas <= replicas <= max_replicas (0 = no bound); "
        "got 1 <= 5 <= 3"
    )


def test_bad_ids_and_aliases() -> None:
    with pytest.raises(InvalidArgumentError, match="deployment_id 'a/b'"):
        validate_deployment(Deployment("a/b", PROFILE).normalised())
    assert "equals the deployment id" in invalid(aliases=("llama",)).message


def test_70b_fp16_on_tp1_does_not_fit_one_180_gb_gpu_and_the_error_says_why() -> None:
    # 12 seqs × 8192 tokens × 327,680 B = 32.2 GB KV; overhead 2 GiB + 5 % = 10.8 GB.
    profile = dataclasses.replace(PROFILE, max_num_seqs=12)
    message = static_fit_error(profile, [dgx("b200-a"), dgx("b200-b")], SizingPolicy())
    assert message == (
        "70B at fp16 needs 140 GB of weights + 32.2 GB KV budget + 10.8 GB overhead = "
        "183 GB per GPU at TP=1; the largest GPU group on one node offers 1440 GB "
        "(8 × 180 GB on b200-a) but TP=1 allows 180 GB; tensor_parallel_size=2 would need "
        "92.6 GB per GPU and fits"
    )
    assert static_fit_error(PROFILE, [dgx("b200-a")], SizingPolicy()) is None  # 177.3 GB fits
    on_h100 = static_fit_error(PROFILE, [dgx("h100-a", 80 * GB)], SizingPolicy())
    assert on_h100 is not None
    assert on_h100.endswith(
        "(8 × 80 GB on h100-a) but TP=1 allows 80 GB; tensor_parallel_size=4 would need "
        "45.9 GB per GPU and fits"
    )


def test_tp_larger_than_any_node() -> None:
    profile = dataclasses.replace(PROFILE, tensor_parallel_size=16)
    message = static_fit_error(profile, [dgx("n1", gpus=8)], SizingPolicy())
    assert message is not None
    assert message.endswith(
        "TP=16 needs 16 GPUs on one node but the largest node offers 8 placeable GPUs (n1)"
    )


def test_no_fleet_yet_is_not_an_error() -> None:
    assert static_fit_error(PROFILE, [], SizingPolicy()) is None


def test_stream_interval_is_bounded_and_carried_to_the_replica_spec() -> None:
    """0..1024 tokens per streamed chunk (the node-agent's per-request bound); the value
    survives the API conversion and reaches every replica's spec (vLLM's --stream-interval)."""
    assert invalid(stream_interval=1025).param == "deployment.profile.stream_interval"
    profile = dataclasses.replace(PROFILE, stream_interval=4)
    validate_deployment(Deployment("llama", profile).normalised())
    assert profile_from_proto(profile_to_proto(profile)) == profile
    spec = build_spec(
        Deployment("llama", profile),
        profile,
        "rev-1",
        Placement(
            replica_id="llama-0",
            deployment_id="llama",
            revision="rev-1",
            node="n1",
            accelerator=Accelerator.GPU,
            gpu_indices=(0,),
            memory_bytes_per_device=80 * GB,
            memory_fraction=0.9,
            kv_cache_bytes=10 * GB,
        ),
        None,
    )
    assert spec.stream_interval == 4


def test_a_field_added_later_changes_no_existing_revision() -> None:
    """Adding `stream_interval`, `constrain_tool_choice_auto`, `task` or `sampling_defaults`
    to the profile must not change the revision of a deployment that does not set it (else an
    upgrade would roll every replica); setting it does."""
    payload = dataclasses.asdict(PROFILE.with_defaults())
    payload["extra_engine_args"] = list(payload["extra_engine_args"])
    del payload["stream_interval"]  # the profile as the first release hashed it
    del payload["constrain_tool_choice_auto"]
    del payload["task"]
    del payload["sampling_defaults"]
    del payload["max_loras"]  # LoRA (issue 29): hashed when set
    del payload["max_lora_rank"]
    del payload["num_speculative_tokens"]  # issue 30: hashed when set
    del payload["speculative_prompt_lookup_max"]
    del payload["speculative_prompt_lookup_min"]
    del payload["ttft_slo_seconds"]  # never hashed: the autoscaler's target (UNHASHED_FIELDS)
    del payload["release_gates"]  # never hashed: what a release must pass (issue 30)
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    assert PROFILE.revision() == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert dataclasses.replace(PROFILE, stream_interval=4).revision() != PROFILE.revision()
    on = dataclasses.replace(PROFILE, constrain_tool_choice_auto=True)
    assert on.revision() != PROFILE.revision()
    slo = dataclasses.replace(PROFILE, ttft_slo_seconds=0.5)
    assert slo.revision() == PROFILE.revision()


def test_sampling_defaults_are_checked_carried_to_the_spec_and_a_new_revision() -> None:
    """A profile's sampling defaults (vLLM's `--override-generation-config`) take a request's
    ranges (INVALID_ARGUMENT names the field), survive the API conversion, reach every
    replica's spec, and changing them is a new revision; none set is the revision without the
    field (no rollout on upgrade) and an unset field in the spec."""
    assert invalid(sampling_defaults={"temperature": 2.5}).param == (
        "deployment.profile.sampling_defaults.temperature"
    )
    assert invalid(sampling_defaults={"top_p": 0.0}).param.endswith(".top_p")
    assert invalid(sampling_defaults={"repetition_penalty": 0.0}).param.endswith(
        ".repetition_penalty"
    )
    assert invalid(sampling_defaults={"presence_penalty": -2.5}).param.endswith(".presence_penalty")
    assert invalid(sampling_defaults={"top_k": -2}).param.endswith(".top_k")
    assert invalid(sampling_defaults={"min_p": float("nan")}).param.endswith(".min_p")
    assert invalid(sampling_defaults={"seed": 1}).param.endswith(".seed")
    values = {"repetition_penalty": 1.3, "top_k": -1, "temperature": 0.0, "min_p": 1.0}
    profile = dataclasses.replace(PROFILE, sampling_defaults=values)  # type: ignore[arg-type]
    assert profile.sampling_defaults == tuple(sorted(values.items()))
    validate_deployment(Deployment("llama", profile).normalised())
    assert profile_from_proto(profile_to_proto(profile)) == profile
    assert not profile_to_proto(PROFILE).HasField("sampling_defaults")
    assert profile.revision() != PROFILE.revision()
    assert dataclasses.replace(profile, sampling_defaults=()).revision() == PROFILE.revision()
    placement = Placement(
        replica_id="llama-0",
        deployment_id="llama",
        revision="rev-1",
        node="n1",
        accelerator=Accelerator.GPU,
        gpu_indices=(0,),
        memory_bytes_per_device=80 * GB,
        memory_fraction=0.9,
        kv_cache_bytes=10 * GB,
    )
    spec = build_spec(Deployment("llama", profile), profile, "rev-1", placement, None)
    assert spec.sampling_defaults.repetition_penalty == 1.3
    assert spec.sampling_defaults.top_k == -1
    assert spec.sampling_defaults.HasField("temperature") and spec.sampling_defaults.min_p == 1
    assert not spec.sampling_defaults.HasField("top_p")
    plain = build_spec(Deployment("llama", PROFILE), PROFILE, "rev-1", placement, None)
    assert not plain.HasField("sampling_defaults")


def test_constrain_tool_choice_auto_is_on_unless_the_api_says_off() -> None:
    """The API's default is on (a profile that leaves the field unset, as older clients do,
    gets the constraint); an explicit false stays off; the value survives the round trip and
    reaches every replica's spec. A profile stored before the field existed reads as off."""
    unset = profile_to_proto(PROFILE)
    unset.ClearField("constrain_tool_choice_auto")
    assert profile_from_proto(unset).constrain_tool_choice_auto is True
    off = profile_to_proto(PROFILE)
    assert off.HasField("constrain_tool_choice_auto") and not off.constrain_tool_choice_auto
    assert profile_from_proto(off) == PROFILE
    on = dataclasses.replace(PROFILE, constrain_tool_choice_auto=True)
    assert profile_from_proto(profile_to_proto(on)) == on
    stored = {
        k: v for k, v in dataclasses.asdict(PROFILE).items() if k != "constrain_tool_choice_auto"
    }
    assert DeploymentProfile(**stored).constrain_tool_choice_auto is False
    placement = Placement(
        replica_id="llama-0",
        deployment_id="llama",
        revision="rev-1",
        node="n1",
        accelerator=Accelerator.GPU,
        gpu_indices=(0,),
        memory_bytes_per_device=80 * GB,
        memory_fraction=0.9,
        kv_cache_bytes=10 * GB,
    )
    for profile in (PROFILE, on):
        spec = build_spec(Deployment("llama", profile), profile, "rev-1", placement, None)
        assert spec.constrain_tool_choice_auto is profile.constrain_tool_choice_auto


def test_an_embedding_deployment_has_no_parsers_and_an_embedding_transport() -> None:
    """Task "embed" (issue 19): vLLM's pooling runner behind `inproc` or `http-completions`;
    parsers are refused (nothing is generated), as is an unknown task. "generate" is stored
    as "" so that profiles from before the field keep their revision."""
    embed = dataclasses.replace(PROFILE, task="embed", transport="inproc")
    validate_deployment(Deployment("bge", embed).normalised())
    # No KV geometry needed: placement sizes the weights (and overheads) alone.
    small = dataclasses.replace(embed, num_layers=0, num_kv_heads=0, head_dim=0)
    validate_deployment(Deployment("bge", small).normalised())
    assert estimate(small).kv_cache_bytes == 0 < estimate(PROFILE).kv_cache_bytes
    assert invalid(num_layers=0).param == "deployment.profile.num_layers"
    assert invalid(task="embed", transport="grpc").param == "deployment.profile.transport"
    err = invalid(task="embed", transport="inproc", tool_parser="qwen3")
    assert err.param == "deployment.profile.tool_parser"
    err = invalid(task="rerank")
    assert (err.param, err.message) == (
        "deployment.profile.task",
        "unknown task 'rerank'; known: generate, embed, transcribe",
    )
    generate = Deployment("llama", dataclasses.replace(PROFILE, task="generate")).normalised()
    assert generate.profile.task == ""
    assert generate.revision == Deployment("llama", PROFILE).normalised().revision
    assert Deployment("bge", embed).normalised().revision != generate.revision


def test_a_speech_deployment_has_no_parsers_and_the_inproc_transport() -> None:
    """Task "transcribe" (issue 19): vLLM's speech serving hosted in the replica process, so
    only `inproc`; parsers are refused (the text is not parsed); its KV geometry is required
    (Whisper's decoder keeps a KV cache)."""
    speech = dataclasses.replace(PROFILE, task="transcribe", transport="inproc")
    validate_deployment(Deployment("whisper", speech).normalised())
    assert Deployment("whisper", speech).normalised().profile.transcribes
    err = invalid(task="transcribe", transport="http-completions")
    assert err.param == "deployment.profile.transport" and "inproc" in err.message
    err = invalid(task="transcribe", transport="inproc", reasoning_parser="qwen3")
    assert err.param == "deployment.profile.reasoning_parser"
    assert invalid(task="transcribe", transport="inproc", num_layers=0).param == (
        "deployment.profile.num_layers"
    )


def test_the_speech_warm_up_is_a_form_the_replica_reads() -> None:
    """The orchestrator's speech warm-up body is a multipart form with the model, the text
    format and half a second of 16 kHz WAV, as the replica's form reader sees it."""
    content_type, body = probe_speech_form("whisper-tiny")
    form = read_form(content_type, body)
    assert form.get("model") == "whisper-tiny" and form.get("response_format") == "verbose_json"
    with wave.open(io.BytesIO(form.files["file"].data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (16000, 1, 8000)


def test_engine_arguments_are_checked_against_the_profiles_engine_version() -> None:
    """Issue 30: the allow-list is the profile's engine version's (`engine_args`): vLLM 0.31
    still has cascade attention, 0.32 (and an empty version, the default) made the flag a
    no-op; a version without a list refuses any argument, naming extra_engine_args."""
    cascade = ("--disable-cascade-attn",)
    validate_deployment(
        Deployment(
            "llama",
            dataclasses.replace(PROFILE, engine_version="0.31.0", extra_engine_args=cascade),
        ).normalised()
    )
    for version in ("0.32.0", ""):
        error = invalid(engine_version=version, extra_engine_args=cascade)
        assert error.param == "deployment.profile.extra_engine_args"
    error = invalid(engine_version="0.9.0", extra_engine_args=("--seed", "1"))
    assert "engine_version '0.9.0' has no engine-argument allow-list" in str(error.message)


def test_the_performance_gates_rounds_are_0_to_9_and_no_new_revision() -> None:
    """`release_gates.benchmark_rounds` (issue 30): 0 (the default, 3) to 9, else
    INVALID_ARGUMENT naming the field; it survives the API conversion and, like every release
    gate, changing it is no new revision (no rollout)."""
    for rounds in (0, 1, 9):
        gates = (("benchmark_rounds", rounds), ("performance", True))
        profile = dataclasses.replace(PROFILE, release_gates=gates)
        validate_deployment(Deployment("llama", profile).normalised())
        assert profile.revision() == PROFILE.revision()
        assert profile_to_proto(profile).release_gates.benchmark_rounds == rounds
    error = invalid(release_gates=(("benchmark_rounds", 10),))
    assert error.param == "deployment.profile.release_gates.benchmark_rounds"
    assert error.message == (
        "profile.release_gates.benchmark_rounds is 0 (the default, 3) to 9; got 10"
    )
