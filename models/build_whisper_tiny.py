"""Build the speech-to-text fixture model ``whisper-tiny`` into ``models/whisper-tiny/``.

    python models/build_whisper_tiny.py [--out DIR]

A random-initialised (seed 1234) ``WhisperForConditionalGeneration``: d_model 64, 2 encoder and
2 decoder layers of 2 heads (head size 32: vLLM's CPU attention has no kernel for 16), FFN 256,
80 mel bins, Whisper's 30 s window (3000 frames, 1500 encoder positions) and 448 decoder
positions. Its ``WhisperProcessor`` is built here: the standard ``WhisperFeatureExtractor``
and a byte-level BPE tokenizer (GPT-2's 256 byte symbols, merges for a few words) followed by
Whisper's special tokens in Whisper's order — ``<|endoftext|>``, ``<|startoftranscript|>``, the
100 language tokens of ``transformers.models.whisper.tokenization_whisper.LANGUAGES`` (vLLM's
language detection looks up ``<|xx|>`` for every language it supports), ``<|translate|>``,
``<|transcribe|>``, ``<|startoflm|>``, ``<|startofprev|>``, ``<|nospeech|>``,
``<|notimestamps|>`` — and the 1501 timestamp tokens ``<|0.00|>`` .. ``<|30.00|>`` last (vLLM's
``verbose_json`` reads a token's time as ``(id - id(<|0.00|>)) * 0.02`` s). Timestamps are
added tokens but not special ones, as in OpenAI's checkpoints.

Random weights decode gibberish that may run to the 448-token limit, so the decoder is
*programmed* instead (nothing is trained): token embeddings are random unit-length vectors,
and the last decoder layer's MLP becomes a lookup table, one neuron per rule "input token ->
next token" (the neuron fires when the pre-MLP LayerNorm output points at the input token's
embedding and writes the next token's embedding into the residual stream; the output
projection is tied to the embeddings, so that token gets the top logit). One always-on neuron
writes ``<|endoftext|>``, the next token after anything without a rule. The other weights keep
their random initialisation, so the audio still changes the logits a little. The rules
(:data:`RULES`) give the paths documented in ``inferplane.fixtures.whisper_tiny``. The build
replays them with transformers on several audios (silence, tones, noise) and prompts (plain,
translate, timestamps, a ``<|startofprev|>`` history that shifts positions) and fails unless
greedy decoding follows them with a top-1/top-2 logit margin of at least ``MIN_MARGIN``.

Deterministic: the same bytes on every run with the same torch/transformers versions (checked by
building twice); ``MANIFEST.json`` records every file's sha256, the shape, the margins and the
versions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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
    bytes_to_unicode,
    folder_digests,
    library_versions,
    publish,
    write_json,
)

from inferplane.fixtures import whisper_tiny as wt  # noqa: E402

SEED = 1234
SHAPE = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "heads": 2,
    "ffn": 256,
    "num_mel_bins": 80,
    "max_source_positions": 1500,
    "max_target_positions": wt.MAX_MODEL_LEN,
}
# Words that get BPE merges (so the transcripts are one token per word); any other text
# encodes byte by byte.
WORDS = ["tiny", "whisper", "tick", "tock", "hello", "world", "the", "and", "speech", "text"]

EOT = "<|endoftext|>"
SOT = "<|startoftranscript|>"
TRANSLATE, TRANSCRIBE = "<|translate|>", "<|transcribe|>"
START_OF_LM, START_OF_PREV = "<|startoflm|>", "<|startofprev|>"
NO_SPEECH, NO_TIMESTAMPS = "<|nospeech|>", "<|notimestamps|>"
TIME_PRECISION = 0.02  # seconds per timestamp token (Whisper's; vLLM's verbose_json uses it)
N_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>

# Greedy next token after each input token; anything else is followed by <|endoftext|>. Only
# the last prompt token matters: vLLM's prompts end with <|notimestamps|> (or <|0.00|> for
# verbose_json, vllm/entrypoints/speech_to_text/base/serving.py) and language detection sends
# <|startoftranscript|> alone. The <|en|>/<|transcribe|> rules make unforced decoding tidy too.
RULES: list[tuple[str, str]] = [
    (SOT, "<|" + wt.DETECTED_LANGUAGE + "|>"),
    ("<|" + wt.DETECTED_LANGUAGE + "|>", TRANSCRIBE),
    (TRANSCRIBE, "<|0.00|>"),
    (TRANSLATE, "<|0.00|>"),
    (NO_TIMESTAMPS, "Ġtiny"),
    ("Ġtiny", "Ġwhisper"),
    ("<|0.00|>", "Ġtick"),
    ("Ġtick", "Ġtock"),
    ("Ġtock", "<|1.00|>"),
]
# Strength of a rule's output vs the always-on <|endoftext|> (residual-stream units of one
# token embedding), and the final LayerNorm gain that turns them into logits.
RULE_GAIN, EOT_GAIN, FINAL_NORM_GAIN = 10.0, 3.0, 4.0
# A rule neuron fires when cos(pre-MLP LayerNorm output, key) exceeds THRESHOLD; SHARPNESS
# scales the pre-activation so non-matching tokens sit deep in GELU's zero region.
THRESHOLD, SHARPNESS = 0.6, 2.0
MIN_MARGIN = 4.0  # logits; the build fails below this on any checked path
MANIFEST_TOKENS = [EOT, SOT, "<|en|>", TRANSLATE, TRANSCRIBE, NO_TIMESTAMPS, "<|0.00|>",
                   "<|30.00|>"]  # fmt: skip


def bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The 256 byte symbols, then for each word of WORDS the left-to-right merges that build
    ``Ġword`` ("Ġ" is the byte symbol of a space)."""
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        current = "Ġ"
        for ch in word:
            if (current, ch) not in merges:
                merges.append((current, ch))
            current += ch
            vocab.setdefault(current, len(vocab))
    return vocab, merges


