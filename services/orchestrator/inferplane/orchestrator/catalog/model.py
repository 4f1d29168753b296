"""Deployments and deployment profiles as frozen values, with defaults and the profile revision.

A deployment is the desired state of a model behind a name (`deployments/{deployment_id}`);
its profile is everything placement and the engine need. The revision is a content hash of the
normalised profile: two profiles that run the same engine the same way share a revision, and any
change to one of them (engine version, parser, precision...) gives a new one, which is what a
rolling release compares.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from inferplane import engine_features, lora
from inferplane import replica_contract as contract
from inferplane.routing_client import DEFAULT_COLD_START_BUDGET_SECONDS

DEFAULT_ENGINE = "vllm"
CPU_ENGINE = "vllm-cpu"
# The replica process's engine transports, defined once in `inferplane.replica_contract`:
# vLLM's AsyncLLM in the replica process (the default, the fastest measured), vLLM's HTTP
# server or its `--grpc` server as the replica's child. Plain strings here: profiles store and
# hash the strings.
DEFAULT_TRANSPORT: str = contract.DEFAULT_TRANSPORT.value
DEFAULT_KV_CACHE_DTYPE = engine_features.DEFAULT_KV_CACHE_DTYPE
TRANSPORTS: tuple[str, ...] = tuple(t.value for t in contract.TRANSPORTS)
#: "" (off) and the methods of `inferplane.engine_features` (issue 30: they reach the engine).
SPECULATIVE_METHODS: tuple[str, ...] = ("", *engine_features.SPECULATIVE_METHODS)
ROUTING_POLICIES = (
    "least_load",
    "power_of_two",
    "precise_prefix",
    "prefix_affinity",
    "round_robin",
    "session_affinity",
)
DEFAULT_ROUTING_POLICY = "least_load"
MAX_OWNED_BY = 200  # characters; the store's column is this wide


class Accelerator(enum.Enum):
    """What a replica runs on: GPUs of one node, or a CPU node's host memory."""

    GPU = "gpu"
    CPU = "cpu"


#: Profile fields that do not change how a replica runs: never hashed into `revision()`
#: (changing them rolls nothing). `ttft_slo_seconds` is the autoscaler's target (issue 29);
#: `release_gates` what a new revision must pass (issue 30).
UNHASHED_FIELDS = ("ttft_slo_seconds", "release_gates")
#: Profile fields added after the first release, hashed into `revision()` only when set.
ADDED_FIELDS = (
    "stream_interval",
    "constrain_tool_choice_auto",
    "task",
    "sampling_defaults",
    "max_loras",
    "max_lora_rank",
    "num_speculative_tokens",
    "speculative_prompt_lookup_max",
    "speculative_prompt_lookup_min",
)
#: LoRA (issue 29), defined once in `inferplane.lora`: the most adapters a profile lets one
#: replica hold at once (`max_loras`), vLLM's allowed `--max-lora-rank` values (an adapter's
#: catalogue rank is one of them too), and the rank a LoRA profile gets when it sets none.
MAX_LORAS = lora.MAX_LORAS
LORA_RANKS = lora.ALLOWED_RANKS
DEFAULT_MAX_LORA_RANK = lora.DEFAULT_MAX_LORA_RANK
#: The sampling parameters a profile may default (`DeploymentProfile.sampling_defaults`, vLLM's
#: `--override-generation-config`), as `inferplane.nodeagent.v1.SamplingDefaults` names them;
#: `top_k` is an integer, the others numbers.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
#: What a deployment serves: chat and text completions (the default, stored as ""),
#: embeddings (vLLM's pooling runner), or speech-to-text (`/v1/audio/transcriptions` and
#: `/translations` with an encoder-decoder speech model such as Whisper).
TASK_GENERATE: str = contract.Task.GENERATE.value
TASK_EMBED: str = contract.Task.EMBED.value
TASK_TRANSCRIBE: str = contract.Task.TRANSCRIBE.value
TASKS: tuple[str, ...] = tuple(t.value for t in contract.TASKS)
#: `constrain_tool_choice_auto` when a deployment created or replaced through the API leaves it
#: unset (bench/README.md, tool_call_validity: on costs little and makes every call the model
#: finishes schema-valid).
DEFAULT_CONSTRAIN_TOOL_CHOICE_AUTO = True


