"""The public surface: pinned exports, registry by name, one error root, pure Python."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import inferplane.parsers as parsers
from inferplane.parsers import (
    ParserError,
    ParserRegistry,
    UnknownParserError,
    build_parser,
    default_registry,
    kimi_k2_config,
)

LIBS = Path(__file__).resolve().parents[2]


def test_exports_are_pinned() -> None:
    assert sorted(parsers.__all__) == sorted([
        "DEEPSEEK_V31_MARKERS", "GLM45_MARKERS", "QWEN3_MARKERS", "ArgumentsFormat",
        "deepseek_v31_config", "glm45_config", "qwen3_config", "GPT_OSS_MARKERS",
        "gpt_oss_config", "CallSyntax", "build_json_constraint", "answer_excludes",
        "unenforced_keyword",
        "KIMI_K2_MARKERS", "KIMI_K2_MARKER_VARIANTS", "ToolSet", "Action", "Constraint",
        "ConstraintError", "Delta", "EngineConfig",
        "InvalidToolCallError", "ParseResult", "Parser", "ParserError", "ParserRegistry",
        "PlainSession", "Session", "Sink", "ToolCall", "ToolCallDelta", "ToolCallVerdict",
        "ToolValidator", "Transition", "UnknownParserError", "VerdictReason", "build_parser",
        "build_tool_constraint", "default_registry", "kimi_k2_config", "split_kimi_header",
        "validate_tool_calls",
    ])  # fmt: skip
    for name in parsers.__all__:
        assert hasattr(parsers, name)


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(
        UnknownParserError, match=r"known parsers: deepseek_v31, glm45, gpt_oss, kimi_k2, qwen3$"
    ) as e:
        build_parser("kimi_k3")
    assert isinstance(e.value, ParserError)
    assert e.value.known == ("deepseek_v31", "glm45", "gpt_oss", "kimi_k2", "qwen3")


def test_registry_is_a_value() -> None:
    base = default_registry()
    extended = base.with_parser("kimi_k2_alias", kimi_k2_config)
    assert base.names == ("deepseek_v31", "glm45", "gpt_oss", "kimi_k2", "qwen3")
    assert extended.names == (
        "deepseek_v31", "glm45", "gpt_oss", "kimi_k2", "kimi_k2_alias", "qwen3"
    )  # fmt: skip
    assert build_parser("kimi_k2_alias", registry=extended).name == "kimi_k2"
    assert isinstance(extended, ParserRegistry)


def test_config_is_cached_and_consistent() -> None:
    assert kimi_k2_config() is kimi_k2_config()
    kimi_k2_config().check()


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v31", "glm45"])
def test_every_shipped_config_is_cached_consistent_and_named(name: str) -> None:
    factory = default_registry().factories[name]
    assert factory() is factory()
    factory().check()
    assert build_parser(name).name == name


def test_importing_the_library_pulls_no_grpc_or_torch() -> None:
    code = (
        "import sys, inferplane.parsers, inferplane.parsers.cli;"
        "bad = [m for m in ('grpc', 'torch', 'vllm', 'xgrammar') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(LIBS)},
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
