"""A scripted agent session through the edge (issue 27 §8): a growing history of user tasks,
the model's answers as each API returned them (reasoning, text, tool calls), scripted tool
results, and per turn the checks an agent depends on.

    session = ChatSession(openai.OpenAI(base_url=..., api_key=...), "kimi-tiny")
    turns = run_session(session, turns=100)        # -> [TurnResult, ...]
    summary = summarize(turns)                     # turns ok, cached share p50, TTFT

One turn is one API request. The conversation is a cycle of tasks phrased as kimi-tiny was
trained (`TASKS`: weather, time, currency, search, files, an event, a question needing no tool);
after an answer with tool calls each call gets its scripted result (`tool_result`), after a
plain answer the next task's question follows. The three APIs' clients live in
`inferplane.testing.agent_apis`; each keeps its own native history (chat messages, Anthropic
content blocks, Responses items) and sends back exactly what the API returned.

Checks per turn (`TurnResult.problems`; a turn is ok when there is none): the request
succeeded; no chat-template or parser marker in the content or reasoning (`MARKERS`); every
tool call names a declared tool and its arguments are a JSON object valid against its schema
(`inferplane.parsers.validate_tool_calls`). What the model chose to write is noted, not failed
(`TurnResult.notes`): an answer cut by the token limit (its last call, which the cut may have
left incomplete, is counted apart as bench/tool_call_validity.py does), an answer of reasoning
only (the fixture model, trained on short chats, often ends a long history inside its
reasoning).

The prefix cache: `TurnResult.cached_share` is the share of the turn's prompt tokens the API
reported as served from the cache (`prompt_tokens_details.cached_tokens`,
`cache_read_input_tokens`, `input_tokens_details.cached_tokens`). Each turn also records how
many tokens the cache could serve: `reusable` if the whole history rendered as generated (the
previous prompt and output, less the last output token, whose KV was never computed), and
`template_reusable` under the model's own template: the same inside a tool loop, but right
after a new user message (`after_user`) only the prompt of the finished task's first turn with
reasoning, because the Kimi K2 and Qwen3 templates drop the reasoning of turns before the last
user message (services/replica/tests/test_prefix_stable_history.py pins where). The engine
caches whole blocks (`prefix_held` takes the block size), so a turn held its prefix when the
cached tokens reach `template_reusable` rounded down to a block. Not checked: the turn after a
cut or reasoning-only answer (the template closes what the model left open) or a compaction.

When the history would not fit `context_tokens`, the oldest tasks are dropped before the turn
(`TurnResult.compacted`), as an agent compacts its context; that turn's prefix is new.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from inferplane.fixtures import kimi_tiny
from inferplane.parsers import (
    KIMI_K2_MARKER_VARIANTS,
    KIMI_K2_MARKERS,
    QWEN3_MARKERS,
    ToolCall,
    validate_tool_calls,
)

MARKERS: tuple[str, ...] = tuple(
    dict.fromkeys(
        (
            *KIMI_K2_MARKERS,
            *KIMI_K2_MARKER_VARIANTS,
            *QWEN3_MARKERS,
            "<|im_end|>",
            "<|im_start|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|endoftext|>",
            "<think>",
        )
    )
)
"""Chat-template and parser markers of the Kimi K2 and Qwen3 families: none may appear in an
answer's content or reasoning."""


@dataclass(frozen=True)
class Task:
    """One user task: the question, and each tool's scripted result (JSON text)."""

    question: str
    results: Mapping[str, str] = field(default_factory=dict)


def _json(value: Any) -> str:
    return json.dumps(value)  # ", " and ": ", as the fixture's training results are written


TASKS: tuple[Task, ...] = (
    Task(
        "What is the weather in Paris?",
        {"get_weather": _json({"temperature": 18, "condition": "cloudy"})},
    ),
    Task("What time is it in Oslo?", {"get_time": _json({"time": "09:30"})}),
    Task("Convert 12.5 USD to EUR.", {"convert_currency": _json({"result": 11.4})}),
    Task("Search the web for rust async runtimes.", {"web_search": _json({"count": 3})}),
    Task("Tell me something about Paris."),
    Task("List the files in the workspace.", {"list_files": _json({"files": ["main.py"]})}),
    Task(
        "Schedule design review on 2025-03-14 at 09:30 with Ana and Bo.",
        {"create_event": _json({"status": "created", "id": "evt_7"})},
    ),
    Task("What is the weather in Tokyo?", {"get_weather": _json({"temperature": 21})}),
    Task("What time is it in Lima?", {"get_time": _json({"time": "14:05"})}),
)
"""The session's tasks, in order, repeated: phrasings of kimi-tiny's training data
(`inferplane.fixtures.kimi_tiny`), on which it calls the right tool."""

