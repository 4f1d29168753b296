"""Validation of a deployment on its own (no fleet): names, profile numbers, bounds, engine
arguments from the allow-list (`inferplane.engine_args`).

Every error is an `InvalidArgumentError` whose `param` is the request field at fault
(`deployment.profile.precision`...) and whose message says what is allowed.
Fleet-dependent checks (does one replica fit any node?) live in `placement.planner`.
"""

from __future__ import annotations

import math
import re

from inferplane import engine_features
from inferplane import replica_contract as contract
from inferplane.benchmark import DEFAULT_BENCHMARK_ROUNDS, MAX_BENCHMARK_ROUNDS
from inferplane.engine_args import KV_CACHE_DTYPES, EngineArgError, check_engine_args
from inferplane.engine_features import FeatureError
from inferplane.orchestrator.catalog.model import (
    CPU_ENGINE,
    DEFAULT_ENGINE,
    DEFAULT_TRANSPORT,
    LORA_RANKS,
    MAX_CANARY_PERCENT,
    MAX_LORAS,
    MAX_OWNED_BY,
    ROUTING_POLICIES,
    SAMPLING_FIELDS,
    SPECULATIVE_METHODS,
    TASKS,
    TRANSPORTS,
    Accelerator,
    Deployment,
    DeploymentProfile,
)
from inferplane.orchestrator.catalog.sizing import KV_CACHE_DTYPE_BYTES, PRECISIONS
from inferplane.parsers import default_registry
from inferplane.runtime import InvalidArgumentError

# The deployment id is both a resource-name segment and the `model` clients send, so no "/".
DEPLOYMENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Aliases are only ever `model` strings: hub-style ids ("moonshotai/Kimi-K2.5") are fine.
ALIAS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}")
ENGINES = (DEFAULT_ENGINE, CPU_ENGINE)
PARSERS = default_registry()
#: The transports that serve embeddings, and speech-to-text (vLLM's speech serving hosted in the
#: replica process): `inferplane.replica_contract`, which the node-agent and replica check too.
EMBED_TRANSPORTS: tuple[str, ...] = tuple(t.value for t in contract.EMBED_TRANSPORTS)
SPEECH_TRANSPORTS: tuple[str, ...] = tuple(t.value for t in contract.SPEECH_TRANSPORTS)
LORA_TRANSPORTS: tuple[str, ...] = tuple(t.value for t in contract.LORA_TRANSPORTS)
MAX_STREAM_INTERVAL = 1024  # tokens per streamed chunk (the node-agent's request limit too)


#: A sampling default's range: a request's own (the replica's `requests._sampling`); `top_p`
#: and `repetition_penalty` exclude their lower bound. `top_k` is checked apart (an integer, -1
#: or more).
SAMPLING_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
_LOWER_OPEN = ("top_p", "repetition_penalty")


def _validate_sampling(p: DeploymentProfile) -> None:
    for name, value in p.sampling_defaults:
        field = f"profile.sampling_defaults.{name}"
        if name == "top_k":
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise _fail(f"{field} must be -1 or 0 (disabled) or a positive integer", field)
            continue
        if name not in SAMPLING_RANGES:
            raise _fail(
                f"{field} is not a sampling parameter; known: {', '.join(SAMPLING_FIELDS)}", field
            )
        lo, hi = SAMPLING_RANGES[name]
        ok = (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and lo <= value <= hi
            and not (value == lo and name in _LOWER_OPEN)
        )
        if not ok:
            low = f"above {lo:g}" if name in _LOWER_OPEN else f"{lo:g}"
            raise _fail(f"{field} must be {low} to {hi:g}, got {value!r}", field)


def _listed(transports: tuple[str, ...]) -> list[str]:
    """Transports as messages list them: the default first, then the contract's order."""
    return sorted(transports, key=lambda t: t != DEFAULT_TRANSPORT)


def _fail(message: str, field: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, param=f"deployment.{field}")


def validate_deployment_id(deployment_id: str) -> None:
    """Raises InvalidArgumentError unless the id is 1–128 of [A-Za-z0-9._-], starting with an
    alphanumeric."""
    if not DEPLOYMENT_ID_RE.fullmatch(deployment_id or ""):
        raise InvalidArgumentError(
            f"deployment_id {deployment_id!r} must be 1-128 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit",
            param="deployment_id",
        )


