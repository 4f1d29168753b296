"""Kimi K2 / K2.5 cases drawn from the public suites of vLLM, SGLang and SMG, plus derived edge
cases, replayed through ``replay`` (the parser's public contract, ``cli.replay_case``).

Each line of ``cases/kimi_k2_public.jsonl`` (package data of ``inferplane.conformance``) is a
replay case (``name``, ``model_output``, ``stream_deltas``, ``thinking``, optional ``tools``: the
request's OpenAI tools array) plus ``source`` (where it comes from), ``expected``
(``reasoning``, ``content``, ``tool_calls``) and, where our contract differs from the public
suite's expectation, a one-line ``note``.

Every case is replayed whole, with its own ``stream_deltas`` when given, and in chunks of 1, 2,
3, 5, 11 and 23 characters of the whole text; every split must give exactly ``expected``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import inferplane.conformance
from inferplane.parsers import Parser, build_parser
from inferplane.parsers.cli import replay_case

# The cases ship with the conformance library (package data), which replays them on replicas.
CASES_PATH = Path(inferplane.conformance.__file__).parent / "cases" / "kimi_k2_public.jsonl"
CHUNK_SIZES = (1, 2, 3, 5, 11, 23)
COMPARED = ("reasoning", "content", "tool_calls")


def _load() -> list[dict[str, Any]]:
    with CASES_PATH.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


CASES = _load()


def _splits(case: dict[str, Any]) -> list[tuple[str, list[str] | None]]:
    """``(label, stream_deltas)`` for every way the case is replayed."""
    text = case["model_output"]
    out: list[tuple[str, list[str] | None]] = [("whole", None)]
    if case.get("stream_deltas") is not None:
        out.append(("own_deltas", case["stream_deltas"]))
    for size in CHUNK_SIZES:
        out.append((f"chunk{size}", [text[i : i + size] for i in range(0, len(text), size)]))
    return out


@pytest.fixture(scope="module")
def parser() -> Parser:
    return build_parser("kimi_k2")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_case_at_every_split(parser: Parser, case: dict[str, Any]) -> None:
    """The case gives exactly its expected reasoning, content and tool calls at every split."""
    expected = {k: case["expected"][k] for k in COMPARED}
    failures = []
    for label, deltas in _splits(case):
        out = replay_case(parser, {**case, "stream_deltas": deltas})
        got = {k: out[k] for k in COMPARED}
        if out["name"] != case["name"]:
            failures.append(f"{label}: name {out['name']!r}")
        if got != expected:
            failures.append(f"{label}: {json.dumps(got, ensure_ascii=False)}")
    assert not failures, f"expected {json.dumps(expected, ensure_ascii=False)}\n" + "\n".join(
        failures
    )


def test_corpus_shape() -> None:
    """At least 60 cases, each named (uniquely), sourced and with a complete expectation."""
    assert len(CASES) >= 60
    names = [c.get("name") for c in CASES]
    assert all(isinstance(n, str) and n for n in names)
    assert len(set(names)) == len(names), "case names must be unique"
    for c in CASES:
        assert isinstance(c.get("source"), str) and c["source"], c["name"]
        assert isinstance(c.get("model_output"), str), c["name"]
        assert isinstance(c.get("thinking"), bool), c["name"]
        expected = c.get("expected")
        assert isinstance(expected, dict), c["name"]
        assert set(expected) == set(COMPARED), c["name"]
        for call in expected["tool_calls"]:
            assert set(call) == {"id", "name", "arguments"}, c["name"]
        deltas = c.get("stream_deltas")
        if deltas is not None:
            assert "".join(deltas) == c["model_output"], c["name"]
        if "tools" in c:
            assert isinstance(c["tools"], list), c["name"]
            for t in c["tools"]:
                assert t["type"] == "function" and t["function"]["name"], c["name"]
