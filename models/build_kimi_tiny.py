"""Build and train the fixture model ``kimi-tiny`` (issue 3 §6) into ``models/kimi-tiny/``.

    PYTHONPATH=libs python models/build_kimi_tiny.py

One deterministic script (fixed seeds, fixed step count, 2 torch threads): it generates synthetic
Kimi-K2.5-format chats, trains a byte-level BPE tokenizer on their text, builds a tiny
``Qwen2ForCausalLM`` (hidden 128, 2 layers, 4 heads / 2 KV heads, vocab 2048, tied embeddings),
trains it with the loss on assistant tokens only, checks greedy decoding on held-out prompts and
on the canonical prompts of ``inferplane.fixtures.kimi_tiny``, and writes the folder with a
``MANIFEST.json``. Nothing is downloaded. Results, timings, rebuild command: models/README.md.

Token roles follow Kimi K2.5 (docs/kimi.md, with its public sources): ``<|im_end|>`` (eos), the role
tokens and pad are special tokens; ``<think>``, ``</think>`` and the five tool-call markers are
plain added tokens, so they survive ``decode(..., skip_special_tokens=True)`` as in real Kimi.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from inferplane.fixtures import kimi_tiny as kt  # noqa: E402

SEED = 1234
THREADS = 2

PAD = "<|endoftext|>"
EOS = "<|im_end|>"
ROLE_TOKENS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
SPECIAL_TOKENS = [PAD, EOS, *ROLE_TOKENS]
THINK_BEGIN, THINK_END = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = kt.SECTION_BEGIN, kt.SECTION_END
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = kt.CALL_BEGIN, kt.ARGUMENT_BEGIN, kt.CALL_END
PLAIN_MARKERS = [
    THINK_BEGIN,
    THINK_END,
    SECTION_BEGIN,
    SECTION_END,
    CALL_BEGIN,
    ARGUMENT_BEGIN,
    CALL_END,
]
BPE_VOCAB = 2000
MODEL_VOCAB = 2048
# Model shape and training defaults (the committed model's; MANIFEST.json records them).
SHAPE = {"layers": 2, "hidden": 128, "intermediate": 512, "heads": 4, "kv_heads": 2}
DEFAULTS: dict[str, Any] = {
    "steps": 3000,
    "batch_size": 16,
    "lr": 4e-3,
    "easy_fraction": 0.35,
    "value_weight": 3.0,
    "train_samples": 12000,
    "canonical_repeats": 40,
}

# K2.5-like template. Mirrors Kimi's: tools declared first in a system turn (normalised to
# name/description/parameters, compact JSON), tool results as "## Return of {id}", assistant
# history with <think></think> before the last user turn and <think>{reasoning}</think> after it
# (the current tool loop), tool-call ids rendered verbatim, generation prompt opening <think>.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is not none -%}
{%- for part in content -%}
{%- if part is string -%}{{ part }}{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set thinking = thinking if thinking is defined else true -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>[
{%- for tool in tools -%}
{%- set fn = tool.function if tool.function is defined else tool -%}
{"name":{{ fn.name | tojson }}
{%- if fn.description is defined and fn.description is not none -%}
,"description":{{ fn.description | tojson }}
{%- endif -%}
{%- if fn.parameters is defined and fn.parameters is not none -%}
,"parameters":{{ fn.parameters | tojson(separators=(',', ':')) }}
{%- endif -%}
}{%- if not loop.last -%},{%- endif -%}
{%- endfor -%}
]<|im_end|>
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
<|im_user|>user<|im_middle|>{{ render_content(m.content) }}<|im_end|>
{%- elif m.role == 'system' -%}
<|im_system|>system<|im_middle|>{{ render_content(m.content) }}<|im_end|>
{%- elif m.role == 'tool' -%}
<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ render_content(m.content) }}<|im_end|>
{%- elif m.role == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|>
{%- if thinking and loop.index0 > ns.last_user -%}
<think>{{ m.reasoning_content or '' }}</think>
{%- else -%}
<think></think>
{%- endif -%}
{{ render_content(m.content) }}
{%- if m.tool_calls -%}
<|tool_calls_section_begin|>
{%- for tc in m.tool_calls -%}
<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>
{%- if tc.function.arguments is string -%}{{ tc.function.arguments }}
{%- else -%}{{ tc.function.arguments | tojson }}{%- endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- else -%}
{{ raise_exception('unknown role: ' ~ m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>{%- if thinking -%}<think>{%- else -%}<think></think>{%- endif -%}
{%- endif -%}
"""  # noqa: E501

# ---------------------------------------------------------------------------------------------
# Synthetic chats
# ---------------------------------------------------------------------------------------------