def special_tokens() -> list[str]:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    langs = [f"<|{code}|>" for code in LANGUAGES]
    return [EOT, SOT, *langs, TRANSLATE, TRANSCRIBE, START_OF_LM, START_OF_PREV, NO_SPEECH,
            NO_TIMESTAMPS]  # fmt: skip


def timestamp_tokens() -> list[str]:
    return [f"<|{i * TIME_PRECISION:.2f}|>" for i in range(N_TIMESTAMPS)]


def build_tokenizer() -> Any:
    from tokenizers import AddedToken
    from transformers import WhisperTokenizer

    vocab, merges = bpe_vocab_and_merges()
    tok = WhisperTokenizer(vocab=vocab, merges=merges, pad_token=EOT)
    specials = special_tokens()
    # <|endoftext|> is already there (eos/bos/unk/pad); the rest follow in Whisper's order.
    tok.add_special_tokens({"extra_special_tokens": specials[1:]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in timestamp_tokens()])
    # Prefix tokens were computed before <|startoftranscript|> existed; no default language.
    tok.set_prefix_tokens(language=None, task=None, predict_timestamps=False)
    ids = tok.convert_tokens_to_ids([*specials, *timestamp_tokens()])
    first = len(vocab)
    assert ids == list(range(first, first + len(ids))), "special tokens out of order"
    return tok


def build_config(tok: Any) -> Any:
    from transformers import WhisperConfig

    eot, sot = tok.convert_tokens_to_ids([EOT, SOT])
    config = WhisperConfig(
        vocab_size=len(tok),
        num_mel_bins=SHAPE["num_mel_bins"],
        d_model=SHAPE["d_model"],
        encoder_layers=SHAPE["encoder_layers"],
        decoder_layers=SHAPE["decoder_layers"],
        encoder_attention_heads=SHAPE["heads"],
        decoder_attention_heads=SHAPE["heads"],
        encoder_ffn_dim=SHAPE["ffn"],
        decoder_ffn_dim=SHAPE["ffn"],
        max_source_positions=SHAPE["max_source_positions"],
        max_target_positions=SHAPE["max_target_positions"],
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        # Set in generation_config.json; None replaces WhisperConfig's defaults, which are ids
        # of the real 51865-token vocabulary.
        begin_suppress_tokens=None,
        suppress_tokens=None,
        tie_word_embeddings=True,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    return config


def build_generation_config(tok: Any, config: Any) -> Any:
    """What WhisperForConditionalGeneration.generate reads (language/task ids, timestamps)."""
    from transformers import GenerationConfig
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    ids = tok.convert_tokens_to_ids
    return GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        max_length=wt.MAX_MODEL_LEN,
        # Whisper's: no space and no <|endoftext|> as the first generated token.
        begin_suppress_tokens=[ids("Ġ"), config.eos_token_id],
        suppress_tokens=[],
        is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES},
        task_to_id={"translate": ids(TRANSLATE), "transcribe": ids(TRANSCRIBE)},
        no_timestamps_token_id=ids(NO_TIMESTAMPS),
        prev_sot_token_id=ids(START_OF_PREV),
        max_initial_timestamp_index=50,
        return_timestamps=False,
        # All heads of the last decoder layer (for word-level timestamps).
        alignment_heads=[[SHAPE["decoder_layers"] - 1, h] for h in range(SHAPE["heads"])],
    )