def validate_deployment(deployment: Deployment) -> None:
    """Checks a normalised deployment (`Deployment.normalised()`).

    Raises:
        InvalidArgumentError: the first problem found, naming the field.
    """
    validate_deployment_id(deployment.deployment_id)
    seen: set[str] = set()
    for alias in deployment.aliases:
        if not ALIAS_RE.fullmatch(alias):
            raise _fail(
                f"alias {alias!r} must be 1-256 characters of letters, digits or ._:/@+-",
                "aliases",
            )
        if alias == deployment.deployment_id or alias in seen:
            raise _fail(f"alias {alias!r} is repeated or equals the deployment id", "aliases")
        seen.add(alias)
    _validate_profile(deployment)
    _validate_autoscaling(deployment)
    upper = deployment.max_replicas or deployment.replicas
    # Scale to zero is the only way below min_replicas (the autoscaler's write after idle).
    lower = 0 if deployment.autoscaling.scale_to_zero else deployment.min_replicas
    if deployment.autoscaled and not lower <= deployment.replicas <= upper:
        raise _fail(
            "replicas must satisfy min_replicas <= replicas <= max_replicas (0 only with "
            f"autoscaling.scale_to_zero); got {deployment.min_replicas} <= "
            f"{deployment.replicas} <= {deployment.max_replicas}",
            "replicas",
        )
    if not deployment.autoscaled and not deployment.min_replicas <= deployment.replicas <= upper:
        raise _fail(
            "replicas must satisfy min_replicas <= replicas <= max_replicas (0 = no bound); got "
            f"{deployment.min_replicas} <= {deployment.replicas} <= {deployment.max_replicas}",
            "replicas",
        )
    if len(deployment.owned_by) > MAX_OWNED_BY:
        raise _fail(
            f"owned_by must be at most {MAX_OWNED_BY} characters; got {len(deployment.owned_by)}",
            "owned_by",
        )
    if "\x00" in deployment.owned_by:  # PostgreSQL text cannot hold it
        raise _fail("owned_by must not contain NUL characters", "owned_by")
    if deployment.routing_policy not in ROUTING_POLICIES:
        raise _fail(
            f"unknown routing_policy {deployment.routing_policy!r}; known: "
            + ", ".join(ROUTING_POLICIES),
            "routing_policy",
        )
    rollout = deployment.rollout
    if rollout.max_surge == 0 and rollout.max_unavailable == 0:
        raise _fail("rollout.max_surge and rollout.max_unavailable cannot both be 0", "rollout")
    if not 0.0 <= rollout.max_error_rate <= 1.0:
        raise _fail(
            f"rollout.max_error_rate is a share between 0 and 1; got {rollout.max_error_rate}",
            "rollout.max_error_rate",
        )
    if rollout.max_ttft_p99_seconds < 0:
        raise _fail("rollout.max_ttft_p99_seconds cannot be negative", "rollout")
    if not 0 <= rollout.canary_percent <= MAX_CANARY_PERCENT:
        raise _fail(
            f"rollout.canary_percent must be 0 (no canary) to {MAX_CANARY_PERCENT}; got "
            f"{rollout.canary_percent}",
            "rollout.canary_percent",
        )
    for name in ("max_canary_error_rate_increase", "max_canary_tool_call_validity_drop"):
        if not 0.0 <= getattr(rollout, name) <= 1.0:
            raise _fail(
                f"rollout.{name} is an absolute share between 0 and 1 (0: the default); got "
                f"{getattr(rollout, name)}",
                f"rollout.{name}",
            )
    if rollout.max_canary_ttft_p99_ratio and rollout.max_canary_ttft_p99_ratio < 1.0:
        raise _fail(
            "rollout.max_canary_ttft_p99_ratio is a factor of at least 1 (0: the default); got "
            f"{rollout.max_canary_ttft_p99_ratio}",
            "rollout.max_canary_ttft_p99_ratio",
        )
    _validate_release_gates(dict(deployment.profile.release_gates))


#: `ReleaseGates` fields that are shares between 0 and 1 (0: the default).
_GATE_SHARES = (
    "min_tool_call_rate",
    "min_schema_valid_rate",
    "min_replay_pass_rate",
    "max_ttft_p99_regression",
    "max_itl_p99_regression",
    "max_throughput_regression",
)


