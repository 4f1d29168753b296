"""``replay`` end to end: the parser's public contract (issue 3 §5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from inferplane.parsers.cli import app

LIBS = Path(__file__).resolve().parents[2]
CASES = [
    {
        "name": "k25_tool_call",
        "model_output": "Need weather.</think>Checking.<|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "東京"}<|tool_call_end|><|tool_calls_section_end|>',
        "stream_deltas": None,
        "thinking": True,
    },
    {
        "name": "streamed_skip_think_end",
        "model_output": "",
        "stream_deltas": [
            "I'll call",
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|>",
            "search:3",
            "<|tool_call_argument_begin|>",
            "{bad json",
            "<|tool_call_end|>",
            "<|tool_calls_section_end|>",
        ],
        "thinking": True,
    },
    {"name": "plain", "model_output": "Hello!", "stream_deltas": None, "thinking": False},
    {"name": "empty", "model_output": "", "stream_deltas": [], "thinking": False},
]
EXPECTED = [
    {
        "name": "k25_tool_call",
        "reasoning": "Need weather.",
        "content": "Checking.",
        "tool_calls": [
            {"id": "functions.get_weather:0", "name": "get_weather", "arguments": {"city": "東京"}}
        ],
    },
    {
        "name": "streamed_skip_think_end",
        "reasoning": "I'll call",
        "content": None,
        "tool_calls": [{"id": "search:3", "name": "search", "arguments": "{bad json"}],
    },
    {"name": "plain", "reasoning": None, "content": "Hello!", "tool_calls": []},
    {"name": "empty", "reasoning": None, "content": None, "tool_calls": []},
]


def jsonl(cases: list[dict[str, object]]) -> str:
    return "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in cases)


def test_replay_file(tmp_path: Path) -> None:
    path = tmp_path / "cases.jsonl"
    path.write_text(jsonl(CASES) + "\n", encoding="utf-8")
    r = CliRunner().invoke(app, ["replay", "--parser", "kimi_k2", str(path)])
    assert r.exit_code == 0, r.output
    assert [json.loads(line) for line in r.stdout.splitlines()] == EXPECTED


def test_replay_stdin_via_python_m() -> None:
    """``python -m inferplane.parsers replay --parser kimi_k2 -`` reads standard input."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(LIBS), os.environ.get("PYTHONPATH")])),
    }
    r = subprocess.run(
        [sys.executable, "-m", "inferplane.parsers", "replay", "--parser", "kimi_k2", "-"],
        input=jsonl(CASES),
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.splitlines()] == EXPECTED


def test_streamed_case_equals_one_shot_case() -> None:
    whole = CASES[1]["stream_deltas"]
    assert isinstance(whole, list)
    one_shot = {**CASES[1], "model_output": "".join(whole), "stream_deltas": None}
    r = CliRunner().invoke(app, ["replay", "-"], input=jsonl([CASES[1], one_shot]))
    a, b = (json.loads(line) for line in r.stdout.splitlines())
    assert a == b


def test_unknown_parser_lists_known_ones() -> None:
    r = CliRunner().invoke(app, ["replay", "--parser", "nope", "-"], input="")
    assert r.exit_code == 2
    assert "known parsers: deepseek_v31, glm45, gpt_oss, kimi_k2, qwen3" in r.stderr


def test_bad_line_is_reported_with_its_number() -> None:
    r = CliRunner().invoke(app, ["replay", "-"], input=jsonl(CASES[2:3]) + "not json\n")
    assert r.exit_code == 1
    assert json.loads(r.stdout.splitlines()[0])["name"] == "plain"
    assert "line 2" in r.stderr
