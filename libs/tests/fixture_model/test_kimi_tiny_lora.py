"""The fixture LoRA adapter ``kimi-tiny-lora`` (models/kimi-tiny-lora, built by
models/build_lora_fixture.py): the committed folder is what its MANIFEST says and what the
script builds (same library versions), a PEFT LoRA of vLLM's shape (rank 8, the Qwen2
projections, no bias or DoRA) on top of the committed kimi-tiny weights. Served with vLLM
(the adapter changes the output, the base model's stays the same) in
tests/node/test_replica_lora_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixture_build import assert_rebuilds_identically, folder_digests

from inferplane import lora
from inferplane.fixtures import kimi_tiny as kt
from inferplane.fixtures import kimi_tiny_lora as kl

safetensors_torch = pytest.importorskip("safetensors.torch")

REPO = Path(__file__).resolve().parents[3]
MAX_FOLDER_BYTES = 512 * 1024


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((kl.adapter_path() / "MANIFEST.json").read_text())


def test_folder_matches_manifest_and_base_model(manifest: dict) -> None:
    folder = kl.adapter_path()
    assert folder_digests(folder) == manifest["sha256"]
    assert sorted(manifest["sha256"]) == [kl.CONFIG_FILE, kl.WEIGHTS_FILE]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size < MAX_FOLDER_BYTES
    base = json.loads((kt.model_path() / "MANIFEST.json").read_text())
    # Trained against these base weights: a rebuilt kimi-tiny needs a rebuilt adapter.
    assert manifest["base_weights_sha256"] == base["sha256"]["model.safetensors"]
    assert manifest["adapter_output"] == kl.ADAPTER_OUTPUT
    assert manifest["adapter_min_margin"] >= 2.0


def test_rebuild_gives_the_same_bytes(tmp_path: Path) -> None:
    """Deterministic: with the committed build's library versions the script reproduces every
    file, MANIFEST.json included (~10 s: it trains 60 steps and checks the outputs)."""
    assert_rebuilds_identically(
        REPO / "models" / "build_lora_fixture.py", kl.adapter_path(), tmp_path / "lora"
    )


def test_config_is_a_plain_lora_vllm_serves() -> None:
    """What vLLM's PEFTHelper reads: rank among vLLM's allowed ranks, alpha, the Qwen2
    projections, no bias, no DoRA, no modules to save; `inferplane.lora.adapter_rank` reads
    the same rank."""
    folder = kl.adapter_path()
    config = json.loads((folder / kl.CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == kl.RANK in lora.ALLOWED_RANKS
    assert config["lora_alpha"] == kl.ALPHA
    assert config["target_modules"] == list(kl.TARGET_MODULES)
    assert config["bias"] == "none" and not config["use_dora"] and not config["modules_to_save"]
    assert lora.adapter_rank(folder) == kl.RANK


def test_weights_are_peft_names_and_shapes() -> None:
    """`lora_A` is rank × in and `lora_B` out × rank for every target projection of both
    layers, under PEFT's `base_model.model.` prefix, matching kimi-tiny's shapes."""
    base = safetensors_torch.load_file(str(kt.model_path() / "model.safetensors"))
    weights = safetensors_torch.load_file(str(kl.adapter_path() / kl.WEIGHTS_FILE))
    config = json.loads((kt.model_path() / "config.json").read_text())
    expected = set()
    for layer in range(config["num_hidden_layers"]):
        for module in kl.TARGET_MODULES:
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"model.layers.{layer}.{parent}.{module}"
            out_features, in_features = base[f"{name}.weight"].shape
            a = weights[f"base_model.model.{name}.lora_A.weight"]
            b = weights[f"base_model.model.{name}.lora_B.weight"]
            assert tuple(a.shape) == (kl.RANK, in_features)
            assert tuple(b.shape) == (out_features, kl.RANK)
            assert b.abs().sum() > 0  # trained (PEFT starts B at zero)
            expected |= {f"base_model.model.{name}.lora_A.weight"}
            expected |= {f"base_model.model.{name}.lora_B.weight"}
    assert set(weights) == expected
