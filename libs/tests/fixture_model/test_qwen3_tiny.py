"""The Qwen3-format fixture chat model ``qwen3-tiny`` (models/qwen3-tiny, built by
models/build_qwen3_tiny.py): the committed folder is what its MANIFEST says and what the script
builds; it loads with transformers as a ``Qwen3ForCausalLM`` with a ``Qwen2Tokenizer`` whose
Qwen3 markers are single tokens (special or not as in Qwen3's tokenizer), ends generation on
``<|im_end|>`` or ``<|endoftext|>``, and fits vLLM's CPU attention. Served through the platform
in tests/e2e/test_catalogue.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixture_build import assert_rebuilds_identically, folder_digests

from inferplane.fixtures import qwen3_tiny as qt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[3]
MAX_FOLDER_BYTES = 1024 * 1024


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((qt.model_path() / "MANIFEST.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(qt.model_path()))


def test_folder_matches_manifest(manifest: dict) -> None:
    folder = qt.model_path()
    assert folder_digests(folder) == manifest["sha256"]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size < MAX_FOLDER_BYTES
    assert manifest["name"] == qt.SERVED_MODEL_NAME
    assert manifest["trained"] is False


def test_rebuild_gives_the_same_bytes(tmp_path: Path) -> None:
    """The build is deterministic: with the library versions of the committed build, the
    script reproduces every file (MANIFEST.json included)."""
    assert_rebuilds_identically(
        REPO / "models" / "build_qwen3_tiny.py", qt.model_path(), tmp_path / "qwen3-tiny"
    )


def test_config_is_qwen3_and_fits_the_cpu_engine() -> None:
    """What vLLM reads: the Qwen3 architecture, a head size its CPU attention has a kernel for
    (32 or more), 128k positions (plain RoPE) for the deployment's context, in config.json and
    the tokenizer, eos ids in generation_config."""
    folder = qt.model_path()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["head_dim"] >= 32 and config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == qt.MAX_POSITIONS == 131_072
    assert qt.MAX_MODEL_LEN <= qt.MAX_POSITIONS
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    generation = json.loads((folder / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert generation["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert config["eos_token_id"] == tok.eos_token_id
    assert tok.model_max_length == qt.MAX_POSITIONS


def test_markers_are_single_tokens_special_as_in_qwen3(tokenizer) -> None:
    """Each Qwen3 marker is one token; `<|im_start|>`/`<|im_end|>`/`<|endoftext|>` are special
    (dropped by skip_special_tokens) while the think and tool markers survive it, as in
    Qwen3's own tokenizer, so the parser sees them in decoded text."""
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    vocab = tokenizer.get_vocab()
    ids = [vocab[m] for m in qt.MARKERS]
    assert ids == list(range(ids[0], ids[0] + len(ids)))  # Qwen3's order, after the BPE vocab
    for marker in qt.MARKERS:
        assert tokenizer.encode(marker, add_special_tokens=False) == [vocab[marker]]
    text = "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    kept = tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True)
    assert kept == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    for sample in qt.SAMPLE_TEXTS:
        assert tokenizer.decode(tokenizer.encode(sample)) == sample


def test_model_loads_and_predicts_over_the_vocabulary(tokenizer) -> None:
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(qt.model_path()), dtype=torch.float32
    ).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    ids = tokenizer.encode("hello world")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()