@dataclasses.dataclass(frozen=True, slots=True)
class DeploymentProfile:
    """How to run a model (mirrors `inferplane.orchestrator.v1.DeploymentProfile`).

    Counts are plain numbers (parameters, layers, tokens, sequences); `precision` and
    `kv_cache_dtype` are names from `inferplane.orchestrator.catalog.sizing`. Unset values
    (empty strings, zeros) are filled by `with_defaults`.

    `constrain_tool_choice_auto` is False here, which is what a profile stored before the
    option existed reads as (its revision and replicas stay as they were); the API's default
    for an unset value is `DEFAULT_CONSTRAIN_TOOL_CHOICE_AUTO` (convert.py).

    `sampling_defaults` holds the (parameter, value) pairs the operator set (names from
    `SAMPLING_FIELDS`), sorted by name; a mapping or a list of pairs (a stored profile's JSON)
    is normalised to that. Empty: none (the model's generation_config and the engine decide).

    `release_gates` holds the `inferplane.orchestrator.v1.ReleaseGates` fields the operator set
    (name, value) in the same shape (the release pipeline reads them: release/gates.py); not
    hashed into the revision (tightening a gate rolls nothing).
    """

    model_source: str = ""
    engine: str = DEFAULT_ENGINE
    engine_version: str = ""
    precision: str = "bf16"
    parameter_count: int = 0
    active_parameter_count: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE
    tensor_parallel_size: int = 1
    max_model_len: int = 0
    max_num_seqs: int = 0
    expected_context_tokens: int = 0
    reasoning_parser: str = ""
    tool_parser: str = ""
    speculative_method: str = ""
    speculative_model: str = ""
    num_speculative_tokens: int = 0
    speculative_prompt_lookup_max: int = 0
    speculative_prompt_lookup_min: int = 0
    transport: str = DEFAULT_TRANSPORT
    stream_interval: int = 0
    constrain_tool_choice_auto: bool = False
    extra_engine_args: tuple[str, ...] = ()
    task: str = ""
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    max_loras: int = 0
    max_lora_rank: int = 0
    ttft_slo_seconds: float = 0.0
    release_gates: tuple[tuple[str, float | int | bool], ...] = ()

    def __post_init__(self) -> None:
        for name in ("sampling_defaults", "release_gates"):
            value: Any = getattr(self, name)  # a mapping or pairs from a stored profile's JSON
            items = value.items() if isinstance(value, Mapping) else value
            pairs = tuple(sorted((str(k), v) for k, v in items))
            if pairs != value:
                object.__setattr__(self, name, pairs)

    @property
    def embeds(self) -> bool:
        """Whether the deployment serves embeddings (task "embed")."""
        return self.task == TASK_EMBED

    @property
    def transcribes(self) -> bool:
        """Whether the deployment serves speech-to-text (task "transcribe")."""
        return self.task == TASK_TRANSCRIBE

    def with_defaults(self) -> DeploymentProfile:
        """The profile with unset fields filled: engine "vllm", transport "inproc", KV cache
        dtype "auto", tensor parallel size 1, expected context = max_model_len, a LoRA
        profile's `max_lora_rank` `DEFAULT_MAX_LORA_RANK`; task "generate" is stored as ""
        (what every profile from before the field reads as)."""
        return dataclasses.replace(
            self,
            max_lora_rank=self.max_lora_rank or (DEFAULT_MAX_LORA_RANK if self.max_loras else 0),
            task="" if self.task == TASK_GENERATE else self.task,
            engine=self.engine or DEFAULT_ENGINE,
            transport=self.transport or DEFAULT_TRANSPORT,
            kv_cache_dtype=self.kv_cache_dtype or DEFAULT_KV_CACHE_DTYPE,
            tensor_parallel_size=self.tensor_parallel_size or 1,
            expected_context_tokens=self.expected_context_tokens or self.max_model_len,
            precision=self.precision.lower(),
        )

    @property
    def speculation(self) -> engine_features.Speculation:
        """Speculative decoding as set (0s: the method's defaults, resolved where the spec is
        built); method "" is off."""
        return engine_features.Speculation(
            method=self.speculative_method,
            model=self.speculative_model,
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_max=self.speculative_prompt_lookup_max,
            prompt_lookup_min=self.speculative_prompt_lookup_min,
        )

    @property
    def accelerator(self) -> Accelerator:
        """CPU for the CPU build of the engine (`engine: vllm-cpu`, our fixture model), else GPU.

        The engine kind is what says a replica runs on host memory: the proto's
        `DeploymentProfile.accelerator` is deprecated and refused when set (convert.py).
        """
        return Accelerator.CPU if self.engine == CPU_ENGINE else Accelerator.GPU

    @property
    def context_tokens(self) -> int:
        """Tokens per sequence the KV budget is sized for (expected context, else max length)."""
        return self.expected_context_tokens or self.max_model_len

    def revision(self) -> str:
        """Content hash of the normalised profile: 16 hex digits of SHA-256 over canonical JSON
        (sorted keys, no whitespace). Stable across processes and protobuf versions.

        Fields added to the profile later (`ADDED_FIELDS`) enter the hash only when set: an
        upgrade that adds a field must not change every stored deployment's revision, which
        would roll every replica of the fleet."""
        payload = dataclasses.asdict(self.with_defaults())
        payload["extra_engine_args"] = list(payload["extra_engine_args"])
        for name in ADDED_FIELDS:
            if not payload[name]:
                del payload[name]
        for name in UNHASHED_FIELDS:
            del payload[name]
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