def build_model(config: Any, tok: Any) -> Any:
    """The random model with its decoder programmed by RULES (see the module docstring)."""
    import torch
    from torch.nn import functional as F
    from transformers import WhisperForConditionalGeneration

    torch.manual_seed(SEED)
    model = WhisperForConditionalGeneration(config).eval()
    d = config.d_model
    decoder = model.model.decoder
    layer = decoder.layers[-1]
    ids = tok.convert_tokens_to_ids
    eot = ids(EOT)  # also the unknown token: what a misspelt rule token would map to
    inputs = [ids(a) for a, _ in RULES]
    outputs = [ids(b) for _, b in RULES]
    assert eot not in inputs + outputs and len(set(inputs)) == len(inputs)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(SEED + 1)
        emb = torch.randn(config.vocab_size, d, generator=gen) / math.sqrt(d)  # |row| ~ 1
        decoder.embed_tokens.weight.copy_(emb)  # also the output projection (tied)
        assert model.proj_out.weight.data_ptr() == decoder.embed_tokens.weight.data_ptr()
        # Keys: the pre-MLP LayerNorm's output for a bare token embedding, as unit vectors.
        keys = F.layer_norm(emb[inputs], (d,))
        keys = keys / keys.norm(dim=-1, keepdim=True)
        fc1, fc2 = layer.fc1, layer.fc2
        for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias):
            p.zero_()
        scale = SHARPNESS * math.sqrt(d)  # |LayerNorm output| = sqrt(d)
        n = len(RULES)
        fc1.weight[:n] = SHARPNESS * keys
        fc1.bias[:n] = -THRESHOLD * scale
        fired = F.gelu(torch.tensor((1 - THRESHOLD) * scale))
        for k, (src, dst) in enumerate(zip(inputs, outputs, strict=True)):
            # Replace the input token's own direction with the rule's output token.
            fc2.weight[:, k] = (RULE_GAIN * emb[dst] - emb[src]) / fired
        # The always-on neuron: bias 3 (GELU(3) ~ 3), writes <|endoftext|>.
        fc1.bias[n] = 3.0
        fc2.weight[:, n] = EOT_GAIN * emb[eot] / F.gelu(torch.tensor(3.0))
        decoder.layer_norm.weight.fill_(FINAL_NORM_GAIN)
        decoder.layer_norm.bias.zero_()
    return model