def _validate_release_gates(gates: dict[str, object]) -> None:
    """The profile's release gates (issue 30): rates and regressions are shares in [0, 1];
    the performance gate's rounds 0 (the default) to `MAX_BENCHMARK_ROUNDS`."""
    for name in _GATE_SHARES:
        value = gates.get(name, 0.0)
        if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise _fail(
                f"profile.release_gates.{name} is a share between 0 and 1 (0: the default); "
                f"got {value}",
                f"profile.release_gates.{name}",
            )
    rounds = gates.get("benchmark_rounds", 0)
    if not isinstance(rounds, int) or not 0 <= rounds <= MAX_BENCHMARK_ROUNDS:
        raise _fail(
            f"profile.release_gates.benchmark_rounds is 0 (the default, "
            f"{DEFAULT_BENCHMARK_ROUNDS}) to {MAX_BENCHMARK_ROUNDS}; got {rounds}",
            "profile.release_gates.benchmark_rounds",
        )


def _validate_parsers(reasoning_parser: str, tool_parser: str) -> None:
    """Each named parser is one of `inferplane.parsers`' (they parse reasoning and tool calls
    together, so two names must be the same one: the replica process refuses two)."""
    known = PARSERS.names
    for field, name in (("reasoning_parser", reasoning_parser), ("tool_parser", tool_parser)):
        if name and name not in known:
            raise _fail(f"unknown parser {name!r}; known: {', '.join(known)}", f"profile.{field}")
    if reasoning_parser and tool_parser and reasoning_parser != tool_parser:
        raise _fail(
            f"profile.reasoning_parser {reasoning_parser!r} and profile.tool_parser "
            f"{tool_parser!r} differ; inferplane's parsers handle both: name one",
            "profile.tool_parser",
        )


def _validate_task(deployment: Deployment) -> None:
    """Embedding deployments run vLLM's pooling runner: no parsers (nothing is generated),
    and a transport that can carry embeddings (`inproc` or `http-completions`)."""
    p = deployment.profile
    if p.task and p.task not in TASKS:
        raise _fail(f"unknown task {p.task!r}; known: {', '.join(TASKS)}", "profile.task")
    if p.transcribes:
        _validate_speech(p)
        return
    if not p.embeds:
        return
    for field in ("reasoning_parser", "tool_parser"):
        if getattr(p, field):
            raise _fail(
                f"an embedding deployment generates nothing to parse: leave {field} empty",
                f"profile.{field}",
            )
    if p.transport not in EMBED_TRANSPORTS:
        raise _fail(
            f"transport {p.transport!r} cannot serve embeddings; use one of "
            f"{', '.join(_listed(EMBED_TRANSPORTS))}",
            "profile.transport",
        )


def _validate_speech(p: DeploymentProfile) -> None:
    """Speech-to-text deployments: no parsers (vLLM's speech serving writes the text) and the
    transport that hosts vLLM's speech serving (`inproc`)."""
    for field in ("reasoning_parser", "tool_parser"):
        if getattr(p, field):
            raise _fail(
                f"a speech-to-text deployment writes plain text: leave {field} empty",
                f"profile.{field}",
            )
    if p.transport not in SPEECH_TRANSPORTS:
        raise _fail(
            f"transport {p.transport!r} cannot serve speech-to-text; use "
            f"{' or '.join(SPEECH_TRANSPORTS)}",
            "profile.transport",
        )


#: Upper bounds of the autoscaling windows, seconds (a day: longer is a typo, not a policy).
MAX_AUTOSCALING_SECONDS = 86_400


