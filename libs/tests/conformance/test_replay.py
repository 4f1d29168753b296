"""Replay of the packaged public cases through a parser and a renderer: kimi-tiny's parser and
template pass every kimi_k2 case; a template without the tool declarations, a refusing one and
another family's parser fail; the failure lines are capped."""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from typing import Any

import pytest

from inferplane.chat import KIMI_K2, render_chat
from inferplane.conformance import (
    MAX_FAILURES,
    case_families,
    declared_names,
    public_cases,
    replay,
)
from inferplane.fixtures import kimi_tiny
from inferplane.fixtures.kimi_tiny_broken_template import drop_tool_declarations
from inferplane.parsers import build_parser, default_registry

KIMI = public_cases("kimi_k2")
WITH_TOOLS = sum(1 for c in KIMI if c.get("tools") and declared_names(c["tools"]))


@cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(kimi_tiny.model_path()), local_files_only=True)


def _render(request: Mapping[str, Any]) -> str:
    return render_chat(request, _tokenizer(), family=KIMI_K2).text


def test_every_registered_parser_ships_its_cases() -> None:
    assert set(case_families()) == set(default_registry().names)
    assert len(KIMI) >= 60 and WITH_TOOLS >= 20
    KIMI[0]["name"] = "changed"  # callers get copies
    assert public_cases("kimi_k2")[0]["name"] != "changed"
    assert public_cases("no_such_family") == []


def test_kimi_tiny_parser_and_template_pass_every_case() -> None:
    result = replay(KIMI, build_parser("kimi_k2"), _render)
    assert (result.cases, result.passed, result.failures) == (len(KIMI), len(KIMI), [])


def test_a_template_without_tool_declarations_fails_the_cases_with_tools() -> None:
    tokenizer = _tokenizer()
    broken = drop_tool_declarations(tokenizer.chat_template)

    def render(request: Mapping[str, Any]) -> str:
        prompt = tokenizer.apply_chat_template(
            [dict(m) for m in request["messages"]],
            tools=request["tools"],
            chat_template=broken,
            add_generation_prompt=True,
            tokenize=False,
        )
        return str(prompt)

    result = replay(KIMI, build_parser("kimi_k2"), render)
    assert result.cases == len(KIMI)
    assert result.passed == len(KIMI) - WITH_TOOLS
    assert len(result.failures) == MAX_FAILURES
    assert all("rendered prompt lacks the declared tools" in f for f in result.failures)


def test_a_template_that_refuses_tools_fails() -> None:
    def render(request: Mapping[str, Any]) -> str:
        raise ValueError("tools are not supported")

    result = replay(KIMI, build_parser("kimi_k2"), render)
    assert result.passed == len(KIMI) - WITH_TOOLS
    assert "render failed: ValueError: tools are not supported" in result.failures[0]


def test_another_family_parser_fails_and_no_parser_replays_nothing() -> None:
    result = replay(KIMI, build_parser("qwen3"), lambda r: json.dumps(r))
    assert result.passed < result.cases == len(KIMI)
    assert result.failures[0].split(":")[0] in {c["name"] for c in KIMI}
    assert "expected" in result.failures[0]
    none = replay(KIMI, None, _render)
    assert (none.cases, none.passed) == (0, 0)


@pytest.mark.parametrize("family", sorted(set(case_families()) - {"kimi_k2"}))
def test_each_family_parser_passes_its_own_cases(family: str) -> None:
    cases = public_cases(family)
    result = replay(cases, build_parser(family), lambda r: json.dumps(r))
    assert result.failures == [] and result.passed == len(cases)