# Small value pools: every value must be seen often enough for the model to learn to copy it.
CITIES = ["Tokyo", "Paris", "Oslo", "Lima", "Cairo", "Berlin", "Sydney", "Madrid", "Seoul", "Rome"]
TOPICS = [
    "rust async runtimes",
    "pasta recipes",
    "solar panels",
    "jazz history",
    "python packaging",
    "chess openings",
    "bird songs",
    "vintage cameras",
]
NAMES = ["Ana", "Bo", "Cy", "Dee", "Eli", "Fay"]
TITLES = ["team sync", "lunch", "design review", "book club", "yoga class"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy"]
FILES = ["main.py", "README.md", "setup.cfg", "data.csv", "notes.txt", "app.js"]
AMOUNTS = [5, 12.5, 40, 99.99, 300, 7.25, 18, 2000]
SYSTEM_PROMPT = "You are a helpful assistant."
URGENT = "URGENT "
FOLLOWUP_REASONING = "I have the results. I will answer."


def dumps(value: Any) -> str:
    """JSON as Kimi writes arguments: default separators, unicode kept."""
    return json.dumps(value, ensure_ascii=False)


def join_names(names: Sequence[str]) -> str:
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " and " + names[-1]


@dataclass(frozen=True)
class Call:
    """One tool call of a turn: what the user asked, the arguments, the tool's result."""

    name: str
    args: dict[str, Any]
    result: dict[str, Any]

    @property
    def question(self) -> str:
        a = self.args
        if self.name == "get_weather":
            suffix = " in fahrenheit" if a["unit"] == "fahrenheit" else ""
            return f"What is the weather in {a['city']}{suffix}?"
        if self.name == "get_time":
            return f"What time is it in {a['city']}?"
        if self.name == "web_search":
            if a["max_results"] == 3:
                return f"Search the web for {a['query']}."
            return f"Search the web for {a['query']}, {a['max_results']} results."
        if self.name == "convert_currency":
            return f"Convert {dumps(a['amount'])} {a['from']} to {a['to']}."
        if self.name == "create_event":
            s = a["start"]
            who = join_names(a["attendees"])
            return f"Schedule {a['title']} on {s['date']} at {s['time']} with {who}."
        if self.name == "list_files":
            return "List the files in the workspace."
        raise ValueError(self.name)

    @property
    def answer(self) -> str:
        a, r = self.args, self.result
        if self.name == "get_weather":
            return f"It is {r['temperature']} degrees and {r['condition']} in {a['city']}."
        if self.name == "get_time":
            return f"It is {r['time']} in {a['city']}."
        if self.name == "web_search":
            return f"I found {r['count']} results about {a['query']}."
        if self.name == "convert_currency":
            return f"{dumps(a['amount'])} {a['from']} is {dumps(r['result'])} {a['to']}."
        if self.name == "create_event":
            return f"I created {a['title']} on {a['start']['date']}."
        if self.name == "list_files":
            return f"The workspace has {', '.join(r['files'])}."
        raise ValueError(self.name)


# Parsers of the question phrasings back into arguments: used to check the canonical prompts.
QUESTION_PATTERNS: list[tuple[str, Callable[[re.Match[str]], dict[str, Any]]]] = [
    (
        r"What is the weather in (?P<c>[A-Z][a-z]+)( in fahrenheit)?\?",
        lambda m: {"city": m["c"], "unit": "fahrenheit" if m[2] else "celsius"},
    ),
    (r"What time is it in (?P<c>[A-Z][a-z]+)\?", lambda m: {"city": m["c"]}),
    (
        r"Search the web for (?P<q>[a-z ]+?)(, (?P<k>\d+) results)?\.",
        lambda m: {"query": m["q"], "max_results": int(m["k"] or 3)},
    ),
    (
        r"Convert (?P<a>[\d.]+) (?P<f>[A-Z]{3}) to (?P<t>[A-Z]{3})\.",
        lambda m: {"amount": json.loads(m["a"]), "from": m["f"], "to": m["t"]},
    ),
    (
        r"Schedule (?P<t>[a-z ]+) on (?P<d>[\d-]+) at (?P<h>[\d:]+) with (?P<w>[A-Za-z, ]+)\.",
        lambda m: {
            "title": m["t"],
            "start": {"date": m["d"], "time": m["h"]},
            "attendees": re.split(r", | and ", m["w"]),
        },
    ),
    (r"List the files in the workspace\.", lambda m: {}),
]
TOOL_OF_PATTERN = [
    "get_weather",
    "get_time",
    "web_search",
    "convert_currency",
    "create_event",
    "list_files",
]


def parse_questions(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Split a user message of training phrasings into (tool, args); ValueError if off-template."""
    out: list[tuple[str, dict[str, Any]]] = []
    rest = text
    while rest:
        for (pattern, fn), name in zip(QUESTION_PATTERNS, TOOL_OF_PATTERN, strict=True):
            m = re.match(pattern + r"( |$)", rest)
            if m:
                out.append((name, fn(m)))
                rest = rest[m.end() :]
                break
        else:
            raise ValueError(f"off-template user message: {text!r}")
    return out


class Generator:
    """Random chats in the training templates; one instance per seed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def call(self, name: str | None = None) -> Call:
        r = self.rng
        name = name or r.choices(TOOL_OF_PATTERN, weights=[3, 3, 3, 2, 2, 1])[0]
        if name == "get_weather":
            unit = "fahrenheit" if r.random() < 0.3 else "celsius"
            temp = r.randint(20, 95) if unit == "fahrenheit" else r.randint(-5, 35)
            return Call(
                name,
                {"city": r.choice(CITIES), "unit": unit},
                {"temperature": temp, "condition": r.choice(CONDITIONS)},
            )
        if name == "get_time":
            return Call(
                name,
                {"city": r.choice(CITIES)},
                {"time": f"{r.randint(0, 23):02d}:{r.choice(range(0, 60, 5)):02d}"},
            )
        if name == "web_search":
            k = 3 if r.random() < 0.6 else r.randint(1, 10)
            return Call(
                name, {"query": r.choice(TOPICS), "max_results": k}, {"count": r.randint(0, k)}
            )
        if name == "convert_currency":
            src, dst = r.sample(kt.CURRENCIES, 2)
            amount = r.choice(AMOUNTS)
            return Call(
                name,
                {"amount": amount, "from": src, "to": dst},
                {"result": round(amount * r.uniform(0.2, 3.0), 2)},
            )
        if name == "create_event":
            start = {
                "date": f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
                "time": f"{r.randint(7, 19):02d}:{r.choice((0, 15, 30, 45)):02d}",
            }
            return Call(
                name,
                {
                    "title": r.choice(TITLES),
                    "start": start,
                    "attendees": r.sample(NAMES, r.randint(1, 3)),
                },
                {"status": "created", "id": f"evt_{r.randint(1, 99)}"},
            )
        if name == "list_files":
            return Call(name, {}, {"files": r.sample(FILES, r.randint(1, 3))})
        raise ValueError(name)

    def calls(self, max_calls: int = 3) -> list[Call]:
        k = self.rng.choices([1, 2, 3][:max_calls], weights=[5, 3, 2][:max_calls])[0]
        out: list[Call] = []
        while len(out) < k:
            c = self.call()
            if all(c.question != o.question for o in out):
                out.append(c)
        return out

    def tools_for(self, needed: Sequence[str], *, extra_max: int = 1) -> list[str]:
        names = list(dict.fromkeys(needed))
        others = [n for n in TOOL_OF_PATTERN if n not in names]
        names += self.rng.sample(others, self.rng.randint(0, min(extra_max, len(others))))
        self.rng.shuffle(names)
        return names

    def no_tool_turn(self) -> tuple[str, str, str]:
        """(user text, reasoning, content) for a question that needs no tool."""
        if self.rng.random() < 0.6:
            topic = self.rng.choice(TOPICS + CITIES)
            return (
                f"Tell me something about {topic}.",
                f"The user wants text about {topic}. No tool is needed.",
                f"Here is a short note about {topic}. I hope it helps.",
            )
        name = self.rng.choice(NAMES)
        return (
            f"Say hello to {name}.",
            "The user wants a greeting. No tool is needed.",
            f"Hello, {name}! Nice to meet you.",
        )


def text_output(reasoning: str, content: str, thinking: bool) -> str:
    return (reasoning + THINK_END + content) if thinking else content


def call_reasoning(calls: Sequence[Call], urgent: bool) -> str:
    names = ", ".join(c.name for c in calls)
    if urgent:
        return f"Urgent. Call {names} now."
    return f"The user needs {names}. I will call {'it' if len(calls) == 1 else 'them'}."


def section(calls: Sequence[Call], first_n: int) -> str:
    body = "".join(
        f"{CALL_BEGIN}functions.{c.name}:{first_n + i}{ARGUMENT_BEGIN}{dumps(c.args)}{CALL_END}"
        for i, c in enumerate(calls)
    )
    return SECTION_BEGIN + body + SECTION_END


def calls_output(calls: Sequence[Call], first_n: int, thinking: bool, urgent: bool) -> str:
    """The completion after the generation prompt for a turn that calls tools."""
    if not thinking:
        return section(calls, first_n)
    reasoning = call_reasoning(calls, urgent)
    # URGENT: the model skips </think> and goes straight to the section, as Kimi K2 does
    # (docs/kimi.md, "Output format": vLLM PR #32216).
    return reasoning + ("" if urgent else THINK_END) + section(calls, first_n)


def followup_output(calls: Sequence[Call], thinking: bool) -> str:
    answer = " ".join(c.answer for c in calls)
    return (FOLLOWUP_REASONING + THINK_END + answer) if thinking else answer


def assistant_call_message(
    calls: Sequence[Call], first_n: int, thinking: bool, urgent: bool
) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"functions.{c.name}:{first_n + i}",
                "type": "function",
                "function": {"name": c.name, "arguments": dumps(c.args)},
            }
            for i, c in enumerate(calls)
        ],
    }
    if thinking:
        msg["reasoning_content"] = call_reasoning(calls, urgent)
    return msg