def _validate_autoscaling(deployment: Deployment) -> None:
    """Bounds and windows of `deployment.autoscaling` (only when enabled, except that its
    numbers must be sane whenever they are set) and the profile's `ttft_slo_seconds`."""
    a = deployment.autoscaling
    slo = deployment.profile.ttft_slo_seconds
    if not (math.isfinite(slo) and 0.0 <= slo <= 3600.0):
        raise _fail(
            f"profile.ttft_slo_seconds must be 0 (no TTFT signal) to 3600 seconds; got {slo}",
            "profile.ttft_slo_seconds",
        )
    for field in ("scale_down_window_seconds", "idle_seconds_before_zero"):
        value = getattr(a, field)
        if not 0 <= value <= MAX_AUTOSCALING_SECONDS:
            raise _fail(
                f"autoscaling.{field} must be 0 (the default) to {MAX_AUTOSCALING_SECONDS} "
                f"seconds; got {value}",
                f"autoscaling.{field}",
            )
    if not 0 <= a.cold_start_budget_seconds <= 3600:
        raise _fail(
            "autoscaling.cold_start_budget_seconds must be 0 (the default, 120) to 3600 "
            f"seconds; got {a.cold_start_budget_seconds}",
            "autoscaling.cold_start_budget_seconds",
        )
    target = a.target_in_flight_per_replica
    if not (math.isfinite(target) and 0.0 <= target <= 1_000_000):
        raise _fail(
            "autoscaling.target_in_flight_per_replica must be 0 (0.8 x max_num_seqs) or a "
            f"positive number of requests; got {target}",
            "autoscaling.target_in_flight_per_replica",
        )
    if not (math.isfinite(a.max_kv_usage) and 0.0 <= a.max_kv_usage <= 1.0):
        raise _fail(
            f"autoscaling.max_kv_usage is a share between 0 and 1 (0: 0.9); got {a.max_kv_usage}",
            "autoscaling.max_kv_usage",
        )
    if not a.enabled:
        if a.scale_to_zero:
            raise _fail(
                "autoscaling.scale_to_zero needs autoscaling.enabled", "autoscaling.scale_to_zero"
            )
        return
    if deployment.max_replicas < 1:
        raise _fail(
            "max_replicas must be at least 1 when autoscaling is enabled (the autoscaler's "
            f"upper bound); got {deployment.max_replicas}",
            "max_replicas",
        )
    if deployment.min_replicas > deployment.max_replicas:
        raise _fail(
            f"min_replicas ({deployment.min_replicas}) must not exceed max_replicas "
            f"({deployment.max_replicas})",
            "min_replicas",
        )


def _validate_profile(deployment: Deployment) -> None:
    p = deployment.profile
    if not p.model_source:
        raise _fail("profile.model_source is required (a local folder or a hub id)", "profile")
    if p.engine not in ENGINES:
        raise _fail(f"unknown engine {p.engine!r}; known: {', '.join(ENGINES)}", "profile.engine")
    if p.precision not in PRECISIONS:
        raise _fail(
            f"unknown precision {p.precision!r}; known: {', '.join(PRECISIONS)}",
            "profile.precision",
        )
    _validate_parsers(p.reasoning_parser, p.tool_parser)
    _validate_task(deployment)
    if p.kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise _fail(
            f"unknown kv_cache_dtype {p.kv_cache_dtype!r}; known: "
            + ", ".join(KV_CACHE_DTYPE_BYTES),
            "profile.kv_cache_dtype",
        )
    # An embedding model keeps no KV cache between steps: its geometry may be left out (then
    # placement sizes its weights and overheads alone, the small footprint).
    geometry = () if p.embeds else ("num_layers", "num_kv_heads", "head_dim")
    for field in ("parameter_count", *geometry):
        if getattr(p, field) <= 0:
            raise _fail(
                f"profile.{field} must be positive: placement sizes memory from it",
                f"profile.{field}",
            )
    if p.active_parameter_count > p.parameter_count:
        raise _fail(
            f"profile.active_parameter_count ({p.active_parameter_count}) cannot exceed "
            f"parameter_count ({p.parameter_count})",
            "profile.active_parameter_count",
        )
    if p.max_model_len <= 0 or p.max_num_seqs <= 0:
        raise _fail(
            "profile.max_model_len and profile.max_num_seqs must be positive: they size the "
            "KV cache budget",
            "profile.max_model_len",
        )
    if not 0 <= p.stream_interval <= MAX_STREAM_INTERVAL:
        raise _fail(
            f"profile.stream_interval must be 0 (every token) to {MAX_STREAM_INTERVAL}",
            "profile.stream_interval",
        )
    _validate_sampling(p)
    _validate_lora(p)
    if p.expected_context_tokens > p.max_model_len:
        raise _fail(
            f"profile.expected_context_tokens ({p.expected_context_tokens}) cannot exceed "
            f"max_model_len ({p.max_model_len})",
            "profile.expected_context_tokens",
        )
    tp, heads = p.tensor_parallel_size, p.num_kv_heads
    if p.accelerator is Accelerator.CPU and tp != 1:
        raise _fail(
            f"engine {CPU_ENGINE} runs on one host: tensor_parallel_size must be 1, got {tp}",
            "profile.tensor_parallel_size",
        )
    # vLLM's QKVParallelLinear splits KV heads over ranks (heads % TP == 0) or replicates them
    # (TP % heads == 0); anything else fails at engine start-up.
    if heads % tp != 0 and tp % heads != 0:
        raise _fail(
            f"tensor_parallel_size {tp} must divide num_kv_heads {heads} or be a multiple of it",
            "profile.tensor_parallel_size",
        )
    if p.transport not in TRANSPORTS:
        raise _fail(
            f"unknown transport {p.transport!r}; known: {', '.join(_listed(TRANSPORTS))}",
            "profile.transport",
        )
    _validate_speculation(p)
    _validate_engine_args(p)


