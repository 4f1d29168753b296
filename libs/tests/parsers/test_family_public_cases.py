"""Cases of every registered parser but Kimi K2 (today Qwen3, DeepSeek-V3.1, GLM-4.5 and
gpt-oss's harmony) drawn from the public suites of vLLM and SGLang, plus derived edge cases,
replayed through ``replay`` (the parser's public contract, ``cli.replay_case``): the same schema
and splits as the Kimi suite (``test_kimi_k2_public_cases.py``), one case file per parser.

Each line of ``cases/<parser>_public.jsonl`` (package data of ``inferplane.conformance``) is a
replay case (``name``, ``model_output``, ``stream_deltas``, ``thinking``, optional ``tools``)
plus ``source``, ``expected`` (``reasoning``, ``content``, ``tool_calls``) and, where our
contract differs from the public suite's expectation, a one-line ``note``. Every case is
replayed whole, with its own ``stream_deltas`` when given, and in chunks of 1, 2, 3, 5, 11 and
23 characters; every split must give exactly ``expected``.

The parsers are discovered from the registry (``default_registry().names``): a registered
parser without its ``cases/<name>_public.jsonl`` fails
``test_every_registered_parser_has_public_cases``. Kimi K2's file is replayed by its own suite
(``test_kimi_k2_public_cases.py``).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import inferplane.conformance
from inferplane.parsers import Parser, build_parser, default_registry
from inferplane.parsers.cli import replay_case

# The cases ship with the conformance library (package data), which replays them on replicas.
CASES_DIR = Path(inferplane.conformance.__file__).parent / "cases"
REGISTERED = default_registry().names
# Parsers whose public cases have a suite of their own (more cases, other sources).
OWN_SUITE = frozenset({"kimi_k2"})
FAMILIES = tuple(name for name in REGISTERED if name not in OWN_SUITE)
CHUNK_SIZES = (1, 2, 3, 5, 11, 23)
COMPARED = ("reasoning", "content", "tool_calls")


def _cases_path(family: str) -> Path:
    return CASES_DIR / f"{family}_public.jsonl"


def _load(family: str) -> list[dict[str, Any]]:
    path = _cases_path(family)
    if not path.is_file():
        return []  # reported by test_every_registered_parser_has_public_cases
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


CASES = {family: _load(family) for family in FAMILIES}
PARAMS = [
    pytest.param(family, case, id=f"{family}:{case['name']}")
    for family in FAMILIES
    for case in CASES[family]
]


@cache
def _parser(family: str) -> Parser:
    return build_parser(family)


def _splits(case: dict[str, Any]) -> list[tuple[str, list[str] | None]]:
    """``(label, stream_deltas)`` for every way the case is replayed."""
    text = case["model_output"]
    out: list[tuple[str, list[str] | None]] = [("whole", None)]
    if case.get("stream_deltas") is not None:
        out.append(("own_deltas", case["stream_deltas"]))
    for size in CHUNK_SIZES:
        out.append((f"chunk{size}", [text[i : i + size] for i in range(0, len(text), size)]))
    return out


@pytest.mark.parametrize(("family", "case"), PARAMS)
def test_case_at_every_split(family: str, case: dict[str, Any]) -> None:
    """The case gives exactly its expected reasoning, content and tool calls at every split."""
    parser = _parser(family)
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


def test_every_registered_parser_has_public_cases() -> None:
    """Each parser a deployment may name has its public cases file, and each cases file names
    a registered parser."""
    missing = [name for name in REGISTERED if not _cases_path(name).is_file()]
    assert not missing, f"registered parsers without cases/<name>_public.jsonl: {missing}"
    files = {p.name.removesuffix("_public.jsonl") for p in CASES_DIR.glob("*_public.jsonl")}
    assert files <= set(REGISTERED), f"cases for unregistered parsers: {files - set(REGISTERED)}"
    assert set(REGISTERED) >= OWN_SUITE


@pytest.mark.parametrize("family", FAMILIES)
def test_corpus_shape(family: str) -> None:
    """At least 30 cases per parser, each named (uniquely), sourced, with a complete
    expectation, and drawn from both vLLM and SGLang."""
    cases = CASES[family]
    assert len(cases) >= 30
    names = [c.get("name") for c in cases]
    assert all(isinstance(n, str) and n for n in names)
    assert len(set(names)) == len(names), "case names must be unique"
    sources = [c.get("source") for c in cases]
    assert all(isinstance(s, str) and s for s in sources)
    for origin in ("vllm ", "sglang ", "derived: "):
        assert any(s.startswith(origin) for s in sources), origin
    for c in cases:
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