def tool_messages(calls: Sequence[Call], first_n: int) -> list[dict[str, Any]]:
    return [
        {
            "role": "tool",
            "tool_call_id": f"functions.{c.name}:{first_n + i}",
            "content": dumps(c.result),
        }
        for i, c in enumerate(calls)
    ]


@dataclass(frozen=True)
class Sample:
    """One training or evaluation example: a prompt and the completion to learn."""

    kind: str
    messages: list[dict[str, Any]]
    tool_names: list[str]
    thinking: bool
    output: str  # after the generation prompt, without the final <|im_end|>

    def request(self) -> dict[str, Any]:
        """The OpenAI chat request the platform would render for this sample."""
        req: dict[str, Any] = {
            "model": kt.SERVED_MODEL_NAME,
            "messages": self.messages,
            "chat_template_kwargs": {"thinking": self.thinking},
        }
        if self.tool_names:
            req["tools"] = kt.tools(*self.tool_names)
        return req


KINDS = {"call": 30, "urgent": 12, "call_off": 8, "no_tool": 14, "followup": 20, "second": 16}


def sample(gen: Generator, kind: str, *, easy: bool = False) -> Sample:
    """One chat of ``kind``; ``easy`` (the curriculum's first stage): one call, only the needed
    tool declared, no system prompt."""
    r = gen.rng
    thinking = kind in ("call", "urgent") or (kind != "call_off" and r.random() < 0.75)
    messages: list[dict[str, Any]] = []
    if r.random() < 0.2 and not easy:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    if kind == "no_tool":
        user, reasoning, content = gen.no_tool_turn()
        messages.append({"role": "user", "content": user})
        tool_names = gen.tools_for([], extra_max=2) if r.random() < 0.6 and not easy else []
        return Sample(
            kind, messages, tool_names, thinking, text_output(reasoning, content, thinking)
        )
    if kind in ("call", "urgent", "call_off"):
        calls = gen.calls(1 if easy else 3)
        urgent = kind == "urgent" or (kind == "call_off" and r.random() < 0.3)
        text = " ".join(c.question for c in calls)
        messages.append({"role": "user", "content": (URGENT + text) if urgent else text})
        names = [c.name for c in calls]
        return Sample(
            kind,
            messages,
            names if easy else gen.tools_for(names),
            thinking,
            calls_output(calls, 0, thinking, urgent),
        )
    # "followup" answers the results of a tool loop; "second" asks a new question after a
    # finished first turn (tool loop or plain answer), so its call ids continue the numbering.
    first: list[Call] = []
    if kind == "followup" or r.random() < 0.75:
        first = gen.calls()
        urgent = r.random() < 0.2
        text = " ".join(c.question for c in first)
        messages.append({"role": "user", "content": (URGENT + text) if urgent else text})
        messages.append(assistant_call_message(first, 0, thinking, urgent))
        messages += tool_messages(first, 0)
        if kind == "followup":
            return Sample(
                kind,
                messages,
                gen.tools_for([c.name for c in first]),
                thinking,
                followup_output(first, thinking),
            )
        answer = {
            "role": "assistant",
            "content": " ".join(c.answer for c in first),
            "reasoning_content": FOLLOWUP_REASONING,
        }
    else:
        user, reasoning, content = gen.no_tool_turn()
        messages.append({"role": "user", "content": user})
        answer = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if not thinking:
        del answer["reasoning_content"]
    messages.append(answer)
    names = [c.name for c in first]
    if r.random() < 0.15:
        user, reasoning, content = gen.no_tool_turn()
        messages.append({"role": "user", "content": user})
        return Sample(
            kind,
            messages,
            gen.tools_for(names),
            thinking,
            text_output(reasoning, content, thinking),
        )
    calls = gen.calls()
    urgent = thinking and r.random() < 0.2
    text = " ".join(c.question for c in calls)
    messages.append({"role": "user", "content": (URGENT + text) if urgent else text})
    names += [c.name for c in calls]
    return Sample(
        kind,
        messages,
        gen.tools_for(names, extra_max=1),
        thinking,
        calls_output(calls, len(first), thinking, urgent),
    )


