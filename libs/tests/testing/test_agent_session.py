"""`inferplane.testing.agent_session`: the scripted session's bookkeeping, on a scripted API
session (no stack): what each turn may reuse under the model's template, the checks, compaction,
failed turns and the summary the bench prints."""

from __future__ import annotations

import json
from collections.abc import Sequence

from inferplane.parsers import ToolCall
from inferplane.testing.agent_session import (
    DEFAULT_RESULT,
    TASKS,
    Answer,
    check_answer,
    run_session,
    session_tools,
    summarize,
    tool_result,
)

WEATHER = ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris", "unit": "celsius"}')


def answer(
    *,
    prompt: int,
    cached: int = 0,
    out: int = 30,
    calls: Sequence[ToolCall] = (),
    content: str = "",
    reasoning: str = "thinking",
    finish: str = "stop",
) -> Answer:
    return Answer(content, reasoning, list(calls), finish, prompt, cached, out, 0.01, 0.1)


class ScriptedSession:
    """An `ApiSession` that returns scripted answers and records what the loop did."""

    api = "scripted"

    def __init__(self, answers: Sequence[Answer | Exception]) -> None:
        self.answers = list(answers)
        self.log: list[tuple[str, object]] = []
        self.tasks = 0

    def add_user(self, text: str) -> None:
        self.tasks += 1
        self.log.append(("user", text))

    def add_tool_results(self, results: Sequence[tuple[ToolCall, str]]) -> None:
        self.log.append(("results", [(c.id, text) for c, text in results]))

    def turn(self, max_tokens: int) -> Answer:
        self.log.append(("turn", max_tokens))
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    def drop_oldest_task(self) -> bool:
        if self.tasks < 2:
            return False
        self.tasks -= 1
        self.log.append(("drop", None))
        return True


def test_a_tool_loop_reuses_all_a_new_question_only_up_to_the_finished_tasks_reasoning() -> None:
    """Inside a tool loop a turn may reuse the previous prompt and output (less the last
    token); after the loop's answer and the next question, only the prompt of the finished
    task's first turn with reasoning (where Kimi's and Qwen3's templates start dropping it);
    tool results are the task's scripted ones and the next question is the next task's."""
    session = ScriptedSession(
        [
            answer(prompt=300, calls=[WEATHER]),
            answer(prompt=360, cached=256, content="It is 18 degrees."),
            answer(prompt=390, cached=256, calls=[WEATHER]),
        ]
    )
    turns = run_session(session, turns=3)
    assert session.log == [
        ("user", TASKS[0].question),
        ("turn", 256),
        ("results", [(WEATHER.id, tool_result(TASKS[0], "get_weather"))]),
        ("turn", 256),
        ("user", TASKS[1].question),
        ("turn", 256),
        # A call the task did not expect gets the default result.
        ("results", [(WEATHER.id, DEFAULT_RESULT)]),
    ]
    assert tool_result(TASKS[1], "get_weather") == DEFAULT_RESULT
    assert [(t.reusable, t.template_reusable, t.after_user) for t in turns] == [
        (0, 0, False),
        (329, 329, False),
        (389, 300, True),
    ]
    assert [t.prefix_held(128) for t in turns] == [None, True, True]
    assert turns[1].cached_share == 256 / 360


def test_prefix_held_counts_whole_blocks_and_skips_turns_after_an_open_answer() -> None:
    """The cache serves whole blocks: a turn held its prefix when its cached tokens reach what
    the template keeps, rounded down to the block. After a cut or reasoning-only answer (the
    template closes what the model left open) the turn is not checked."""
    session = ScriptedSession(
        [
            answer(prompt=300, calls=[WEATHER]),
            answer(prompt=400, cached=256, calls=[WEATHER], finish="length", out=256),
            answer(prompt=700, cached=640),
            answer(prompt=720, cached=512, content="ok"),
        ]
    )
    turns = run_session(session, turns=4)
    assert turns[1].template_reusable == 329 and turns[1].prefix_held(128) is True
    assert turns[1].prefix_held(64) is False  # 329 // 64 * 64 = 320 > 256
    assert turns[2].prefix_held(128) is None  # after a cut answer
    assert turns[3].prefix_held(128) is None  # after a reasoning-only answer
    assert turns[1].notes == ["cut by the token limit"]
    assert turns[2].notes == ["reasoning only"]


def test_checks_fail_leaks_and_invalid_calls_but_not_a_cut_last_call() -> None:
    """A marker in content or reasoning and an invalid or undeclared call are problems; the
    last call of an answer cut by the token limit cannot be complete and is only noted."""
    tools = session_tools()
    leak = answer(prompt=10, content="hi <|im_end|>", reasoning="a </think>")
    assert check_answer(leak, tools) == [
        "marker in content: <|im_end|>",
        "marker in reasoning: </think>",
    ]
    bad = ToolCall("functions.get_weather:1", "get_weather", '{"city": 3}')
    undeclared = ToolCall("functions.nope:2", "nope", "{}")
    problems = check_answer(answer(prompt=10, calls=[bad, undeclared]), tools)
    assert [p.split(":")[0] for p in problems] == ["call 0 (get_weather)", "call 1 (nope)"]
    cut = ToolCall("functions.get_weather:1", "get_weather", '{"city": "Pa')
    assert check_answer(answer(prompt=10, calls=[WEATHER, cut], finish="length"), tools) == []
    assert check_answer(answer(prompt=10, calls=[cut, WEATHER], finish="length"), tools) != []


def test_compaction_drops_half_the_older_tasks_and_failed_turns_move_on() -> None:
    """When the next prompt might not fit the context, half of the older tasks go before the
    turn (it is marked, and nothing is reused); a failed request is a turn with the error as
    its problem, and the session moves on to the next task."""
    session = ScriptedSession(
        [
            answer(prompt=100, content="a"),
            answer(prompt=200, content="b"),
            answer(prompt=300, content="c"),
            answer(prompt=950, content="d"),
            RuntimeError("boom"),
            answer(prompt=500, content="e"),
        ]
    )
    turns = run_session(session, turns=6, max_tokens=100, context_tokens=1200)
    # Before turn 5: 950 + 30 + 2 * 100 + 64 > 1200, five tasks held: two dropped.
    assert [t.compacted for t in turns] == [False, False, False, False, True, False]
    assert [e for e in session.log if e[0] == "drop"] == [("drop", None)] * 2
    assert turns[4].answer is None and turns[4].problems[0].endswith("boom")
    assert turns[4].reusable == 0 and turns[5].reusable == 0  # nothing to reuse after either
    assert [t.task for t in turns] == [0, 1, 2, 3, 4, 5]
    summary = summarize("scripted", turns, block=128)
    assert (summary.turns, summary.turns_ok, summary.compactions) == (6, 5, 1)
    assert json.dumps(summary.problems) == '{"request failed after 0.0 s": 1}'