def _validate_speculation(p: DeploymentProfile) -> None:
    """Speculative decoding (issue 30: it reaches the engine as `--speculative-config`), by
    `inferplane.engine_features.Speculation.check`'s rules, naming the profile's field."""
    if p.speculative_method not in SPECULATIVE_METHODS:
        raise _fail(
            f"unknown speculative_method {p.speculative_method!r}; known: "
            + ", ".join(m or '"" (off)' for m in SPECULATIVE_METHODS),
            "profile.speculative_method",
        )
    try:
        p.speculation.check()
    except FeatureError as exc:
        field = engine_features.PROFILE_FIELDS[exc.field]
        raise _fail(f"profile.{field}: {exc}", f"profile.{field}") from None
    if p.speculative_method and (p.embeds or p.transcribes):
        raise _fail(
            "speculative decoding serves chat and text generation (vLLM's decoder-only "
            f"runner); task {p.task!r} takes none: leave profile.speculative_method empty",
            "profile.speculative_method",
        )


def _validate_lora(p: DeploymentProfile) -> None:
    """LoRA (issue 29): `max_loras` 0 (off) or 1..`MAX_LORAS`; `max_lora_rank` one of vLLM's
    allowed ranks (`LORA_RANKS`), set only with `max_loras`; a generating deployment (vLLM
    serves adapters on the generate runner)."""
    if not 0 <= p.max_loras <= MAX_LORAS:
        raise _fail(
            f"profile.max_loras must be 0 (LoRA off) to {MAX_LORAS}, got {p.max_loras}",
            "profile.max_loras",
        )
    if not p.max_loras:
        if p.max_lora_rank:
            raise _fail(
                "profile.max_lora_rank is set but profile.max_loras is 0 (LoRA off): set "
                "max_loras too, or leave the rank unset",
                "profile.max_lora_rank",
            )
        return
    if p.max_lora_rank not in LORA_RANKS:
        raise _fail(
            f"profile.max_lora_rank must be one of vLLM's ranks "
            f"{', '.join(map(str, LORA_RANKS))}; got {p.max_lora_rank}",
            "profile.max_lora_rank",
        )
    if p.task:
        raise _fail(
            f"LoRA adapters need a generating deployment; task {p.task!r} takes none: leave "
            "profile.max_loras 0",
            "profile.max_loras",
        )
    if p.transport not in LORA_TRANSPORTS:
        raise _fail(
            f"transport {p.transport!r} cannot serve LoRA adapters; use one of "
            f"{', '.join(_listed(LORA_TRANSPORTS))}, or leave profile.max_loras 0",
            "profile.transport",
        )


def _validate_engine_args(p: DeploymentProfile) -> None:
    """`extra_engine_args` from the allow-list (`inferplane.engine_args`, issue 18), and a
    `--kv-cache-dtype` that is the type placement sized the KV cache for."""
    try:
        args = check_engine_args(p.extra_engine_args, p.engine_version)
    except EngineArgError as exc:
        if exc.flag == "--speculative-config":  # typed fields since issue 30
            raise _fail(
                "engine argument --speculative-config is set by the profile's typed fields: "
                + ", ".join(
                    f"profile.{engine_features.PROFILE_FIELDS[name]}"
                    for name in ("method", "model", "num_speculative_tokens")
                )
                + ", and for ngram profile.speculative_prompt_lookup_max/min",
                "profile.extra_engine_args",
            ) from None
        raise _fail(str(exc), "profile.extra_engine_args") from None
    for arg in args:
        if arg.name == "--kv-cache-dtype" and arg.value != KV_CACHE_DTYPES[p.kv_cache_dtype]:
            profile_name = {v: k for k, v in KV_CACHE_DTYPES.items()}[str(arg.value)]
            raise _fail(
                f"engine argument --kv-cache-dtype {arg.value} disagrees with "
                f"profile.kv_cache_dtype {p.kv_cache_dtype!r}, which sizes the KV cache; set "
                f"profile.kv_cache_dtype to {profile_name!r} too",
                "profile.extra_engine_args",
            )