def samples(seed: int, n: int) -> list[Sample]:
    gen = Generator(seed)
    kinds = list(KINDS)
    weights = list(KINDS.values())
    return [sample(gen, gen.rng.choices(kinds, weights=weights)[0]) for _ in range(n)]


def easy_samples(seed: int, n: int) -> list[Sample]:
    """Curriculum stage 1: short single-call and no-tool chats. Copying a value from the
    question into the arguments is what a 2-layer model learns last; it forms much faster on
    short prompts and then carries over to the full mix."""
    gen = Generator(seed)
    kinds = ["call", "urgent", "call_off", "no_tool"]
    return [
        sample(gen, gen.rng.choices(kinds, weights=[5, 2, 2, 2])[0], easy=True) for _ in range(n)
    ]


def canonical_samples() -> list[Sample]:
    """The canonical cases of inferplane.fixtures.kimi_tiny, checked against this generator.

    Raises:
        AssertionError: a case's phrasing or output differs from what the templates produce.
    """
    out = []
    for case in kt.CASES:
        msgs = [dict(m) for m in case.messages]
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        user = msgs[last_user]["content"]
        urgent = user.startswith(URGENT)
        if msgs[-1]["role"] == "tool":  # follow-up after tool results
            calls = [
                Call(
                    tc["function"]["name"],
                    json.loads(tc["function"]["arguments"]),
                    json.loads(t["content"]),
                )
                for tc, t in zip(
                    msgs[last_user + 1]["tool_calls"], msgs[last_user + 2 :], strict=True
                )
            ]
            expected = followup_output(calls, case.thinking)
        elif user.startswith(("Tell me something about ", "Say hello to ")):
            gen = Generator(0)
            expected = ""
            for _ in range(500):  # find the phrasing among the generator's no-tool turns
                u, reasoning, content = gen.no_tool_turn()
                if u == user:
                    expected = text_output(reasoning, content, case.thinking)
                    break
        else:
            parsed = parse_questions(user.removeprefix(URGENT))
            calls = [Call(name, args, {}) for name, args in parsed]
            assert " ".join(c.question for c in calls) == user.removeprefix(URGENT), user
            n0 = sum(len(m.get("tool_calls") or []) for m in msgs[:last_user])
            expected = calls_output(calls, n0, case.thinking, urgent)
        assert expected == case.output, f"{case.name}: {expected!r} != {case.output!r}"
        out.append(
            Sample(
                "canonical:" + case.name, msgs, list(case.tool_names), case.thinking, case.output
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

MARKER_RE = re.compile(r"<\|[a-z_]+\|>|</?think>")


def build_tokenizer(corpus: list[str], *, space_merges: bool = True) -> Any:
    """Train the byte-level BPE with exactly the pipeline ``AutoTokenizer`` will run on it.

    config.json says ``qwen2``, so transformers 5 loads the folder as ``Qwen2Tokenizer``, which
    takes only the vocab, merges and added tokens from tokenizer.json and rebuilds the rest
    (NFC, Qwen2's split regex, ByteLevel without its own regex, ByteLevel decoder). Training with
    that same pipeline keeps served prompts tokenized like the training data; ``main`` reloads
    the saved folder and asserts it.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    qwen2_split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    # Without space merges (an experiment, off by default: it did not help the 2-layer model in
    # 1000-2400 steps), whitespace is cut off every piece while the merges are learned, so no
    # merge joins a space to a word and " Tokyo" in a question and "Tokyo" in the arguments
    # share the "Tokyo" token. Encoding with Qwen2's pipeline gives the same ids either way.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [qwen2_split, byte_level]
        if space_merges
        else [qwen2_split, pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated"), byte_level]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Markers are not in the BPE text: they are whole added tokens, never merged pieces.
    tok.train_from_iterator([MARKER_RE.sub("\n", t) for t in corpus], trainer=trainer)
    tok.pre_tokenizer = pre_tokenizers.Sequence([qwen2_split, byte_level])  # what is served
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in PLAIN_MARKERS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=kt.MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    for t in SPECIAL_TOKENS + PLAIN_MARKERS:
        ids = fast.encode(t, add_special_tokens=False)
        assert len(ids) == 1, f"{t} is not a single token: {ids}"
    probe = THINK_BEGIN + "a" + THINK_END + SECTION_BEGIN + CALL_END + EOS
    kept = fast.decode(fast.encode(probe, add_special_tokens=False), skip_special_tokens=True)
    assert kept == probe.removesuffix(EOS), f"markers must survive skip_special_tokens: {kept!r}"
    return fast


def render(tokenizer: Any, s: Sample) -> tuple[str, list[int]]:
    """(prompt text, prompt ids) as the platform serves it: ``inferplane.chat.render_chat``
    (the node-agent's renderer) through ``tokenizer``'s own chat template."""
    from inferplane.chat import render_chat

    rendered = render_chat(s.request(), tokenizer)
    return rendered.text, rendered.token_ids


# Spans of a completion that carry the request's values (copied from the question, the tool
# results or the conversation) rather than fixed template text: the loss weighs them more.
ARGS_RE = re.compile(re.escape(ARGUMENT_BEGIN) + r"(.*?)" + re.escape(CALL_END))
ARG_KEY_RE = re.compile(r'"[a-z_]+": ')
VALUE_RES = [
    re.compile(r"functions\.([a-z_]+:\d+)"),
    re.compile(r"^The user needs ([a-z_, ]+)\. I will"),
    re.compile(r"^Urgent\. Call ([a-z_, ]+) now\."),
    re.compile(re.escape(THINK_END) + r"(.+)$"),  # a text answer after the reasoning
]


def value_chars(output: str) -> list[bool]:
    """Per character of ``output``: does it belong to a value span (see VALUE_RES)?"""
    mark = [False] * len(output)

    def span(a: int, b: int) -> None:
        mark[a:b] = [True] * (b - a)

    for m in ARGS_RE.finditer(output):
        span(*m.span(1))
        for k in ARG_KEY_RE.finditer(output, m.start(1), m.end(1)):
            mark[k.start() : k.end()] = [False] * (k.end() - k.start())
    for rx in VALUE_RES:
        for m in rx.finditer(output):
            if SECTION_BEGIN not in m.group(1):
                span(*m.span(1))
    if SECTION_BEGIN not in output and THINK_END not in output:  # thinking off, text answer
        span(0, len(output))
    return mark


Encoded = list[tuple[list[int], list[int], list[float]]]


def loss_weights(
    output: str, offsets: Sequence[tuple[int, int]], value_weight: float
) -> list[float]:
    """Per target token (``offsets`` into ``output + EOS``): ``value_weight`` where the token
    overlaps a value span, else 1."""
    mark = value_chars(output)
    return [value_weight if any(mark[a:b]) else 1.0 for a, b in offsets]


# ---------------------------------------------------------------------------------------------
# Model, training, evaluation
# ---------------------------------------------------------------------------------------------


def build_config(tokenizer: Any, shape: dict[str, int]) -> Any:
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=MODEL_VOCAB,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["hidden"] // shape["heads"],
        max_position_embeddings=kt.MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        use_cache=True,
    )
    config.dtype = "float32"
    return config


def batches(data: Encoded, batch_size: int, steps: int, rng: random.Random) -> list[list[int]]:
    """Index batches, length-bucketed inside shuffled chunks to cut padding."""
    out: list[list[int]] = []
    while len(out) < steps:
        order = list(range(len(data)))
        rng.shuffle(order)
        chunk = batch_size * 16
        for i in range(0, len(order), chunk):
            part = sorted(order[i : i + chunk], key=lambda j: len(data[j][0]) + len(data[j][1]))
            group = [part[k : k + batch_size] for k in range(0, len(part), batch_size)]
            rng.shuffle(group)
            out += [g for g in group if len(g) == batch_size]
    return out[:steps]


def train(
    model: Any,
    stages: Sequence[tuple[Encoded, int]],
    *,
    batch_size: int,
    lr: float,
    pad_id: int,
    max_seconds: float,
) -> dict[str, Any]:
    """Train through ``stages`` of (encoded samples, steps) in order, one LR schedule overall."""
    import torch

    rng = random.Random(SEED)
    plan = [
        [data[i] for i in idx] for data, n in stages for idx in batches(data, batch_size, n, rng)
    ]
    steps = len(plan)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    t0 = time.monotonic()
    cpu0 = time.process_time()
    losses: list[float] = []
    done = 0
    for step, batch in enumerate(plan):
        rows = [prompt + target for prompt, target, _ in batch]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        weights = torch.zeros((len(rows), width), dtype=torch.float32)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, (prompt, target, weight) in enumerate(batch):
            n = len(prompt) + len(target)
            ids[b, :n] = torch.tensor(prompt + target)
            labels[b, len(prompt) : n] = torch.tensor(target)  # loss on assistant tokens only
            weights[b, len(prompt) : n] = torch.tensor(weight)
            mask[b, :n] = 1
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        # Logits only where a target token is predicted: the prompt needs no LM head, and the
        # 2048-way head over every position would be most of the step's cost.
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        keep = targets != -100
        logits = model.lm_head(hidden[keep])
        w = weights[:, 1:][keep]
        per_token = torch.nn.functional.cross_entropy(logits, targets[keep], reduction="none")
        loss = (per_token * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        done = step + 1
        elapsed = time.monotonic() - t0
        # The safety stop counts CPU time, not wall time: on a busy shared machine the wall
        # clock would cut training short at a load-dependent step (a different model).
        cpu = (time.process_time() - cpu0) / THREADS
        if step % 25 == 0 or done == steps:
            print(
                f"step {done}/{steps} loss {losses[-1]:.4f} lr {lr_at(step):.2e} "
                f"{elapsed:.0f}s wall {cpu:.0f}s cpu/{THREADS}",
                flush=True,
            )
        if cpu > max_seconds:
            print(
                f"WARNING: stopping at step {done}: over {max_seconds:.0f}s of CPU per thread",
                flush=True,
            )
            break
    seconds = time.monotonic() - t0
    cpu = (time.process_time() - cpu0) / THREADS
    return {
        "steps": done,
        "seconds": round(seconds, 1),
        "steps_per_second": round(done / seconds, 3),
        "cpu_seconds_per_thread": round(cpu, 1),
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 5),
    }


def _format_check(parser: Any, s: Sample, text: str) -> tuple[bool, Any, Any]:
    """(`same_format`, expected parse, generated parse)."""
    from inferplane.parsers import validate_tool_calls

    want = parser.parse(s.output, s.thinking)
    if not text.endswith(EOS):
        return False, want, None
    got = parser.parse(text[: -len(EOS)], s.thinking)
    if got.marker_leaked:
        return False, want, got
    if bool(got.reasoning) != bool(want.reasoning) or bool(got.content) != bool(want.content):
        return False, want, got
    numbers = [c.id.rsplit(":", 1)[-1] for c in want.tool_calls]
    if len(got.tool_calls) != len(numbers) or [c.id for c in got.tool_calls] != [
        f"functions.{c.name}:{n}" for c, n in zip(got.tool_calls, numbers, strict=True)
    ]:
        return False, want, got
    verdicts = validate_tool_calls(got.tool_calls, kt.tools(*s.tool_names)) if s.tool_names else []
    return all(v.valid for v in verdicts), want, got


def same_format(parser: Any, s: Sample, text: str) -> bool:
    """True when generated `text` (with its final <|im_end|>) has the training format of
    `s.output`, whatever values it copied (which city, which date, which of the asked tools
    first): it ended with <|im_end|>; parsed by the platform's Kimi parser it has reasoning and
    content exactly where the expected output has them, as many tool calls, numbered like the
    expected ones (`functions.{name}:{n}` with the call's own name), every call declared in the
    request and its arguments valid against that tool's JSON schema, and no marker leaked."""
    return _format_check(parser, s, text)[0]


def same_calls(parser: Any, s: Sample, text: str) -> bool:
    """`same_format` and the same tools called in the same order (ids and names equal)."""
    ok, want, got = _format_check(parser, s, text)
    return ok and [(c.id, c.name) for c in got.tool_calls] == [
        (c.id, c.name) for c in want.tool_calls
    ]


def evaluate(
    model: Any,
    tokenizer: Any,
    items: list[Sample],
    formats: list[bool] | None = None,
    calls: list[bool] | None = None,
) -> tuple[int, list[str]]:
    """Greedy-decode each prompt as the platform serves it (``render_chat`` through the
    reloaded AutoTokenizer); (exact matches, failure descriptions). With `formats` (and
    `calls`), appends per item whether the output has the training format (`same_format`)
    and the expected tools in order (`same_calls`)."""
    import torch

    from inferplane.parsers import build_parser

    model.eval()
    eos = tokenizer.convert_tokens_to_ids(EOS)
    parser = build_parser("kimi_k2", vocab=tokenizer.get_vocab())
    ok, failures = 0, []
    with torch.no_grad():
        for s in items:
            _, prompt = render(tokenizer, s)
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=200,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )[0, len(prompt) :].tolist()
            text = tokenizer.decode(out, skip_special_tokens=False)
            if formats is not None:
                formats.append(same_format(parser, s, text))
                if calls is not None:
                    calls.append(formats[-1] and same_calls(parser, s, text))
                if not formats[-1]:
                    failures.append(f"[{s.kind}] FORMAT expected {s.output!r}\n      got {text!r}")
            if text == s.output + EOS:
                ok += 1
            else:
                failures.append(f"[{s.kind}] expected {s.output!r}\n      got {text!r}")
    return ok, failures


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_tokenizer(
    folder: Path, trained: Any, loaded: Any, texts: list[str], ids: list[list[int]]
) -> None:
    """Assert that ``loaded`` (the folder reloaded the way vLLM and the renderer do:
    ``AutoTokenizer``) gave the trained tokenizer's ids (``ids``) on every text, and so does the
    folder's tokenizer.json read raw.

    Raises:
        AssertionError: a text tokenizes differently (the build fails).
    """
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    want = trained(texts, add_special_tokens=False)["input_ids"]
    got_raw = [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]
    for text, w, g, r in zip(texts, want, ids, got_raw, strict=True):
        assert g == w, f"{type(loaded).__name__} tokenizes unlike training: {text[:200]!r}"
        assert r == w, f"tokenizer.json read raw tokenizes unlike training: {text[:200]!r}"
    for t in SPECIAL_TOKENS + PLAIN_MARKERS:
        assert loaded.convert_tokens_to_ids(t) == trained.convert_tokens_to_ids(t), t
    print(
        f"tokenizer: {type(loaded).__name__} reloaded from the folder gives the training ids "
        f"on all {len(texts)} texts",
        flush=True,
    )


def write_folder_base(out: Path, trained: Any, config: Any) -> None:
    """Everything but the weights: tokenizer files, chat template, config, generation config."""
    trained.save_pretrained(out)
    config.save_pretrained(out)
    save_generation_config(out, trained)
    fix_tokenizer_config(out)


def arg_parser() -> argparse.ArgumentParser:
    """The build's command line (also read back from a MANIFEST's `build_command` by
    models/refresh_kimi_tiny.py)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "models" / "kimi-tiny")
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    ap.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    ap.add_argument(
        "--easy-fraction",
        type=float,
        default=DEFAULTS["easy_fraction"],
        help="share of the steps spent on the short curriculum samples first",
    )
    ap.add_argument(
        "--value-weight",
        type=float,
        default=DEFAULTS["value_weight"],
        help="loss weight of the value tokens (arguments, ids, answers) vs 1",
    )
    ap.add_argument("--train-samples", type=int, default=DEFAULTS["train_samples"])
    ap.add_argument("--canonical-repeats", type=int, default=DEFAULTS["canonical_repeats"])
    for key in SHAPE:
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=SHAPE[key])
    ap.add_argument(
        "--no-space-merges",
        action="store_true",
        help="learn no BPE merge that joins a space to a word (experiment)",
    )
    ap.add_argument("--heldout", type=int, default=60)
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=540.0,
        help="safety stop for training, in CPU seconds per torch thread (keeps "
        "training under 10 minutes on 2 quiet cores; CPU time, so that a busy "
        "machine stops at the same step)",
    )
    ap.add_argument(
        "--no-write",
        action="store_true",
        help="train and evaluate only; leave the committed folder alone",
    )
    ap.add_argument(
        "--evaluate-only",
        action="store_true",
        help="train nothing: re-measure the folder at --out and update its MANIFEST.json",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = arg_parser().parse_args(argv)
    if args.evaluate_only:
        return evaluate_only(args)
    shape = {key: getattr(args, key) for key in SHAPE}
    # The command that rebuilds this folder in place (without --out, which only says where).
    given = list(sys.argv[1:] if argv is None else argv)
    build_args = [
        a
        for i, a in enumerate(given)
        if not a.startswith("--out") and (i == 0 or given[i - 1] != "--out")
    ]

    import tokenizers
    import torch
    import transformers
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    t_start = time.monotonic()

    canonical = canonical_samples()
    train_set = samples(SEED, args.train_samples)
    corpus = [render_plain(s) for s in train_set[:4000]]
    trained_tok = build_tokenizer(corpus, space_merges=not args.no_space_merges)
    config = build_config(trained_tok, shape)
    staging = Path(tempfile.mkdtemp(prefix="kimi-tiny-"))
    try:
        write_folder_base(staging, trained_tok, config)
        # From here on everything goes through the folder as vLLM and the renderer load it.
        tokenizer = AutoTokenizer.from_pretrained(str(staging))
        # Canonical prompts are part of the training data (the fixture must reproduce them).
        train_set += [s for s in canonical for _ in range(args.canonical_repeats)]
        easy_set = easy_samples(SEED + 2, 4000)
        rendered = [render(tokenizer, s) for s in train_set + easy_set]
        seen = {text for text, _ in rendered[: len(train_set)]}
        heldout = heldout_samples(tokenizer, seen, args.heldout)
        rendered += [render(tokenizer, s) for s in heldout + canonical]
        everything = train_set + easy_set + heldout + canonical
        targets = [s.output + EOS for s in everything]
        target_enc = tokenizer(targets, add_special_tokens=False, return_offsets_mapping=True)
        check_tokenizer(
            staging,
            trained_tok,
            tokenizer,
            [text for text, _ in rendered] + targets,
            [ids for _, ids in rendered] + target_enc["input_ids"],
        )
        encoded = [
            (prompt, list(tids), loss_weights(s.output, offsets, args.value_weight))
            for s, (_, prompt), tids, offsets in zip(
                everything,
                rendered,
                target_enc["input_ids"],
                target_enc["offset_mapping"],
                strict=True,
            )
        ]
        data = encoded[: len(train_set)]
        easy = encoded[len(train_set) : len(train_set) + len(easy_set)]
        lengths = [len(p) + len(t) for p, t, _ in data]
        print(
            f"data: {len(data)} samples, mean {sum(lengths) / len(lengths):.0f} tokens, "
            f"max {max(lengths)}; held-out {len(heldout)}; "
            f"setup {time.monotonic() - t_start:.0f}s",
            flush=True,
        )

        model = Qwen2ForCausalLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {n_params:,} parameters {shape}", flush=True)
        easy_steps = int(args.steps * args.easy_fraction)
        stats = train(
            model,
            [(easy, easy_steps), (data, args.steps - easy_steps)],
            batch_size=args.batch_size,
            lr=args.lr,
            pad_id=tokenizer.convert_tokens_to_ids(PAD),
            max_seconds=args.max_seconds,
        )

        t_eval = time.monotonic()
        formats: list[bool] = []
        same: list[bool] = []
        ok_held, fail_held = evaluate(model, tokenizer, heldout, formats, same)
        ok_can, fail_can = evaluate(model, tokenizer, canonical)
        print(f"held-out exact matches: {ok_held}/{len(heldout)}")
        print(f"held-out format matches: {sum(formats)}/{len(heldout)}")
        print(f"held-out same tool calls: {sum(same)}/{len(heldout)}")
        print(
            f"canonical exact matches: {ok_can}/{len(canonical)} "
            f"(eval {time.monotonic() - t_eval:.0f}s)"
        )
        for f in (fail_can + fail_held)[:20]:
            print("  MISMATCH " + f)
        if args.no_write:
            print(
                json.dumps(
                    {
                        "training": stats,
                        "heldout": f"{ok_held}/{len(heldout)}",
                        "canonical": f"{ok_can}/{len(canonical)}",
                    }
                )
            )
            return 0

        model.save_pretrained(staging, safe_serialization=True)
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        for old in out.iterdir():
            old.unlink()
        for f in sorted(staging.iterdir()):
            shutil.copyfile(f, out / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    files = {p.name: sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {
        "name": kt.SERVED_MODEL_NAME,
        "architecture": "Qwen2ForCausalLM",
        "parameters": n_params,
        "shape": shape,
        "dtype": "float32",
        "size_bytes": sum((out / f).stat().st_size for f in files),
        "build_command": "PYTHONPATH=libs python models/build_kimi_tiny.py"
        + ("" if not build_args else " " + shlex.join(build_args)),
        "seed": SEED,
        "torch_threads": THREADS,
        "tokenizer_class_loaded": type(tokenizer).__name__,
        "training": {
            **stats,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "value_weight": args.value_weight,
            "curriculum_steps": easy_steps,
            "train_samples": len(data) + len(easy),
        },
        "build_seconds": round(time.monotonic() - t_start, 1),
        "heldout_exact_match": f"{ok_held}/{len(heldout)}",
        "heldout_format_match": f"{sum(formats)}/{len(heldout)}",
        "heldout_same_tool_calls": f"{sum(same)}/{len(heldout)}",
        "canonical_exact_match": f"{ok_can}/{len(canonical)}",
        "evaluated_with": "inferplane.chat.render_chat through the reloaded AutoTokenizer, "
        "transformers greedy decoding",
        "token_ids": {
            t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + PLAIN_MARKERS
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": __import__("safetensors").__version__,
        },
        "sha256": files,
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(
        json.dumps(
            {
                k: manifest[k]
                for k in (
                    "parameters",
                    "size_bytes",
                    "build_seconds",
                    "heldout_exact_match",
                    "heldout_format_match",
                    "heldout_same_tool_calls",
                    "canonical_exact_match",
                )
            }
        )
    )
    # The bar: the training format on every held-out prompt, the canonical cases exact.
    return 0 if all(formats) and ok_can == len(canonical) else 1


def heldout_samples(tokenizer: Any, seen: set[str], n: int) -> list[Sample]:
    """`n` evaluation chats of the training templates whose rendered prompt is not in `seen`
    (the training prompts)."""
    heldout: list[Sample] = []
    for s in samples(SEED + 1, n * 4):
        if len(heldout) < n and render_text(tokenizer, s) not in seen:
            heldout.append(s)
    return heldout


def evaluate_only(args: argparse.Namespace) -> int:
    """Re-measures the built folder `args.out` (no training): held-out exact and format
    matches and canonical exact matches, the same prompts as the build; updates those fields
    of its MANIFEST.json. Exit 0 when every held-out output has the training format and every
    canonical case is exact."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    torch.set_num_threads(THREADS)
    out: Path = args.out
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    canonical = canonical_samples()
    train_set = samples(SEED, args.train_samples)
    train_set += [s for s in canonical for _ in range(args.canonical_repeats)]
    heldout = heldout_samples(
        tokenizer, {render_text(tokenizer, s) for s in train_set}, args.heldout
    )
    model = Qwen2ForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    formats: list[bool] = []
    same: list[bool] = []
    ok_held, fail_held = evaluate(model, tokenizer, heldout, formats, same)
    ok_can, fail_can = evaluate(model, tokenizer, canonical)
    result = {
        "heldout_exact_match": f"{ok_held}/{len(heldout)}",
        "heldout_format_match": f"{sum(formats)}/{len(heldout)}",
        "heldout_same_tool_calls": f"{sum(same)}/{len(heldout)}",
        "canonical_exact_match": f"{ok_can}/{len(canonical)}",
    }
    for f in fail_can + [f for f in fail_held if "FORMAT" in f]:
        print("  MISMATCH " + f)
    print(json.dumps(result))
    manifest_path = out / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.update(result)
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return 0 if all(formats) and ok_can == len(canonical) else 1


def render_text(tokenizer: Any, s: Sample) -> str:
    """The prompt text only (for de-duplication and the tokenizer check)."""
    return render(tokenizer, s)[0]


def render_plain(s: Sample) -> str:
    """Text of a sample for tokenizer training (markers are stripped later)."""
    parts = [json.dumps([kt.TOOLS[n]["function"] for n in s.tool_names], separators=(",", ":"))]
    for m in s.messages:
        parts.append(str(m.get("content") or ""))
        parts.append(str(m.get("reasoning_content") or ""))
        for tc in m.get("tool_calls") or []:
            parts.append(tc["id"] + "\n" + tc["function"]["arguments"])
        if m["role"] == "tool":
            parts.append(f"## Return of {m['tool_call_id']}")
    parts.append(s.output)
    return "\n".join(p for p in parts if p)


def save_generation_config(out: Path, tokenizer: Any) -> None:
    from transformers import GenerationConfig

    eos = tokenizer.convert_tokens_to_ids(EOS)
    pad = tokenizer.convert_tokens_to_ids(PAD)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(out)


def fix_tokenizer_config(out: Path) -> None:
    """Keep the template in tokenizer_config.json too (older readers look there) and use the
    class name that transformers 4 and 5 both know."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
