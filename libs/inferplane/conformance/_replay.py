"""Replay of a family's public cases through a replica's own parser and renderer (issue 30 §2).

The engine cannot be made to emit a recorded output, so replay checks the two ends of the
serving path that are the replica's own: its parser (the case's model output, whole, in its
own stream deltas and in chunks, must give exactly the expected reasoning, content and tool
calls) and its chat template (a case that declares tools is rendered as a one-turn request
with those tools; every declared function's name and its top-level parameter names must be in
the prompt: a template that drops the tool declarations fails here).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferplane.parsers import Parser, ParserError
from inferplane.parsers.cli import replay_case

MAX_FAILURES = 20
"""Failure lines a report keeps (`ConformanceReport.replay_failures`)."""
CHUNK_SIZES = (1, 7)
"""Chunk sizes (characters) each case is streamed in, beside whole and its own deltas (the
parsers' own tests replay 1, 2, 3, 5, 11 and 23; two sizes keep the gate fast)."""
COMPARED = ("reasoning", "content", "tool_calls")
RENDER_PROMPT = "Use the tools you have to answer: what is the weather in Paris?"
"""The user turn of a rendered case."""

Render = Callable[[Mapping[str, Any]], str]
"""An OpenAI chat request (plain JSON values) → the prompt text the replica's renderer gives
(raises on a request its template refuses)."""


@dataclass(slots=True)
class ReplayResult:
    """What a replay found.

    Attributes:
        cases: cases replayed.
        passed: cases whose every check passed.
        failures: one line per failed case (`"<name>: <what differed>"`), at most
            `MAX_FAILURES`.
    """

    cases: int = 0
    passed: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, name: str, problem: str | None) -> None:
        """Counts one case; `problem` None when it passed."""
        self.cases += 1
        if problem is None:
            self.passed += 1
        elif len(self.failures) < MAX_FAILURES:
            self.failures.append(f"{name}: {problem}")


def _splits(case: Mapping[str, Any]) -> list[tuple[str, list[str] | None]]:
    text = case["model_output"]
    out: list[tuple[str, list[str] | None]] = [("whole", None)]
    if case.get("stream_deltas") is not None:
        out.append(("own_deltas", list(case["stream_deltas"])))
    for size in CHUNK_SIZES:
        out.append((f"chunk{size}", [text[i : i + size] for i in range(0, len(text), size)]))
    return out


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_problem(parser: Parser, case: Mapping[str, Any]) -> str | None:
    """What the parser got wrong on `case` (the first split that differs), None when every
    split gives exactly `case["expected"]`."""
    expected = {k: case["expected"][k] for k in COMPARED}
    for label, deltas in _splits(case):
        try:
            out = replay_case(parser, {**case, "stream_deltas": deltas})
        except ParserError as exc:
            return f"parser error ({label}): {exc}"
        got = {k: out[k] for k in COMPARED}
        if got != expected:
            return f"parsed ({label}) {_short(got)}, expected {_short(expected)}"
    return None


def declared_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The names a rendered prompt must show: each function's name, then its top-level
    parameter names."""
    names: list[str] = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        names.append(fn["name"])
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        if isinstance(props, Mapping):
            names.extend(str(p) for p in props)
    return names


def render_request(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The one-turn chat request a case's tools are rendered in."""
    return {
        "messages": [{"role": "user", "content": RENDER_PROMPT}],
        "tools": [dict(t) for t in tools],
    }


def render_problem(render: Render, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """What the renderer got wrong with `tools` declared (a refusal, or names missing from the
    prompt), None when every declared name is in the prompt."""
    try:
        text = render(render_request(tools))
    except Exception as exc:  # the template's refusal is the finding, whatever its type
        return f"render failed: {type(exc).__name__}: {exc}"
    missing = [name for name in declared_names(tools) if name not in text]
    if missing:
        return f"rendered prompt lacks the declared tools ({', '.join(missing[:5])})"
    return None


def replay(
    cases: Iterable[Mapping[str, Any]], parser: Parser | None, render: Render | None
) -> ReplayResult:
    """Replays `cases` through `parser` (None: the replica has no parser, so no case can be
    checked and none is counted) and, for the cases that declare tools, `render` (None: no
    render check). A case passes when both checks pass."""
    result = ReplayResult()
    if parser is None:
        return result
    for case in cases:
        problem = parse_problem(parser, case)
        tools = case.get("tools")
        if problem is None and render is not None and tools:
            problem = render_problem(render, tools)
        result.add(str(case.get("name")), problem)
    return result
