"""Live conformance requests and their scoring (the K2 Vendor Verifier's method, issue 30 §2).

`live_requests(n, seed)` draws `n` chat requests, each with 1 to 3 function tools of random
names and random object schemas (integer with bounds, number, boolean, bounded string, string
enum, a nested object, a short array; a random `required` list), asking a weather question,
with `tool_choice` "auto", "required" and a named function in turn. Thinking (where the family
has a switch: `thinking_kwarg`) is on for every other "auto" request and off for "required" and
named ones: a forced call is measured as the answer's first output (a model that reasons
without end before it, as the fixture model does on tools it was not trained on, is then not
cut by `max_tokens` before its call), reasoning separation and leaked markers where the model
writes freely. The same seed gives the same requests (`random.Random(seed)`; no global
state). Free strings are at most 16 characters: a longer one could hold a call marker, which a
constrained grammar allows inside JSON strings and the parser then takes for the end of the
arguments (`inferplane.parsers._constrain`); numbers and integers have both bounds (a model
that writes digits without end is cut by `max_tokens`).

`max_tokens` is what a complete answer needs with a margin, so that the live phase is bounded
by the answers that never end (the gate's run time is its slowest answer): `FORCED_MAX_TOKENS`
(512) for "required" / named, `AUTO_MAX_TOKENS` (256) for "auto". Measured on kimi-tiny
(`bench/conformance_cost.py`, seeds 1-80: 640 forced and 320 "auto" answers), the largest
complete forced call took 187 completion tokens and the largest complete "auto" answer 101;
the only answers that reached the old 1,024 were "auto" ones repeating a word. A forced call
cannot run on inside its arguments (the constraint bounds them: strings of at most 16
characters, bounded numbers, at most 8 whitespace characters between tokens,
`inferplane.parsers._constrain.MAX_WHITESPACE`, arrays of at most 3 items), so 512 leaves a
real model's call room; 12 requests write at most 4 x 256 + 8 x 512 = 5,120 completion tokens
(12,288 before), each at most 512.

`LiveTally` scores each answer (an OpenAI chat completion as JSON) as
github.com/MoonshotAI/K2-Vendor-Verifier counts: calls expected (required / named) and
returned, calls schema-valid (the last call of an answer cut by `max_tokens` is returned but
not checked: it cannot be complete) (a declared name, the named one under a named `tool_choice`;
arguments a JSON object valid against its `parameters`: `inferplane.parsers.
validate_tool_calls`), finish reasons that disagree with the output, the family's markers
leaked into content or reasoning, and reasoning markers left in content (reasoning not
separated). A request that failed or did not finish counts as a live error (and, when a call
was expected, as a call not returned). A forced answer cut by `max_tokens` before any call
counts as a call not returned (a problem line says so); an "auto" answer cut by `max_tokens`
counts against nothing (it may ramble; the model was free not to call), and a problem line
says so.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.parsers import ToolCall, validate_tool_calls

JSON = dict[str, Any]

TOOL_CHOICES = ("auto", "required", "named")
"""The `tool_choice` of request i is `TOOL_CHOICES[i % 3]` ("named": one of its functions)."""
FORCED_MAX_TOKENS = 512
"""`max_tokens` of a "required" / named request: ~2.7x the largest complete forced call
measured on kimi-tiny (187 tokens; module docstring)."""
AUTO_MAX_TOKENS = 256
"""`max_tokens` of an "auto" request: ~2.5x the largest complete "auto" answer measured on
kimi-tiny (101 tokens); one cut there counts against nothing (`LiveTally.add`)."""
MAX_STRING_LENGTH = 16
CITIES = ("Tokyo", "Paris", "Rome", "Oslo", "Lima", "Berlin", "Madrid", "Cairo", "Seoul")
_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "north", "south", "fast", "slow", "red")


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """One live request.

    Attributes:
        index: its position (0-based) in the drawn list.
        body: the OpenAI chat request (`messages`, `tools`, `tool_choice`, `max_tokens`
            `FORCED_MAX_TOKENS` or `AUTO_MAX_TOKENS`, `temperature` 0); `model` is left to the
            sender.
        tool_choice: "auto", "required" or "named".
        named: the function a named `tool_choice` names ("" otherwise).
        thinking: reasoning asked for (set in the body only for a family with a switch).
    """

    index: int
    body: JSON
    tool_choice: str
    named: str = ""
    thinking: bool = True

    @property
    def expects_call(self) -> bool:
        """A tool call must come back (`tool_choice` required or named)."""
        return self.tool_choice != "auto"


def _name(rng: random.Random, length: int) -> str:
    first = rng.choice(string.ascii_lowercase)
    return first + "".join(rng.choice(string.ascii_lowercase + "_") for _ in range(length - 1))


def _leaf(rng: random.Random) -> JSON:
    kind = rng.randrange(5)
    if kind == 0:
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == 1:
        lo = rng.randint(-50, 50)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == 2:
        return {"type": "boolean"}
    if kind == 3:
        schema: JSON = {"type": "string", "maxLength": rng.randint(1, MAX_STRING_LENGTH)}
        if rng.random() < 0.5:
            schema["description"] = " ".join(rng.sample(_WORDS, rng.randint(1, 3)))
        return schema
    return {"type": "string", "enum": rng.sample(_WORDS, rng.randint(1, 4))}


def _property(rng: random.Random, depth: int) -> JSON:
    roll = rng.random()
    if depth > 0 and roll < 0.15:
        return _object(rng, depth - 1, min_properties=1, max_properties=3)
    if depth > 0 and roll < 0.3:
        return {"type": "array", "items": _leaf(rng), "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int, *, min_properties: int, max_properties: int) -> JSON:
    names: list[str] = []
    count = rng.randint(min_properties, max_properties)
    while len(names) < count:
        name = _name(rng, rng.randint(2, 10))
        if name not in names:
            names.append(name)
    properties = {name: _property(rng, depth) for name in names}
    schema: JSON = {"type": "object", "properties": properties}
    required = [n for n in names if rng.random() < 0.5]
    if required or rng.random() < 0.5:
        schema["required"] = required
    return schema


def random_tools(rng: random.Random, max_tools: int = 3) -> list[JSON]:
    """1 to `max_tools` function tools with unique random names, each with an object schema of
    1 to 4 properties (nested objects and arrays one level deep)."""
    names: list[str] = []
    count = rng.randint(1, max_tools)
    while len(names) < count:
        name = _name(rng, rng.randint(3, 16))
        if name.lower() not in {n.lower() for n in names}:
            names.append(name)
    tools = []
    for name in names:
        function: JSON = {
            "name": name,
            "parameters": _object(rng, 1, min_properties=1, max_properties=4),
        }
        if rng.random() < 0.5:
            function["description"] = " ".join(rng.sample(_WORDS, rng.randint(1, 4)))
        tools.append({"type": "function", "function": function})
    return tools


def live_requests(n: int, seed: int, thinking_kwarg: str | None = None) -> list[LiveRequest]:
    """`n` live requests for `seed` (same seed, same requests); `tool_choice` auto, required,
    named in turn, `max_tokens` `AUTO_MAX_TOKENS` / `FORCED_MAX_TOKENS`; thinking on for every
    other auto request, off otherwise, set as `chat_template_kwargs[thinking_kwarg]` (the
    family's switch, `ChatFamily.thinking_kwarg`; None: the family has none and the body leaves
    it to the template).

    Raises:
        ValueError: `n` is negative.
    """
    if n < 0:
        raise ValueError(f"live requests must be >= 0, got {n}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tools = random_tools(rng)
        kind = TOOL_CHOICES[i % len(TOOL_CHOICES)]
        named = ""
        choice: Any = kind
        if kind == "named":
            named = rng.choice(tools)["function"]["name"]
            choice = {"type": "function", "function": {"name": named}}
        body: JSON = {
            "messages": [
                {"role": "user", "content": f"What is the weather in {rng.choice(CITIES)}?"}
            ],
            "tools": tools,
            "tool_choice": choice,
            "max_tokens": AUTO_MAX_TOKENS if kind == "auto" else FORCED_MAX_TOKENS,
            "temperature": 0,
        }
        thinking = kind == "auto" and (i // len(TOOL_CHOICES)) % 2 == 0
        if thinking_kwarg:
            body["chat_template_kwargs"] = {thinking_kwarg: thinking}
        out.append(
            LiveRequest(index=i, body=body, tool_choice=kind, named=named, thinking=thinking)
        )
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


@dataclass(slots=True)
class LiveTally:
    """The live counts of one run (`ConformanceReport`'s live fields).

    Args:
        markers: the family's markers (the parser's terminals): none may appear in content or
            reasoning.
        reasoning_markers: those that open or close reasoning: in content, reasoning was not
            separated.
    """

    markers: Sequence[str] = ()
    reasoning_markers: Sequence[str] = ()
    requests: int = 0
    errors: int = 0
    tool_calls_expected: int = 0
    tool_calls_returned: int = 0
    tool_calls: int = 0
    tool_calls_schema_valid: int = 0
    finish_reason_mismatches: int = 0
    leaked_markers: int = 0
    reasoning_unseparated: int = 0
    problems: list[str] = field(default_factory=list)

    def error(self, request: LiveRequest, reason: str) -> None:
        """Counts a request that failed or did not finish (`reason`: why, for the logs)."""
        self.requests += 1
        self.errors += 1
        self.tool_calls_expected += request.expects_call
        self.problems.append(f"live {request.index}: {reason}")

    def add(self, request: LiveRequest, completion: Mapping[str, Any]) -> None:
        """Scores one answer: `completion` is an OpenAI chat completion as JSON (its first
        choice is scored). One without a choice counts as an error."""
        choices = completion.get("choices") or ()
        if not choices:
            self.error(request, "no choice in the answer")
            return
        self.requests += 1
        choice = choices[0]
        message = choice.get("message") or {}
        content = _text(message.get("content"))
        reasoning = _text(message.get("reasoning_content") or message.get("reasoning"))
        raw_calls = message.get("tool_calls") or ()
        calls = [
            ToolCall(
                str(c.get("id", "")),
                str((c.get("function") or {}).get("name", "")),
                _arguments_text((c.get("function") or {}).get("arguments")),
            )
            for c in raw_calls
        ]
        finish = choice.get("finish_reason") or ""
        if request.expects_call:
            self.tool_calls_expected += 1
            self.tool_calls_returned += bool(calls)
            if not calls:
                self.problems.append(
                    f"live {request.index}: no call under {request.tool_choice}, finish {finish!r}"
                    f", {len(content)} content and {len(reasoning)} reasoning characters"
                )
        elif finish == "length":
            # "auto" may ramble: the model was free not to call, so a cut answer fails nothing.
            self.problems.append(
                f"live {request.index}: auto answer cut by max_tokens ({len(calls)} calls)"
            )
        checked = calls
        if finish == "length" and calls:
            # The budget ended inside the last call: it cannot be complete, and says nothing
            # of the format (tests/e2e/test_tool_call_validity.py counts it apart too).
            checked = calls[:-1]
            self.problems.append(f"live {request.index}: last call cut by max_tokens")
        self.tool_calls += len(checked)
        tools = request.body["tools"]
        if request.named:  # a named tool_choice declares only the named function
            tools = [t for t in tools if t["function"]["name"] == request.named]
        verdicts = validate_tool_calls(checked, tools)
        self.tool_calls_schema_valid += sum(1 for v in verdicts if v.valid)
        for v in verdicts:
            if not v.valid:
                self.problems.append(f"live {request.index}: call {v.name}: {v.reason} {v.message}")
        if (finish == "tool_calls") != bool(calls) and finish != "length":
            self.finish_reason_mismatches += 1
            self.problems.append(f"live {request.index}: finish {finish!r}, {len(calls)} calls")
        if any(m and (m in content or m in reasoning) for m in self.markers):
            self.leaked_markers += 1
            self.problems.append(f"live {request.index}: a marker leaked")
        if any(m and m in content for m in self.reasoning_markers):
            self.reasoning_unseparated += 1

    def fill(self, report: replica_pb2.ConformanceReport) -> None:
        """Writes the counts into `report`'s live fields."""
        report.live_requests = self.requests
        report.live_errors = self.errors
        report.tool_calls_expected = self.tool_calls_expected
        report.tool_calls_returned = self.tool_calls_returned
        report.tool_calls = self.tool_calls
        report.tool_calls_schema_valid = self.tool_calls_schema_valid
        report.finish_reason_mismatches = self.finish_reason_mismatches
        report.leaked_markers = self.leaked_markers
        report.reasoning_unseparated = self.reasoning_unseparated


def _arguments_text(value: Any) -> str:
    """Arguments as the JSON text a call carries (an object from a typed response is dumped)."""
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def family_markers(terminals: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """`(markers, reasoning markers)` of a parser's terminals (`EngineConfig.terminals`):
    all of them, and those named THINK_* (they open and close reasoning)."""
    markers = sorted(set(terminals.values()))
    reasoning = sorted({v for k, v in terminals.items() if k.startswith("THINK")})
    return markers, reasoning