DEFAULT_RESULT = _json({"status": "ok"})
"""The result of a call to a tool the current task did not expect."""


def tool_result(task: Task, name: str) -> str:
    """The scripted result of a call to `name` during `task`."""
    return task.results.get(name, DEFAULT_RESULT)


def session_tools() -> list[dict[str, Any]]:
    """The session's tools, as OpenAI chat `tools`: the fixture's six functions."""
    return kimi_tiny.tools()


@dataclass
class Answer:
    """What one API request returned, in the API's own terms reduced to what the checks read.

    `calls` hold the API's call ids and argument JSON text (Anthropic's `input` re-encoded).
    Token counts are the API's usage: `prompt_tokens` is the whole prompt (for Anthropic
    `input_tokens` + `cache_read_input_tokens` + `cache_creation_input_tokens`),
    `cached_tokens` the part served from the prefix cache. `ttft` is seconds from sending the
    request to the first streamed content, reasoning or tool-call delta (NaN when none came).
    """

    content: str
    reasoning: str
    calls: list[ToolCall]
    finish: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft: float
    e2e: float


class ApiSession(Protocol):
    """One API's client with its native history (see `inferplane.testing.agent_apis`)."""

    api: str

    def add_user(self, text: str) -> None:
        """Appends a user message (a new task)."""

    def add_tool_results(self, results: Sequence[tuple[ToolCall, str]]) -> None:
        """Appends the results of the last answer's calls, in order."""

    def turn(self, max_tokens: int) -> Answer:
        """Sends the history, appends the answer as the API returned it, returns it.

        Raises: whatever the SDK raises for a failed request."""

    def drop_oldest_task(self) -> bool:
        """Removes the oldest task (its user message through the message before the next
        task's); False when only the current task is left."""


@dataclass
class TurnResult:
    """One turn's outcome. `problems` lists what failed (empty: the turn is ok)."""

    index: int
    task: int
    answer: Answer | None
    problems: list[str]
    notes: list[str] = field(default_factory=list)
    reusable: int = 0
    template_reusable: int = 0
    after_user: bool = False
    compacted: bool = False
    checks_prefix: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def cached_share(self) -> float:
        """Cached prompt tokens / prompt tokens (NaN without an answer)."""
        if self.answer is None or not self.answer.prompt_tokens:
            return float("nan")
        return self.answer.cached_tokens / self.answer.prompt_tokens

    def prefix_held(self, block: int) -> bool | None:
        """Whether the cache served every whole `block` of `template_reusable` (None: not
        checked for this turn, see the module's docstring)."""
        if not self.checks_prefix or self.answer is None:
            return None
        return self.answer.cached_tokens >= self.template_reusable // block * block


CUT = frozenset({"length", "max_tokens", "incomplete"})
"""Finish reasons (chat, Messages, Responses) of an answer cut by the token limit."""


