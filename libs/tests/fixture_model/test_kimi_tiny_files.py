"""kimi-tiny's committed folder: what its MANIFEST says, a 128k-token position limit that vLLM
and the tokenizer both see, files that the build writes byte for byte today
(models/refresh_kimi_tiny.py on a copy changes nothing), and weights that do not depend on the
position limit (so raising it from 2,048 needed no training).

A full rebuild trains for 6.5-20 minutes (models/README.md), so no test retrains; the greedy
outputs the build checked are tests/test_kimi_tiny.py's (transformers) and
models/check_kimi_tiny_vllm.py's (vLLM).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixture_build import MANIFEST, folder_digests

from inferplane.chat import render_chat
from inferplane.fixtures import kimi_tiny as kt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[3]
TRAINED_POSITIONS = 2048  # the limit the committed weights were trained under


def test_folder_matches_manifest() -> None:
    manifest = json.loads((kt.model_path() / MANIFEST).read_text())
    assert folder_digests(kt.model_path()) == manifest["sha256"]
    assert manifest["name"] == kt.SERVED_MODEL_NAME


def test_position_limit_is_128k_with_plain_rope() -> None:
    """config.json and the tokenizer both say 131,072 tokens; RoPE is the default kind (no
    scaling to configure, nothing vLLM would refuse at positions past the trained length)."""
    folder = kt.model_path()
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == kt.MAX_POSITIONS == 131_072
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert "rope_scaling" not in config
    assert kt.MAX_MODEL_LEN <= kt.MAX_POSITIONS
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.model_max_length == kt.MAX_POSITIONS


def test_refresh_on_the_committed_folder_changes_no_byte(tmp_path: Path) -> None:
    """The build's non-weight files as it writes them today (same seed, same BPE training,
    today's config) are the committed ones, the weights saved through today's model come out
    byte-identical, and MANIFEST.json is already up to date."""
    manifest = json.loads((kt.model_path() / MANIFEST).read_text())
    import tokenizers

    if manifest["versions"]["transformers"] != transformers.__version__ or (
        manifest["versions"]["tokenizers"] != tokenizers.__version__
    ):
        pytest.skip(f"committed with {manifest['versions']}; refresh to compare")
    copy = tmp_path / "kimi-tiny"
    shutil.copytree(kt.model_path(), copy)
    result = subprocess.run(
        [sys.executable, str(REPO / "models" / "refresh_kimi_tiny.py"), "--out", str(copy)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "changed: nothing" in result.stdout
    for path in sorted(kt.model_path().iterdir()):
        assert (copy / path.name).read_bytes() == path.read_bytes(), path.name


def _model(max_positions: int) -> object:
    config = transformers.AutoConfig.from_pretrained(
        str(kt.model_path()), max_position_embeddings=max_positions
    )
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(kt.model_path()), config=config, dtype=torch.float32
    ).eval()


def test_weights_do_not_depend_on_the_position_limit() -> None:
    """The build's random initialisation draws the same numbers under either limit (so
    training from it is the same), and the committed weights give the same logits on a
    canonical prompt under the trained limit and under today's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def init(limit: int) -> dict[str, object]:
        torch.manual_seed(1234)
        config = Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=1,
            head_dim=32,
            max_position_embeddings=limit,
        )
        return Qwen2ForCausalLM(config).state_dict()

    trained, today = init(TRAINED_POSITIONS), init(kt.MAX_POSITIONS)
    assert trained.keys() == today.keys()
    assert all(torch.equal(trained[k], today[k]) for k in trained)

    torch.set_num_threads(2)
    tok = transformers.AutoTokenizer.from_pretrained(str(kt.model_path()))
    ids = torch.tensor([render_chat(kt.WEATHER.request(), tok).token_ids])
    with torch.no_grad():
        old = _model(TRAINED_POSITIONS)(ids).logits  # type: ignore[operator]
        new = _model(kt.MAX_POSITIONS)(ids).logits  # type: ignore[operator]
    assert torch.equal(old, new)