def test_audios(sample_rate: int) -> dict[str, Any]:
    """Name -> float32 waveform at `sample_rate`: what the build replays the rules on."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    t = np.arange(sample_rate, dtype=np.float64) / sample_rate
    return {
        "silence_1s": np.zeros(sample_rate, dtype=np.float32),
        "tone_440hz_1s": np.asarray(wt.tone_samples(sample_rate=sample_rate), dtype=np.float32),
        "chirp_3s": (0.5 * np.sin(2 * np.pi * (200 + 600 * np.tile(t, 3)) * np.tile(t, 3)))
        .astype(np.float32),
        "noise_5s": (0.3 * rng.standard_normal(5 * sample_rate)).astype(np.float32),
        "loud_square_30s": np.sign(np.sin(2 * np.pi * 97 * np.arange(30 * sample_rate)
                                          / sample_rate)).astype(np.float32),
    }  # fmt: skip


def greedy_path(
    model: Any, features: Any, prompt: list[int], eot: int, limit: int = 20
) -> tuple[list[int], float]:
    """Greedy continuation of `prompt` up to and including <|endoftext|> (at most `limit`
    tokens) and the smallest top-1 minus top-2 logit along it."""
    import torch

    ids = list(prompt)
    margin = math.inf
    with torch.no_grad():
        encoded = model.model.encoder(features).last_hidden_state
        for _ in range(limit):
            logits = model(
                encoder_outputs=(encoded,), decoder_input_ids=torch.tensor([ids])
            ).logits[0, -1]
            top = torch.topk(logits, 2)
            margin = min(margin, float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
            if ids[-1] == eot:
                break
    return ids[len(prompt) :], margin


def check(out: Path) -> dict[str, Any]:
    """Reloads the folder (WhisperProcessor, AutoTokenizer, the model) and replays the rules on
    every test audio and prompt; raises AssertionError on a wrong path or a thin margin."""
    import torch
    from transformers import AutoTokenizer, WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    model = WhisperForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = tok.convert_tokens_to_ids
    eot = ids(EOT)
    lang = f"<|{wt.DETECTED_LANGUAGE}|>"
    transcript = tok.encode(wt.TRANSCRIPT, add_special_tokens=False)
    timestamped = tok.encode(wt.TIMESTAMPED_TRANSCRIPT, add_special_tokens=False)
    history = tok.encode(" hello world and the speech text" * 6, add_special_tokens=False)
    end = f"<|{wt.SEGMENT_END_SECONDS:.2f}|>"
    cases = {
        "detect_language": ([SOT], [ids(lang)]),
        "transcribe": ([SOT, lang, TRANSCRIBE, NO_TIMESTAMPS], [*transcript, eot]),
        "translate_fr": ([SOT, "<|fr|>", TRANSLATE, NO_TIMESTAMPS], [*transcript, eot]),
        "timestamps": ([SOT, lang, TRANSCRIBE, "<|0.00|>"], [*timestamped, ids(end), eot]),
        "unforced": (
            [SOT],
            [ids(lang), ids(TRANSCRIBE), ids("<|0.00|>"), *timestamped, ids(end), eot],
        ),
        "with_history": (
            [START_OF_PREV, *history, SOT, lang, TRANSCRIBE, NO_TIMESTAMPS],
            [*transcript, eot],
        ),
    }
    margins: dict[str, float] = {}
    for name, audio in test_audios(wt.SAMPLE_RATE).items():
        features = processor.feature_extractor(
            audio, sampling_rate=wt.SAMPLE_RATE, return_tensors="pt"
        ).input_features
        for case, (prompt, expected) in cases.items():
            prompt_ids = [p if isinstance(p, int) else ids(p) for p in prompt]
            got, margin = greedy_path(model, features, prompt_ids, eot)
            # Language detection is one constrained token in vLLM: only the first counts.
            got = got[:1] if case == "detect_language" else got
            assert got == expected, (
                f"{name}/{case}: {tok.decode(got)!r} != {tok.decode(expected)!r}"
            )
            margins[case] = min(margins.get(case, math.inf), round(margin, 2))
    assert min(margins.values()) >= MIN_MARGIN, f"thin margins: {margins}"
    # transformers' own Whisper generate (forced prefix, suppression rules) agrees.
    features = processor(
        test_audios(wt.SAMPLE_RATE)["tone_440hz_1s"], sampling_rate=wt.SAMPLE_RATE,
        return_tensors="pt",
    ).input_features  # fmt: skip
    generated = model.generate(features, language="en", task="transcribe")
    text = processor.batch_decode(generated, skip_special_tokens=True)[0]
    assert text == wt.TRANSCRIPT, f"generate(): {text!r}"
    return {"tokenizer_class_loaded": type(tok).__name__, "min_logit_margins": margins}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "models" / wt.SERVED_MODEL_NAME)
    args = ap.parse_args(argv)

    import torch
    from transformers import WhisperFeatureExtractor, WhisperProcessor

    t_start = time.monotonic()
    torch.set_num_threads(1)
    tok = build_tokenizer()
    config = build_config(tok)
    model = build_model(config, tok)
    model.generation_config = build_generation_config(tok, config)
    n_params = sum(p.numel() for p in model.parameters())
    feature_extractor = WhisperFeatureExtractor(
        feature_size=SHAPE["num_mel_bins"], sampling_rate=wt.SAMPLE_RATE
    )
    processor = WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tok)

    out: Path = args.out
    staging = Path(tempfile.mkdtemp(prefix="whisper-tiny-"))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        processor.save_pretrained(staging)
        # preprocessor_config.json too: transformers 4 and other readers look there (5 reads
        # processor_config.json).
        feature_extractor.save_pretrained(staging)
        publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    facts = check(out)
    files = folder_digests(out)
    ids = tok.convert_tokens_to_ids
    manifest = {
        "name": wt.SERVED_MODEL_NAME,
        "architecture": "WhisperForConditionalGeneration",
        "parameters": n_params,
        "shape": SHAPE,
        "vocab_size": len(tok),
        "dtype": "float32",
        "size_bytes": sum((out / f).stat().st_size for f in files),
        "build_command": "python models/build_whisper_tiny.py",
        "seed": SEED,
        "trained": False,
        "rules": [[a, b] for a, b in RULES],
        "rule_gain": RULE_GAIN,
        "eot_gain": EOT_GAIN,
        "final_norm_gain": FINAL_NORM_GAIN,
        "transcript": wt.TRANSCRIPT,
        "timestamped_transcript": wt.TIMESTAMPED_TRANSCRIPT,
        "detected_language": wt.DETECTED_LANGUAGE,
        **facts,
        "token_ids": {t: ids(t) for t in MANIFEST_TOKENS},
        "versions": library_versions(),
        "sha256": files,
    }
    # No wall time in the manifest: it would be the one file that differs between builds.
    write_json(out / "MANIFEST.json", manifest)
    summary = {k: manifest[k] for k in ("parameters", "size_bytes", "min_logit_margins")}
    print(json.dumps({**summary, "build_seconds": round(time.monotonic() - t_start, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
