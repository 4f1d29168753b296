"""Build the Qwen3-format fixture chat model ``qwen3-tiny`` into ``models/qwen3-tiny/``.

    python models/build_qwen3_tiny.py [--out DIR]

A random-initialised (seed 1234) ``Qwen3ForCausalLM`` — hidden 64, 2 layers, 2 query heads and
1 KV head of size 32 (the smallest head size vLLM's CPU attention has a kernel for,
vllm/v1/attention/backends/cpu_attn.py `get_supported_head_sizes`), FFN 128, tied embeddings,
fp32 — with a byte-level BPE tokenizer built here (no training, nothing downloaded): the 256
byte symbols, the left-to-right merges that spell each word of ``WORDS`` (with and without a
leading space) and Qwen3's added tokens as single tokens, in Qwen3's order: ``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>`` (special: dropped by ``skip_special_tokens``), then
``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>``,
``</think>`` (not special: they survive ``skip_special_tokens``, as in Qwen3's tokenizer).
``config.json`` says ``qwen3``, so transformers loads the tokenizer as ``Qwen2Tokenizer``
(NFC, Qwen2's split regex, ByteLevel), which is the class built here.

The chat template is Qwen3's (Qwen/Qwen3-8B ``tokenizer_config.json``, the hybrid-thinking
release): ChatML turns; tools declared in the system turn as ``<tools>`` JSON lines with the
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` instruction; assistant calls
rendered that way (string arguments verbatim, objects through ``tojson``); tool results as
``<tool_response>`` blocks in a user turn; reasoning kept after the last user query only;
``enable_thinking=false`` closes an empty ``<think>`` block in the generation prompt.

Nothing is trained: the model writes random tokens. It exists so that a second chat format
runs through the real engine (rendering, routing, parsing, the stream contract), not to answer.

Deterministic: the same bytes on every run with the same torch/transformers versions (checked by
building twice); ``MANIFEST.json`` records every file's sha256, the shape and the versions.
"""

from __future__ import annotations

import argparse
import itertools
import json
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

from inferplane.fixtures import qwen3_tiny as qt  # noqa: E402

