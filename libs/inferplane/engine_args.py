"""The engine arguments a deployment profile may carry (`profile.extra_engine_args`), issue 18.

Those arguments reach vLLM's own parser on every node that runs the deployment, and many vLLM
flags run code or widen what a replica can touch: `--trust-remote-code` (the model folder's
Python), `--worker-cls`, `--logits-processors`, `--scheduler-cls` (import any class),
`--kv-transfer-config`, `--otlp-traces-endpoint` (connect out), `--download-dir`,
`--allowed-local-media-path` (paths), `--enable-log-requests` (tenants' prompts in the logs).
So only the flags of `ALLOWED_FLAGS` pass, each with its value checked. The orchestrator checks
a profile when a deployment is created or updated (INVALID_ARGUMENT naming the flag); the
node-agent checks again before it starts a replica, whoever sent the spec.

Syntax: `--flag value` (two items) or `--flag=value`; a switch takes no value and has its
`--no-` form; a flag may appear once. Spellings are exact: vLLM's parser also takes
underscores (`--trust_remote_code`), prefixes of long names (`--trust-remote`) and `--config
FILE`, none of which a list of names could vet. Integers are plain ASCII decimals.

Flags that a typed profile field or placement sets (`PROFILE_OWNED`) are refused with the field
to set instead: vLLM takes the last occurrence, so an extra `--gpu-memory-utilization` would
override the share placement reserved on a GPU that other replicas use too.

The list targets vLLM 0.32 (`vllm serve --help`, engine arguments only: the `inproc` transport
parses them with `AsyncEngineArgs`). `--swap-space` is gone from vLLM 0.32's V1 engine.
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

#: The allow-list, by flag name (documented in services/orchestrator/README.md).
ALLOWED_FLAGS: Mapping[str, AllowedFlag] = MappingProxyType(
    {
        flag.name: flag
        for flag in (
            AllowedFlag("--enable-prefix-caching", Switch(), "reuse the KV of shared prefixes"),
            AllowedFlag("--enable-chunked-prefill", Switch(), "split long prefills into chunks"),
            AllowedFlag("--enforce-eager", Switch(), "no CUDA graphs / compilation"),
            AllowedFlag("--async-scheduling", Switch(), "overlap scheduling with execution"),
            AllowedFlag("--enable-expert-parallel", Switch(), "MoE experts across the TP ranks"),
            AllowedFlag("--disable-custom-all-reduce", Switch(), "NCCL's all-reduce only"),
            AllowedFlag("--disable-cascade-attn", Switch(), "no cascade attention"),
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
    """An engine argument outside `ALLOWED_FLAGS`, or a value its rule refuses.

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


def check_engine_args(args: Sequence[str]) -> tuple[EngineArg, ...]:
    """Checks `args` (a profile's `extra_engine_args`) against `ALLOWED_FLAGS`.

    Returns:
        The arguments in order, one `EngineArg` per flag.

    Raises:
        EngineArgError: the first argument at fault (not a flag, not allowed, owned by a
            profile field, given twice, a value missing, unexpected or out of its rule),
            naming it.
    """
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
        name, negated = _resolve(flag)
        if name in seen:
            raise EngineArgError(f"engine argument {flag} is given twice", flag)
        seen.add(name)
        rule = ALLOWED_FLAGS[name].rule
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


def _resolve(flag: str) -> tuple[str, bool]:
    """The allowed name `flag` spells and whether it is a switch's `--no-` form."""
    allowed = ALLOWED_FLAGS.get(flag)
    if allowed is not None:
        return allowed.name, False
    if flag.startswith("--no-"):
        positive = ALLOWED_FLAGS.get("--" + flag.removeprefix("--no-"))
        if positive is not None and isinstance(positive.rule, Switch):
            return positive.name, True
    owner = PROFILE_OWNED.get(flag)
    if owner is not None:
        raise EngineArgError(f"engine argument {flag} is set from {owner}; set that instead", flag)
    raise EngineArgError(
        f"engine argument {_show(flag)} is not allowed; allowed: "
        + ", ".join(sorted(ALLOWED_FLAGS))
        + " (switches also as --no-<name>)",
        _cut(flag),
    )


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _show(text: str) -> str:
    """`text` quoted for an error message, cut to `_SHOWN` characters."""
    return repr(_cut(text))