#: Canary defaults, for a setting left 0 (`RolloutStrategy`; orchestrator.proto's comments).
DEFAULT_CANARY_WINDOW_SECONDS = 60
DEFAULT_CANARY_MIN_REQUESTS = 20
DEFAULT_MAX_CANARY_ERROR_RATE_INCREASE = 0.02  # absolute
DEFAULT_MAX_CANARY_TTFT_P99_RATIO = 1.5
DEFAULT_MAX_CANARY_TOOL_CALL_VALIDITY_DROP = 0.05  # absolute
MAX_CANARY_PERCENT = 50


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutStrategy:
    """How a profile change rolls out (mirrors the proto; used by rolling releases)."""

    max_surge: int = 1
    max_unavailable: int = 0
    max_error_rate: float = 0.0
    max_ttft_p99_seconds: float = 0.0
    gate_window_seconds: int = 0
    drain_grace_period_seconds: int = 30
    # The canary stage (issue 30; 0 = the default below, `effective_*`; canary_percent 0 = none).
    canary_percent: int = 0
    canary_window_seconds: int = 0
    canary_min_requests: int = 0
    max_canary_error_rate_increase: float = 0.0
    max_canary_ttft_p99_ratio: float = 0.0
    max_canary_tool_call_validity_drop: float = 0.0

    @property
    def effective_canary_window_seconds(self) -> int:
        return self.canary_window_seconds or DEFAULT_CANARY_WINDOW_SECONDS

    @property
    def effective_canary_min_requests(self) -> int:
        return self.canary_min_requests or DEFAULT_CANARY_MIN_REQUESTS

    @property
    def effective_max_canary_error_rate_increase(self) -> float:
        return self.max_canary_error_rate_increase or DEFAULT_MAX_CANARY_ERROR_RATE_INCREASE

    @property
    def effective_max_canary_ttft_p99_ratio(self) -> float:
        return self.max_canary_ttft_p99_ratio or DEFAULT_MAX_CANARY_TTFT_P99_RATIO

    @property
    def effective_max_canary_tool_call_validity_drop(self) -> float:
        return self.max_canary_tool_call_validity_drop or DEFAULT_MAX_CANARY_TOOL_CALL_VALIDITY_DROP


#: Autoscaling defaults, for a setting left 0 (`Autoscaling`; the proto's comments).
DEFAULT_SCALE_DOWN_WINDOW_SECONDS = 60
DEFAULT_IDLE_SECONDS_BEFORE_ZERO = 300
DEFAULT_TARGET_IN_FLIGHT_FRACTION = 0.8  # of the profile's max_num_seqs
DEFAULT_MAX_KV_USAGE = 0.9


@dataclasses.dataclass(frozen=True, slots=True)
class Autoscaling:
    """Autoscaling of one deployment (mirrors `inferplane.orchestrator.v1.Autoscaling`).

    Stored as set: 0 means the default, which the `effective_*` properties resolve (seconds;
    requests; a fraction 0..1). Disabled (the default): `replicas` is the operator's. Enabled:
    the autoscaler owns `replicas` within `replica_floor..max_replicas`
    (services/orchestrator/README.md, "Autoscaling").
    """

    enabled: bool = False
    scale_to_zero: bool = False
    scale_down_window_seconds: int = 0
    idle_seconds_before_zero: int = 0
    cold_start_budget_seconds: int = 0
    target_in_flight_per_replica: float = 0.0
    max_kv_usage: float = 0.0

    @property
    def effective_scale_down_window_seconds(self) -> int:
        return self.scale_down_window_seconds or DEFAULT_SCALE_DOWN_WINDOW_SECONDS

    @property
    def effective_idle_seconds_before_zero(self) -> int:
        return self.idle_seconds_before_zero or DEFAULT_IDLE_SECONDS_BEFORE_ZERO

    @property
    def effective_cold_start_budget_seconds(self) -> int:
        return self.cold_start_budget_seconds or DEFAULT_COLD_START_BUDGET_SECONDS

    @property
    def effective_max_kv_usage(self) -> float:
        return self.max_kv_usage or DEFAULT_MAX_KV_USAGE

    def target_in_flight(self, max_num_seqs: int) -> float:
        """Requests in flight one replica should carry: the setting, else 0.8 × `max_num_seqs`
        (at least 1)."""
        if self.target_in_flight_per_replica > 0:
            return self.target_in_flight_per_replica
        return max(1.0, DEFAULT_TARGET_IN_FLIGHT_FRACTION * max_num_seqs)


