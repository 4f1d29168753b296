"""The engine arguments a deployment profile may carry (`profile.extra_engine_args`), issue 18.

Those arguments reach vLLM's own parser on every node that runs the deployment, and many vLLM
flags run code or widen what a replica can touch: `--trust-remote-code` (the model folder's
Python), `--worker-cls`, `--logits-processors`, `--scheduler-cls` (import any class),
`--kv-transfer-config`, `--otlp-traces-endpoint` (connect out), `--download-dir`,
`--allowed-local-media-path` (paths), `--enable-log-requests` (tenants' prompts in the logs).
So only the flags of the engine version's list pass, each with its value checked. The
orchestrator checks a profile (with its `engine_version`) when a deployment is created or
updated (INVALID_ARGUMENT naming the flag); the node-agent checks again, against the list of
the engine it selected, before it starts a replica, whoever sent the spec.

Syntax: `--flag value` (two items) or `--flag=value`; a switch takes no value and has its
`--no-` form; a flag may appear once. Spellings are exact: vLLM's parser also takes
underscores (`--trust_remote_code`), prefixes of long names (`--trust-remote`) and `--config
FILE`, none of which a list of names could vet. Integers are plain ASCII decimals.

Flags that a typed profile field or placement sets (`PROFILE_OWNED`) are refused with the field
to set instead: vLLM takes the last occurrence, so an extra `--gpu-memory-utilization` would
override the share placement reserved on a GPU that other replicas use too.

The list is per engine version (issue 30: `engine_version` selects the engine that runs):
`ALLOWED_FLAGS_BY_VERSION`. vLLM 0.32's is defined (`vllm serve --help`, engine arguments
only: the `inproc` transport parses them with `AsyncEngineArgs`; `--swap-space` is gone from
its V1 engine); each other version's is derived from it by its stated differences
(`VERSION_DIFFERENCES`, found by diffing `vllm/engine/arg_utils.py` of the two releases). An
empty engine version means `DEFAULT_ENGINE_VERSION`, whose list `ALLOWED_FLAGS` is; a version
is matched on its major.minor (vLLM's patch releases keep their flags).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType

_DECIMAL = re.compile(r"-?[0-9]{1,19}")
_SHOWN = 80  # characters of a refused item quoted in an error message


@dataclasses.dataclass(frozen=True, slots=True)
class Switch:
    """A flag without a value; `--no-<name>` is its negation."""

    def describe(self) -> str:
        return "no value"


@dataclasses.dataclass(frozen=True, slots=True)
class Integer:
    """A decimal integer in `low..high` (inclusive)."""

    low: int
    high: int

    def describe(self) -> str:
        return f"an integer {self.low}-{self.high}"

    def accepts(self, value: str) -> bool:
        return bool(_DECIMAL.fullmatch(value)) and self.low <= int(value) <= self.high


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """One of `values`, exactly."""

    values: tuple[str, ...]

    def describe(self) -> str:
        return "one of " + ", ".join(self.values)

    def accepts(self, value: str) -> bool:
        return value in self.values


ValueRule = Switch | Integer | Choice


@dataclasses.dataclass(frozen=True, slots=True)
class AllowedFlag:
    """One allowed engine flag: its long name, the value it takes, and what it is for."""

    name: str
    rule: ValueRule
    purpose: str


#: vLLM's KV cache dtypes a profile may ask for, by the name of the profile's `kv_cache_dtype`
#: (the orchestrator's sizing) that sizes the same bytes per element.
KV_CACHE_DTYPES: Mapping[str, str] = MappingProxyType(
    {
        "auto": "auto",
        "bf16": "bfloat16",
        "fp16": "float16",
        "fp8": "fp8",
        "fp8_e4m3": "fp8_e4m3",
        "fp8_e5m2": "fp8_e5m2",
    }
)

_TOKENS = Integer(1, 1 << 24)

#: The engine version an empty `engine_version` (a profile's, a spec's) means: the default
#: environment's vLLM (requirements.lock).
DEFAULT_ENGINE_VERSION = "0.32.0"

#: vLLM 0.32's allow-list, by flag name (documented in services/orchestrator/README.md).
_V0_32: Mapping[str, AllowedFlag] = MappingProxyType(
    {
        flag.name: flag
        for flag in (
            AllowedFlag("--enable-prefix-caching", Switch(), "reuse the KV of shared prefixes"),
            AllowedFlag("--enable-chunked-prefill", Switch(), "split long prefills into chunks"),
            AllowedFlag("--enforce-eager", Switch(), "no CUDA graphs / compilation"),
            AllowedFlag("--async-scheduling", Switch(), "overlap scheduling with execution"),
            AllowedFlag("--enable-expert-parallel", Switch(), "MoE experts across the TP ranks"),
            AllowedFlag("--disable-custom-all-reduce", Switch(), "NCCL's all-reduce only"),
            AllowedFlag("--max-num-batched-tokens", _TOKENS, "tokens per engine step"),
            AllowedFlag("--long-prefill-token-threshold", Integer(0, 1 << 24), "long-prompt cap"),
            AllowedFlag("--block-size", Integer(1, 1024), "tokens per KV cache block"),
            AllowedFlag("--max-cudagraph-capture-size", Integer(1, 4096), "largest CUDA graph"),
            AllowedFlag("--seed", Integer(0, (1 << 32) - 1), "the engine's random seed"),
            AllowedFlag(
                "--kv-cache-dtype",
                Choice(tuple(KV_CACHE_DTYPES.values())),
                "KV cache element type (must match profile.kv_cache_dtype)",
            ),
            # Prefix-cache blocks are shared across tenants: only a collision-resistant hash
            # keeps one tenant from crafting a prompt that hits another's cached blocks.
            AllowedFlag(
                "--prefix-caching-hash-algo",
                Choice(("sha256", "sha256_cbor")),
                "prefix-cache block hash",
            ),
            AllowedFlag(
                "--performance-mode",
                Choice(("balanced", "interactivity", "throughput")),
                "vLLM's latency/throughput preset",
            ),
        )
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class VersionDifferences:
    """How one engine version's allow-list differs from `base`'s: flags it adds (or takes with
    another rule) and flags it lacks, with the reason."""

    base: str
    added: tuple[AllowedFlag, ...] = ()
    removed: tuple[str, ...] = ()
    reason: str = ""


#: The other versions, each as its differences from a defined one.
VERSION_DIFFERENCES: Mapping[str, VersionDifferences] = MappingProxyType(
    {
        "0.31.0": VersionDifferences(
            base="0.32.0",
            # vLLM 0.31 still has cascade attention (ModelConfig.disable_cascade_attn, default
            # True: `--no-disable-cascade-attn` turns it on); 0.32 removed it and keeps the
            # flag as a deprecated no-op (gone in 0.33), so 0.32's list leaves it out.
            added=(AllowedFlag("--disable-cascade-attn", Switch(), "no cascade attention"),),
            reason="cascade attention exists in vLLM 0.31 only",
        ),
    }
)


def _derive(version: str) -> Mapping[str, AllowedFlag]:
    if version == "0.32.0":
        return _V0_32
    diff = VERSION_DIFFERENCES[version]
    flags = {name: flag for name, flag in _derive(diff.base).items() if name not in diff.removed}
    flags.update((flag.name, flag) for flag in diff.added)
    return MappingProxyType(dict(sorted(flags.items())))


#: The allow-list of each engine version (issue 30), by version then flag name.
ALLOWED_FLAGS_BY_VERSION: Mapping[str, Mapping[str, AllowedFlag]] = MappingProxyType(
    {version: _derive(version) for version in ("0.31.0", "0.32.0")}
)

#: The allow-list of `DEFAULT_ENGINE_VERSION`, by flag name.
ALLOWED_FLAGS: Mapping[str, AllowedFlag] = ALLOWED_FLAGS_BY_VERSION[DEFAULT_ENGINE_VERSION]

#: Flags a typed profile field or placement sets, and what to set instead.
PROFILE_OWNED: Mapping[str, str] = MappingProxyType(
    {
        "--model": "profile.model_source",
        "--served-model-name": "the deployment id and aliases",
        "--dtype": "profile.precision",
        "--quantization": "profile.precision",
        "--max-model-len": "profile.max_model_len",
        "--max-num-seqs": "profile.max_num_seqs",
        "--tensor-parallel-size": "profile.tensor_parallel_size",
        "--stream-interval": "profile.stream_interval",
        "--reasoning-parser": "profile.reasoning_parser",
        "--speculative-config": "profile.speculative_method and profile.speculative_model",
        "--gpu-memory-utilization": "placement, from the profile's sizing",
        "--kv-cache-memory-bytes": "placement, from the profile's KV budget",
        # LoRA (issue 29): the profile's max_loras turns it on, with max_lora_rank
        # (replica_contract.lora_args); adapters are catalogue objects, loaded on demand.
        "--enable-lora": "profile.max_loras (LoRA adapters a replica may hold; 0: LoRA off)",
        "--max-loras": "profile.max_loras",
        "--max-lora-rank": "profile.max_lora_rank",
        "--max-cpu-loras": "profile.max_loras",
    }
)


class EngineArgError(ValueError):
    """An engine argument outside its engine version's list (`allowed_flags`), a value its rule
    refuses, or arguments for an engine version without a list.

    Attributes:
        flag: the flag at fault, as written (without `=value`).
    """

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclasses.dataclass(frozen=True, slots=True)
class EngineArg:
    """One checked argument: its allowed flag name, whether it is the `--no-` form of a
    switch, and its value (None for a switch)."""

    name: str
    negated: bool = False
    value: str | None = None


def allowed_flags(engine_version: str = "") -> Mapping[str, AllowedFlag]:
    """The allow-list of `engine_version` ("0.31.0"; "" means `DEFAULT_ENGINE_VERSION`),
    matched on major.minor ("0.32.1" takes 0.32.0's list).

    Raises:
        KeyError: a version without a list (its message names the known ones).
    """
    version = engine_version or DEFAULT_ENGINE_VERSION
    found = ALLOWED_FLAGS_BY_VERSION.get(version)
    if found is not None:
        return found
    for known, flags in ALLOWED_FLAGS_BY_VERSION.items():
        if _minor(known) == _minor(version):
            return flags
    raise KeyError(
        f"engine_version {version!r} has no engine-argument allow-list; known: "
        + ", ".join(ALLOWED_FLAGS_BY_VERSION)
    )


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def check_engine_args(args: Sequence[str], engine_version: str = "") -> tuple[EngineArg, ...]:
    """Checks `args` (a profile's `extra_engine_args`) against the allow-list of
    `engine_version` (`allowed_flags`; "": `DEFAULT_ENGINE_VERSION`, `ALLOWED_FLAGS`).

    Returns:
        The arguments in order, one `EngineArg` per flag (() for no arguments, whatever the
        version).

    Raises:
        EngineArgError: the first argument at fault (not a flag, not allowed for that engine
            version, owned by a profile field, given twice, a value missing, unexpected or out
            of its rule), naming it; or arguments for an engine version without a list.
    """
    if not args:
        return ()
    try:
        allowed = allowed_flags(engine_version)
    except KeyError as exc:
        raise EngineArgError(str(exc.args[0]), _cut(args[0].partition("=")[0])) from None
    checked: list[EngineArg] = []
    seen: set[str] = set()
    items = iter(args)
    for item in items:
        flag, has_value, value = item.partition("=")
        if not flag.startswith("-") or flag in ("-", "--"):
            raise EngineArgError(
                f"engine argument {_show(item)} is not a flag (expected --name or --name=value)",
                _cut(flag),
            )
        name, negated = _resolve(flag, allowed)
        if name in seen:
            raise EngineArgError(f"engine argument {flag} is given twice", flag)
        seen.add(name)
        rule = allowed[name].rule
        if isinstance(rule, Switch):
            if has_value:
                raise EngineArgError(
                    f"engine argument {flag} takes no value; got {_show(value)}", flag
                )
            checked.append(EngineArg(name, negated))
            continue
        if not has_value:
            value = next(items, "")
            if not value:
                raise EngineArgError(
                    f"engine argument {flag} needs a value: {rule.describe()}", flag
                )
        if not rule.accepts(value):
            raise EngineArgError(
                f"engine argument {flag} takes {rule.describe()}; got {_show(value)}", flag
            )
        checked.append(EngineArg(name, value=value))
    return tuple(checked)


def _resolve(flag: str, allowed: Mapping[str, AllowedFlag]) -> tuple[str, bool]:
    """The allowed name `flag` spells and whether it is a switch's `--no-` form."""
    found = allowed.get(flag)
    if found is not None:
        return found.name, False
    if flag.startswith("--no-"):
        positive = allowed.get("--" + flag.removeprefix("--no-"))
        if positive is not None and isinstance(positive.rule, Switch):
            return positive.name, True
    owner = PROFILE_OWNED.get(flag)
    if owner is not None:
        raise EngineArgError(f"engine argument {flag} is set from {owner}; set that instead", flag)
    raise EngineArgError(
        f"engine argument {_show(flag)} is not allowed; allowed: "
        + ", ".join(sorted(allowed))
        + " (switches also as --no-<name>)",
        _cut(flag),
    )


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _show(text: str) -> str:
    """`text` quoted for an error message, cut to `_SHOWN` characters."""
    return repr(_cut(text))
