"""Builds the Kimi-sized tokenizer the grammar benchmarks use: a byte-level BPE of 163,840
tokens trained with `tokenizers` on ~60 MB of this venv's Python sources, plus Kimi K2's chat
special tokens (special) and its think and tool markers (not special, as in Kimi's own
tokenizer; docs/kimi.md). Kimi's tokenizer is not on this machine; what a grammar costs depends
on the vocabulary's size and texts, which this matches in size and kind.

    .venv/bin/python bench/kimi_sized_tokenizer.py OUT_DIR [--megabytes 60]

Writes OUT_DIR/tokenizer.json (deterministic for a given venv: files in sorted order). About
30 s on the 2-core box. Pass OUT_DIR/tokenizer.json to `bench/tool_call_validity.py
--tokenizer` or `bench/structured_output_validity.py --tokenizer`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SPECIAL = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
)
MARKERS = (
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
VOCAB_SIZE = 163_840


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--megabytes", type=float, default=60.0)
    args = parser.parse_args()
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    files, total = [], 0
    for path in sorted((site / "site-packages").rglob("*.py")):
        files.append(str(path))
        total += path.stat().st_size
        if total > args.megabytes * 1e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL) - len(MARKERS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    started = time.perf_counter()
    tok.train(files, trainer)
    tok.add_special_tokens(list(SPECIAL))
    tok.add_tokens(list(MARKERS))
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    print(
        f"{args.out / 'tokenizer.json'}: {tok.get_vocab_size()} tokens from {len(files)} files "
        f"({total / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
