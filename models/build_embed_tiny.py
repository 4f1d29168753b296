"""Build the embedding fixture model ``embed-tiny`` into ``models/embed-tiny/``.

    python models/build_embed_tiny.py [--out DIR]

A random-initialised (seed 1234) ``BertModel`` — hidden 64, 2 layers, 2 heads, intermediate 128,
512 positions — with a locally built WordPiece ``BertTokenizer`` (lower-casing; vocabulary: BERT's
five special tokens, printable ASCII characters, ``##`` continuations of letters and digits,
common suffixes and a few hundred frequent English words, so ASCII text never maps to ``[UNK]``).
Nothing is trained and nothing is downloaded: the vectors mean nothing, but they are a fixed
function of the text, which is what serving tests need.

vLLM serves it as an embedding model (``--runner pooling``). It learns the pooling from the
sentence-transformers files written here (vllm/transformers_utils/config.py,
``get_pooling_config``): ``modules.json`` lists a Pooling module (``1_Pooling/config.json``:
mean over tokens, ``[CLS]`` and ``[SEP]`` included) and a Normalize module (unit L2 norm by
default). ``sentence_bert_config.json`` gives the 512-token limit. ``config.json`` carries
``matryoshka_dimensions`` so that vLLM accepts the OpenAI ``dimensions`` field for 16, 32 or 64
(vllm/pooling_params.py: the pooled vector is cut to its first ``dimensions`` values, then
normalised); the model was not trained for it, so a cut vector is just a prefix.

Deterministic: the same bytes on every run with the same torch/transformers versions (checked by
building twice); ``MANIFEST.json`` records every file's sha256, the shape and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fixture_build import (  # noqa: E402
    folder_digests,
    library_versions,
    publish,
    write_json,
)

from inferplane.fixtures import embed_tiny as et  # noqa: E402

SEED = 1234
SHAPE = {
    "hidden": 64,
    "layers": 2,
    # Head size 32: vLLM's CPU attention supports 32, 64, 80, ... (16 fails at the first request,
    # vllm/v1/attention/backends/cpu_attn.py `get_supported_head_sizes`).
    "heads": 2,
    "intermediate": 128,
    "max_positions": et.MAX_MODEL_LEN,
}
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SUFFIXES = [
    "s", "es", "ed", "ing", "ly", "er", "ers", "est", "ion", "ions", "ment", "ness", "able",
    "al", "ful", "less", "ity", "ive", "ize", "ous", "en", "th", "y",
]  # fmt: skip
# Frequent English words (lower case): whole-word tokens, so common text is not all wordpieces.
_WORDS_TEXT = """
the be to of and a in that have i it for not on with he as you do at this but his by from they
we say her she or an will my one all would there their what so up out if about who get which go
me when make can like time no just him know take people into year your good some could them see
other than then now look only come its over think also back after use two how our work first well
way even new want because any these give day most us is are was were been has had did said does
made went hello world text input model embedding vector test tests server request response token
tokens sentence word words query document search find similar small tiny large fast slow cat dog
house car tree water fire city country name number data file files code python rust value values
list set map key keys question answer yes true false left right up down red green blue black white
one two three four five six seven eight nine ten hundred thousand million today tomorrow yesterday
morning evening night week month weather sun rain snow wind cold hot warm happy sad big little long
short high low old young great best better more less many much very really here where why again
still never always often every each both few own same such through during before under between
without within around should may might must shall need help start stop open close read write run
call ask tell show try keep let put mean seem leave feel become leave turn place point hand part
life child children man woman men women family friend home school state student group problem
fact system program government company story lot money area night thing things something nothing
everything anything someone everyone"""
WORDS = _WORDS_TEXT.split()


def vocabulary() -> dict[str, int]:
    """Token -> id: special tokens, characters, ``##`` pieces, suffixes, words (no duplicates,
    this order). BERT's basic tokenizer lower-cases, strips accents and splits on punctuation,
    so every printable ASCII character and every ``##`` letter/digit covers any ASCII word."""
    chars = [c for c in string.printable if not c.isspace() and not c.isupper()]
    pieces = ["##" + c for c in string.ascii_lowercase + string.digits]
    tokens = SPECIAL_TOKENS + chars + pieces + ["##" + s for s in SUFFIXES] + WORDS
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}


