"""`same_format` / `same_calls` of models/build_kimi_tiny.py: what the build counts as a
held-out output "in the training format" (issue 3: greedy decoding must reproduce the training
format on held-out prompts) and what it does not."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from inferplane.fixtures import kimi_tiny as kt
from inferplane.parsers import build_parser

EOS = kt.EOS
BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


@pytest.fixture(scope="module")
def build() -> ModuleType:
    path = Path(__file__).resolve().parents[3] / "models" / "build_kimi_tiny.py"
    spec = importlib.util.spec_from_file_location("build_kimi_tiny", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def call(name: str, n: int, args: dict[str, Any]) -> str:
    return f"{CALL}functions.{name}:{n}{ARGS}{json.dumps(args)}{CALL_END}"


EXPECTED = (
    "The user asks for weather and time."
    + kt.THINK_END
    + BEGIN
    + call("get_weather", 0, {"city": "Oslo", "unit": "celsius"})
    + call("get_time", 1, {"city": "Lima"})
    + END
)


@pytest.mark.parametrize(
    ("got", "fmt", "calls"),
    [
        (EXPECTED + EOS, True, True),
        # other values, same tools: the format, not the copy
        (EXPECTED.replace("Oslo", "Rome").replace("Lima", "Cairo") + EOS, True, True),
        # the asked tools in another order: the format holds, the calls differ
        (
            "The user asks for weather and time."
            + kt.THINK_END
            + BEGIN
            + call("get_time", 0, {"city": "Lima"})
            + call("get_weather", 1, {"city": "Oslo", "unit": "celsius"})
            + END
            + EOS,
            True,
            False,
        ),
        (EXPECTED, False, False),  # never stopped
        (EXPECTED.replace(call("get_time", 1, {"city": "Lima"}), "") + EOS, False, False),
        (EXPECTED.replace(":1", ":2") + EOS, False, False),  # misnumbered id
        (EXPECTED.replace('"celsius"', '"kelvin"') + EOS, False, False),  # not in the enum
        (EXPECTED.replace('{"city": "Lima"}', '{"city": "Lima"') + EOS, False, False),  # JSON
        (EXPECTED.replace("The user asks for weather and time.", "") + EOS, False, False),
        ("Sure." + kt.THINK_END + "It is sunny." + EOS, False, False),  # text, no calls
    ],
)
def test_same_format_accepts_other_values_and_nothing_else(
    build: ModuleType, got: str, fmt: bool, calls: bool
) -> None:
    sample = build.Sample("call", [], ["get_weather", "get_time"], True, EXPECTED)
    parser = build_parser("kimi_k2")
    assert build.same_format(parser, sample, got) is fmt
    assert build.same_calls(parser, sample, got) is calls