@dataclasses.dataclass(frozen=True, slots=True)
class Deployment:
    """The desired state of a model behind a name.

    `deployment_id` is the `model` clients send; `aliases` are other names for it. `replicas`
    is the desired count within `min_replicas..max_replicas`. `revision` is
    `profile.revision()` (kept with the value so stores and rollouts need not recompute it).
    Times are timezone-aware UTC.
    """

    deployment_id: str
    profile: DeploymentProfile
    replicas: int = 1
    min_replicas: int = 0
    max_replicas: int = 0
    aliases: tuple[str, ...] = ()
    rollout: RolloutStrategy = RolloutStrategy()
    owned_by: str = "inferplane"
    routing_policy: str = DEFAULT_ROUTING_POLICY
    revision: str = ""
    create_time: datetime | None = None
    update_time: datetime | None = None
    autoscaling: Autoscaling = Autoscaling()

    @property
    def autoscaled(self) -> bool:
        """Whether the autoscaler owns `replicas` (autoscaling enabled)."""
        return self.autoscaling.enabled

    @property
    def replica_floor(self) -> int:
        """The fewest replicas the autoscaler keeps while the deployment is in use:
        max(min_replicas, 1); only scale to zero goes below it, after the idle period."""
        return max(self.min_replicas, 1)

    @property
    def name(self) -> str:
        """Resource name, `deployments/{deployment_id}`."""
        return f"deployments/{self.deployment_id}"

    def replica_ids(self) -> tuple[str, ...]:
        """The desired replicas' ids, `{deployment_id}-{ordinal}`, ordinal 0..replicas-1."""
        return tuple(f"{self.deployment_id}-{i}" for i in range(self.replicas))

    def normalised(self) -> Deployment:
        """Defaults filled (profile, replica bounds, owner, routing policy) and the revision set.

        Replica bounds: `replicas` 0 means max(min_replicas, 1); `max_replicas` 0 means no
        upper bound (kept as 0, so raising `replicas` later needs no bound change).
        """
        profile = self.profile.with_defaults()
        replicas = self.replicas or max(self.min_replicas, 1)
        return dataclasses.replace(
            self,
            profile=profile,
            replicas=replicas,
            owned_by=self.owned_by or "inferplane",
            routing_policy=self.routing_policy or DEFAULT_ROUTING_POLICY,
            revision=profile.revision(),
        )


#: A LoRA adapter's phases: served, or out of the routing table and waiting for the requests
#: that still use it (its drain grace) before its row goes.
ADAPTER_READY = "Ready"
ADAPTER_DELETING = "Deleting"


@dataclasses.dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter served on top of a base deployment (issue 29; the proto's `LoraAdapter`).

    `adapter_id` names it in the catalogue (`adapters/{adapter_id}`) and to the replica (the
    `x-inferplane-adapter` header, the engine's LoRA name); clients send `model` =
    `{base_deployment}:{adapter_id}` or one of `aliases`. `source` is the adapter's folder
    (PEFT layout) under the orchestrator's adapter root; `rank` one of `LORA_RANKS`.
    `delete_time` is set while `phase` is `ADAPTER_DELETING`. Times are timezone-aware UTC.
    """

    adapter_id: str
    base_deployment: str
    source: str
    rank: int
    aliases: tuple[str, ...] = ()
    phase: str = ADAPTER_READY
    create_time: datetime | None = None
    delete_time: datetime | None = None

    @property
    def name(self) -> str:
        """Resource name, `adapters/{adapter_id}`."""
        return f"adapters/{self.adapter_id}"

    @property
    def model(self) -> str:
        """The canonical model name clients send: `{base_deployment}:{adapter_id}`."""
        return f"{self.base_deployment}:{self.adapter_id}"

    @property
    def models(self) -> tuple[str, ...]:
        """Every model name that routes to it: `model`, then the aliases."""
        return (self.model, *self.aliases)