def check_answer(answer: Answer, tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The problems of one answer: leaked markers, invalid tool calls."""
    problems = []
    for where, text in (("content", answer.content), ("reasoning", answer.reasoning)):
        leaked = [m for m in MARKERS if m in text]
        if leaked:
            problems.append(f"marker in {where}: {', '.join(leaked)}")
    cut = answer.finish in CUT
    for verdict in validate_tool_calls(answer.calls, tools):
        # The last call of an answer cut by the token limit cannot be complete: counted apart
        # (answer_notes), as bench/tool_call_validity.py counts it.
        if not verdict.valid and not (cut and verdict.index == len(answer.calls) - 1):
            problems.append(f"call {verdict.index} ({verdict.name}): {verdict.reason}")
    return problems


def answer_notes(answer: Answer) -> list[str]:
    """What is worth knowing about an answer but is the model's choice, not a failure."""
    notes = []
    if answer.finish in CUT:
        notes.append("cut by the token limit")
        if answer.calls and not validate_tool_calls(answer.calls[-1:], session_tools())[0].valid:
            notes.append("its last call cut")
    if not answer.calls and not answer.content:
        notes.append("reasoning only")
    return notes


def run_session(
    session: ApiSession,
    *,
    turns: int,
    max_tokens: int = 256,
    context_tokens: int | None = None,
    first_task: int = 0,
    on_turn: Callable[[TurnResult], None] | None = None,
) -> list[TurnResult]:
    """Runs `turns` API requests of the scripted session on `session`, from `TASKS[first_task]`
    on (sessions on one engine that start at different tasks share no cached prefix beyond the
    tools, so each measures its own).

    Before a turn whose prompt might not fit `context_tokens` (the last prompt + its output +
    the next message + `max_tokens`, estimated from the previous turn's usage plus a margin),
    half of the older tasks are dropped. A failed request is recorded as a turn with the error
    as its problem; the session then moves on to the next task.
    """
    tools = session_tools()
    results: list[TurnResult] = []
    task_index = first_task
    session.add_user(TASKS[task_index % len(TASKS)].question)
    held = 1  # tasks in the history
    new_user = False
    previous: Answer | None = None
    previous_notes: list[str] = []
    task_reasoning_prompt: int | None = None  # the task's first turn with reasoning: its prompt
    finished_reasoning_prompt: int | None = None
    for index in range(turns):
        compacted = False
        if context_tokens and previous is not None:
            need = previous.prompt_tokens + previous.completion_tokens + 2 * max_tokens + 64
            if need > context_tokens:
                # Half of the older tasks go at once, so compactions stay rare (as an agent's).
                for _ in range(max(1, held // 2)):
                    if session.drop_oldest_task():
                        held -= 1
                        compacted = True
        result = TurnResult(index, task_index, None, [], compacted=compacted)
        if previous is not None and not compacted:
            result.reusable = previous.prompt_tokens + previous.completion_tokens - 1
            result.template_reusable = result.reusable
            if new_user and finished_reasoning_prompt is not None:
                result.after_user = True
                result.template_reusable = finished_reasoning_prompt
            result.checks_prefix = not previous_notes
        started = time.perf_counter()
        try:
            answer = session.turn(max_tokens)
        except Exception as exc:  # a failed turn is a result, not the end of the session
            result.problems.append(
                f"request failed after {time.perf_counter() - started:.1f} s: {exc}"
            )
            answer = None
        result.answer = answer
        if answer is not None:
            result.problems += check_answer(answer, tools)
            result.notes += answer_notes(answer)
        results.append(result)
        if on_turn is not None:
            on_turn(result)
        previous, previous_notes = answer, result.notes
        if answer is not None and answer.reasoning and task_reasoning_prompt is None:
            task_reasoning_prompt = answer.prompt_tokens
        task = TASKS[task_index % len(TASKS)]
        if answer is not None and answer.calls:
            session.add_tool_results([(c, tool_result(task, c.name)) for c in answer.calls])
            new_user = False
        else:
            finished_reasoning_prompt, task_reasoning_prompt = task_reasoning_prompt, None
            task_index += 1
            session.add_user(TASKS[task_index % len(TASKS)].question)
            held += 1
            new_user = True
    return results


@dataclass(frozen=True)
class Summary:
    """A session's figures. Shares and TTFTs are over turns with an answer; `cached_share_p50`
    counts turns from the second on (the first has nothing to reuse)."""

    api: str
    turns: int
    turns_ok: int
    cached_share_p50: float
    cached_share_p50_in_loop: float
    cached_share_p50_after_user: float
    ttft_p50: float
    ttft_p90: float
    compactions: int
    prefix_checked: int
    prefix_held: int
    reasoning_dropped_tokens: int
    prompt_tokens: int
    problems: Mapping[str, int]
    notes: Mapping[str, int]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(api: str, turns: Sequence[TurnResult], *, block: int) -> Summary:
    """The figures of one session (see `Summary`); `block` is the engine's KV block size in
    tokens (`TurnResult.prefix_held`). `reasoning_dropped_tokens` counts the prompt tokens
    that the template's dropping of earlier reasoning made the engine compute again."""
    later = [t for t in turns[1:] if t.answer is not None and t.answer.prompt_tokens]
    problems: dict[str, int] = {}
    notes: dict[str, int] = {}
    for t in turns:
        for p in t.problems:
            key = p.split(":")[0]
            problems[key] = problems.get(key, 0) + 1
        for n in t.notes:
            notes[n] = notes.get(n, 0) + 1
    ttfts = [
        t.answer.ttft for t in turns if t.answer is not None and t.answer.ttft == t.answer.ttft
    ]
    return Summary(
        api=api,
        turns=len(turns),
        turns_ok=sum(t.ok for t in turns),
        cached_share_p50=_median([t.cached_share for t in later]),
        cached_share_p50_in_loop=_median(
            [t.cached_share for t in later if not t.after_user and not t.compacted]
        ),
        cached_share_p50_after_user=_median([t.cached_share for t in later if t.after_user]),
        ttft_p50=_median(ttfts),
        ttft_p90=_quantile(ttfts, 0.9),
        compactions=sum(t.compacted for t in turns),
        prefix_checked=sum(t.prefix_held(block) is not None for t in turns),
        prefix_held=sum(t.prefix_held(block) is True for t in turns),
        reasoning_dropped_tokens=sum(t.reusable - t.template_reusable for t in turns),
        prompt_tokens=sum(t.answer.prompt_tokens for t in turns if t.answer is not None),
        problems=problems,
        notes=notes,
    )