SEED = 1234
SHAPE = {
    "hidden": 64,
    "layers": 2,
    "heads": 2,
    "kv_heads": 1,
    "head_dim": 32,
    "intermediate": 128,
    "max_positions": qt.MAX_POSITIONS,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = [
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip
# Words of the template's tool instructions, of JSON schemas and of the test prompts, so that a
# rendered tools prompt is a few hundred tokens rather than one per byte.
_WORDS_TEXT = """
Tools You may call one or more functions to assist with the user query are provided function
signatures within XML tags tools For each return a json object name and arguments args
assistant system tool type description parameters properties required string integer number
boolean array items enum object minimum maximum city unit celsius fahrenheit weather get time
local current in the of is what it for hello hi how are you today please answer question
Paris Tokyo Oslo London search query results web convert currency amount from to"""
WORDS = list(dict.fromkeys(_WORDS_TEXT.split()))
# Runs of punctuation the template and JSON produce (one pre-token each under Qwen2's regex).
PUNCTUATION = ['{"', '":', '",', '"}', "}}", '": "', "</", "\n\n"]

CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string \
and not(message.content.startswith('<tool_response>') \
and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + \
reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def bpe_pieces(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """BPE as the `tokenizers` model applies it: merge the adjacent pair of lowest rank until
    no pair has one."""
    pieces = list(symbols)
    while len(pieces) > 1:
        pairs = [(ranks.get(p, -1), i) for i, p in enumerate(itertools.pairwise(pieces))]
        ranked = [(r, i) for r, i in pairs if r >= 0]
        if not ranked:
            break
        _, i = min(ranked)
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The 256 byte symbols, then, for each word of WORDS (bare, then after a space, "Ġ") and
    each run of PUNCTUATION in turn, the merges that join what the earlier merges make of it,
    left to right: new merges rank after all earlier ones, so each spelling ends as one token
    whatever the words before it merged. Ids in that order."""
    symbol = bytes_to_unicode()
    vocab = {ch: i for i, ch in enumerate(symbol.values())}
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    spellings = [w for word in WORDS for w in (word, " " + word)] + PUNCTUATION
    for text in spellings:
        pieces = bpe_pieces([symbol[b] for b in text.encode()], ranks)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            pieces[:2] = [pair[0] + pair[1]]
            vocab.setdefault(pieces[0], len(vocab))
    return vocab, merges


def build_tokenizer() -> Any:
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = bpe_vocab_and_merges()
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        # Set below, once the added tokens have their ids in Qwen3's order.
        eos_token=None,
        pad_token=None,
        model_max_length=qt.MAX_POSITIONS,
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids([*SPECIAL_TOKENS, *ADDED_TOKENS])
    first = len(vocab)
    assert ids == list(range(first, first + len(ids))), f"added tokens out of order: {ids}"
    return tok


def build_model(tok: Any, shape: dict[str, int]) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_positions"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(SEED)
    return Qwen3ForCausalLM(config).eval()


def build_generation_config(tok: Any) -> Any:
    """Qwen3's: generation ends at ``<|im_end|>`` or ``<|endoftext|>`` (vLLM merges these ids
    with the tokenizer's eos, as the replica does)."""
    from transformers import GenerationConfig

    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=endoftext)


def check(out: Path, tok: Any) -> dict[str, Any]:
    """Reloads the folder as vLLM and the replica do (AutoTokenizer, AutoModelForCausalLM) and
    checks: the same vocabulary; every Qwen3 marker and every word of WORDS (bare and after a
    space) one token; sample texts round-trip; a tools
    conversation rendered by ``inferplane.chat`` (Qwen3 family) encodes its markers as single
    tokens and fits the context; one forward pass has the vocabulary's logits. Returns facts for
    the manifest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inferplane.chat import QWEN3, render_chat

    loaded = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert loaded.get_vocab() == tok.get_vocab(), "reloaded vocabulary differs"
    for marker in [*SPECIAL_TOKENS, *ADDED_TOKENS]:
        ids = loaded.encode(marker, add_special_tokens=False)
        assert len(ids) == 1, f"{marker} is {ids}, not one token"
    for word in WORDS:
        for text in (word, " " + word):
            ids = loaded.encode(text, add_special_tokens=False)
            assert len(ids) == 1, f"{text!r} is {loaded.convert_ids_to_tokens(ids)}"
    for text in qt.SAMPLE_TEXTS:
        ids = loaded.encode(text, add_special_tokens=False)
        assert loaded.decode(ids) == text, f"{text!r} does not round-trip"
    prompt = render_chat(qt.tools_request(), loaded, family=QWEN3)
    # The history call's arguments are the client's text, verbatim (inferplane.chat: QWEN3).
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}'
    assert call in prompt.text and "<tool_response>\n18 celsius\n</tool_response>" in prompt.text
    assert len(prompt.token_ids) < qt.MAX_MODEL_LEN // 2, len(prompt.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt.token_ids])).logits
    assert logits.shape == (1, len(prompt.token_ids), len(loaded))
    return {
        "tokenizer_class_loaded": type(loaded).__name__,
        "tools_prompt_tokens": len(prompt.token_ids),
        "sample_token_counts": {
            t: len(loaded.encode(t, add_special_tokens=False)) for t in qt.SAMPLE_TEXTS
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "models" / qt.SERVED_MODEL_NAME)
    args = ap.parse_args(argv)

    import torch

    t_start = time.monotonic()
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, SHAPE)
    n_params = sum(p.numel() for p in model.parameters())

    out: Path = args.out
    staging = Path(tempfile.mkdtemp(prefix="qwen3-tiny-"))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        build_generation_config(tokenizer).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    facts = check(out, tokenizer)
    files = folder_digests(out)
    manifest = {
        "name": qt.SERVED_MODEL_NAME,
        "architecture": "Qwen3ForCausalLM",
        "parameters": n_params,
        "shape": SHAPE,
        "vocab_size": len(tokenizer),
        "dtype": "float32",
        "chat_template": "Qwen3 (Qwen/Qwen3-8B), hybrid thinking: enable_thinking",
        "size_bytes": sum((out / f).stat().st_size for f in files),
        "build_command": "python models/build_qwen3_tiny.py",
        "seed": SEED,
        "trained": False,
        **facts,
        "versions": library_versions(),
        "sha256": files,
    }
    # No wall time in the manifest: it would be the one file that differs between builds.
    write_json(out / "MANIFEST.json", manifest)
    summary = {k: manifest[k] for k in ("parameters", "size_bytes", "vocab_size")}
    print(json.dumps({**summary, "build_seconds": round(time.monotonic() - t_start, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
