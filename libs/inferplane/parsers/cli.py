"""``inferplane parsers`` commands (mounted by the main CLI; also ``python -m inferplane.parsers``).

``replay`` is the parser's public contract (issue 3 §5); other tools depend on its input and
output shapes, so change them only compatibly.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, TextIO

import typer

from inferplane.parsers._errors import ParserError
from inferplane.parsers._parser import Parser
from inferplane.parsers._registry import build_parser, default_registry

__all__ = ["app", "replay_cases"]

app = typer.Typer(
    help="Reasoning and tool-call parsers.", no_args_is_help=True, add_completion=False
)


@app.callback()
def _group() -> None:
    """Reasoning and tool-call parsers."""


class CaseError(ParserError):
    """A replay input line is not a valid case."""


def _arguments(raw: str) -> Any:
    """Parsed JSON arguments, or the raw string when they are not valid JSON."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def replay_case(parser: Parser, case: dict[str, Any]) -> dict[str, Any]:
    """Parse one case; the output object of ``replay``.

    Input: ``{"name", "model_output": str, "stream_deltas": [str] | null, "thinking": bool,
    "tools": [...]}`` (``thinking``, whether the prompt opened reasoning, defaults to true,
    K2.5's default; ``tools``, optional, is
    an OpenAI ``tools`` array exactly as a request carries it: names are then resolved and
    arguments coerced against it, and an empty array means no tool calls). With
    ``stream_deltas`` null the output is parsed in one piece; otherwise the deltas are fed in
    order (``model_output`` is then not used). Output: ``{"name", "reasoning", "content",
    "tool_calls": [{"id", "name", "arguments"}]}``; reasoning / content are null when empty;
    arguments are the parsed JSON (the raw string when not valid JSON).

    Raises:
        CaseError: a field has the wrong type.
    """
    thinking = case.get("thinking", True)
    deltas = case.get("stream_deltas")
    tools = case.get("tools")
    if not isinstance(thinking, bool):
        raise CaseError("'thinking' must be true or false")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise CaseError("'tools' must be an array of tool objects or absent")
    if deltas is None:
        text = case.get("model_output")
        if not isinstance(text, str):
            raise CaseError("'model_output' must be a string when 'stream_deltas' is null")
        result = parser.parse(text, thinking=thinking, tools=tools)
    else:
        if not isinstance(deltas, list) or not all(isinstance(d, str) for d in deltas):
            raise CaseError("'stream_deltas' must be a list of strings or null")
        session = parser.start(thinking=thinking, tools=tools)
        result = parser.collect([*(session.feed(d) for d in deltas), session.finish()])
    return {
        "name": case.get("name"),
        "reasoning": result.reasoning or None,
        "content": result.content or None,
        "tool_calls": [
            {"id": c.id, "name": c.name, "arguments": _arguments(c.arguments)}
            for c in result.tool_calls
        ],
    }


def replay_cases(parser: Parser, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Replay JSON lines (blank lines skipped); yields one output object per case.

    Raises:
        CaseError: a line is not a JSON object or a field has the wrong type; the message
            names the 1-based line number.
    """
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            case = json.loads(line)
            if not isinstance(case, dict):
                raise CaseError("a case must be a JSON object")
            yield replay_case(parser, case)
        except (ValueError, CaseError) as e:
            raise CaseError(f"line {number}: {e}") from e


@app.command()
def replay(
    cases: Annotated[
        str, typer.Argument(help="JSON lines file of cases; '-' reads standard input.")
    ],
    parser: Annotated[
        str,
        typer.Option("--parser", help=f"Parser name: {', '.join(default_registry().names)}."),
    ] = "kimi_k2",
) -> None:
    """Parse recorded model outputs; print one JSON line per case.

    Case: {"name", "model_output", "stream_deltas": [str] | null, "thinking": bool,
    "tools": [OpenAI tools] (optional)}.
    Output: {"name", "reasoning", "content", "tool_calls": [{"id", "name", "arguments"}]}.
    """
    try:
        p = build_parser(parser)
    except ParserError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    stream: TextIO
    try:
        stream = sys.stdin if cases == "-" else open(cases, encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        typer.echo(f"error: cannot read {cases}: {e.strerror}", err=True)
        raise typer.Exit(2) from e
    try:
        for out in replay_cases(p, stream):
            sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
            sys.stdout.flush()
    except ParserError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e
    finally:
        if stream is not sys.stdin:
            stream.close()