def build_tokenizer(vocab: dict[str, int]) -> Any:
    from transformers import BertTokenizer

    # transformers 5: BertTokenizer is the tokenizers-backed class; it takes `vocab` as a dict
    # (a `vocab_file` argument is ignored).
    return BertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=et.MAX_MODEL_LEN)


def build_model(vocab_size: int, shape: dict[str, int]) -> Any:
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        intermediate_size=shape["intermediate"],
        max_position_embeddings=shape["max_positions"],
        type_vocab_size=2,
        pad_token_id=0,
        # Read by vLLM (ModelConfig.is_matryoshka / matryoshka_dimensions): the `dimensions`
        # values an embeddings request may ask for.
        matryoshka_dimensions=list(et.MATRYOSHKA_DIMENSIONS),
    )
    config.architectures = ["BertModel"]
    torch.manual_seed(SEED)
    return BertModel(config).eval()


def sentence_transformers_files(out: Path, hidden: int) -> None:
    """The sentence-transformers layout vLLM reads for the pooling (mean) and normalisation."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    pooling = {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
    }
    write_json(out / "modules.json", modules)
    (out / "1_Pooling").mkdir(exist_ok=True)
    write_json(out / "1_Pooling" / "config.json", pooling)
    write_json(
        out / "sentence_bert_config.json",
        {"max_seq_length": et.MAX_MODEL_LEN, "do_lower_case": False},
    )


def check(out: Path, vocab: dict[str, int]) -> dict[str, Any]:
    """Reloads the folder as vLLM does (AutoTokenizer, AutoModel) and checks shapes, the
    tokenizer round trip and that English text needs no [UNK]; returns facts for the manifest."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModel.from_pretrained(str(out), dtype=torch.float32).eval()
    assert tok.get_vocab() == vocab, "reloaded vocabulary differs"
    unk = tok.convert_tokens_to_ids("[UNK]")
    for text in et.SAMPLE_TEXTS:
        ids = tok(text)["input_ids"]
        assert unk not in ids, f"[UNK] in {text!r}: {tok.convert_ids_to_tokens(ids)}"
    vectors = et.reference_embeddings(list(et.SAMPLE_TEXTS), model=model, tokenizer=tok)
    assert vectors.shape == (len(et.SAMPLE_TEXTS), et.EMBEDDING_DIM)
    return {
        "tokenizer_class_loaded": type(tok).__name__,
        "sample_token_counts": {t: len(tok(t)["input_ids"]) for t in et.SAMPLE_TEXTS},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "models" / et.SERVED_MODEL_NAME)
    args = ap.parse_args(argv)

    import torch

    t_start = time.monotonic()
    torch.set_num_threads(1)
    vocab = vocabulary()
    tokenizer = build_tokenizer(vocab)
    model = build_model(len(vocab), SHAPE)
    n_params = sum(p.numel() for p in model.parameters())

    out: Path = args.out
    staging = Path(tempfile.mkdtemp(prefix="embed-tiny-"))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        # vocab.txt too: readers of the slow/legacy tokenizer (transformers 4) need it.
        (staging / "vocab.txt").write_text("".join(t + "\n" for t in vocab))
        sentence_transformers_files(staging, SHAPE["hidden"])
        publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    facts = check(out, vocab)
    files = folder_digests(out)
    manifest = {
        "name": et.SERVED_MODEL_NAME,
        "architecture": "BertModel",
        "parameters": n_params,
        "shape": SHAPE,
        "vocab_size": len(vocab),
        "embedding_dim": et.EMBEDDING_DIM,
        "matryoshka_dimensions": list(et.MATRYOSHKA_DIMENSIONS),
        "pooling": "mean over all tokens ([CLS] and [SEP] included), L2-normalised",
        "dtype": "float32",
        "size_bytes": sum((out / f).stat().st_size for f in files),
        "build_command": "python models/build_embed_tiny.py",
        "seed": SEED,
        "trained": False,
        **facts,
        "versions": library_versions(),
        "sha256": files,
    }
    # No wall time in the manifest: it would be the one file that differs between builds.
    write_json(out / "MANIFEST.json", manifest)
    summary = {k: manifest[k] for k in ("parameters", "size_bytes")}
    print(json.dumps({**summary, "build_seconds": round(time.monotonic() - t_start, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
