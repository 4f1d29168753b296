"""Live conformance requests (`live_requests`: seeded, tool_choice in turn, valid bounded
schemas) and their scoring (`LiveTally`: each K2 Vendor Verifier counter can fail)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.conformance import (
    AUTO_MAX_TOKENS,
    FORCED_MAX_TOKENS,
    LiveRequest,
    LiveTally,
    family_markers,
    live_requests,
)
from inferplane.parsers import build_parser

MARKERS, REASONING = family_markers(build_parser("kimi_k2").config.terminals)


def _leaves(schema: Any, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    if not isinstance(schema, dict):
        return []
    found = [schema] if schema.get("type") in kinds and "enum" not in schema else []
    for child in (schema.get("properties") or {}).values():
        found += _leaves(child, kinds)
    return found + _leaves(schema.get("items"), kinds)


def test_same_seed_same_requests_other_seed_others() -> None:
    first = [r.body for r in live_requests(12, 7)]
    assert first == [r.body for r in live_requests(12, 7)]
    assert first != [r.body for r in live_requests(12, 8)]
    assert [r.body for r in live_requests(5, 7)] == first[:5]  # a prefix, not a reshuffle


def test_choices_in_turn_with_declared_names_and_valid_bounded_schemas() -> None:
    requests = live_requests(30, 1)
    assert [r.tool_choice for r in requests[:6]] == ["auto", "required", "named"] * 2
    for r in requests:
        names = [t["function"]["name"] for t in r.body["tools"]]
        assert 1 <= len(names) <= 3 and len(set(names)) == len(names)
        if r.tool_choice == "named":
            assert r.body["tool_choice"] == {"type": "function", "function": {"name": r.named}}
            assert r.named in names
        else:
            assert r.body["tool_choice"] == r.tool_choice and not r.named
        for tool in r.body["tools"]:
            params = tool["function"]["parameters"]
            jsonschema.Draft202012Validator.check_schema(params)
            assert params["type"] == "object" and params["properties"]
            assert all(0 < s["maxLength"] <= 16 for s in _leaves(params, ("string",)))
            for n in _leaves(params, ("integer", "number")):
                assert n["minimum"] <= n["maximum"]
        assert r.body["temperature"] == 0


def test_max_tokens_is_bounded_forced_calls_above_auto() -> None:
    """Every drawn body's `max_tokens` is the cap of its choice, so 12 requests write at most
    4 x 256 + 8 x 512 completion tokens (the live phase's bound, module docstring)."""
    assert (AUTO_MAX_TOKENS, FORCED_MAX_TOKENS) == (256, 512)
    for seed in range(20):
        requests = live_requests(12, seed, "thinking")
        for r in requests:
            cap = FORCED_MAX_TOKENS if r.expects_call else AUTO_MAX_TOKENS
            assert r.body["max_tokens"] == cap
        assert sum(r.body["max_tokens"] for r in requests) == 5120


def test_thinking_on_every_other_auto_round_off_for_forced_calls() -> None:
    requests = live_requests(12, 3, "thinking")
    assert [r.thinking for r in requests] == [True, False, False, False, False, False] * 2
    assert [r.body["chat_template_kwargs"] for r in requests[:2]] == [
        {"thinking": True},
        {"thinking": False},
    ]
    # Without a family switch the body leaves thinking to the template; the rest is the same.
    plain = live_requests(12, 3)
    assert all("chat_template_kwargs" not in r.body for r in plain)
    assert [r.body["tools"] for r in plain] == [r.body["tools"] for r in requests]


def test_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="live requests"):
        live_requests(-1, 0)


def _request(choice: str) -> LiveRequest:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}},
    ]
    named = "get_weather" if choice == "named" else ""
    return LiveRequest(0, {"tools": tools, "tool_choice": choice}, choice, named)


def _answer(
    calls: list[tuple[str, Any]] = (),  # type: ignore[assignment]
    finish: str | None = None,
    content: str | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    tool_calls = [
        {"id": f"functions.{n}:{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "choices": [
            {"message": message, "finish_reason": finish or ("tool_calls" if calls else "stop")}
        ]
    }


def _tally() -> LiveTally:
    return LiveTally(markers=MARKERS, reasoning_markers=REASONING)


def _report(tally: LiveTally) -> replica_pb2.ConformanceReport:
    report = replica_pb2.ConformanceReport()
    tally.fill(report)
    return report


GOOD_CALL = ("get_weather", json.dumps({"city": "Paris"}))


def test_a_good_answer_counts_everywhere_and_fails_nothing() -> None:
    tally = _tally()
    tally.add(_request("required"), _answer([GOOD_CALL], reasoning="think", content="ok"))
    tally.add(_request("auto"), _answer(content="It is sunny."))
    report = _report(tally)
    assert (report.live_requests, report.live_errors) == (2, 0)
    assert (report.tool_calls_expected, report.tool_calls_returned) == (1, 1)
    assert (report.tool_calls, report.tool_calls_schema_valid) == (1, 1)
    assert report.finish_reason_mismatches == report.leaked_markers == 0
    assert report.reasoning_unseparated == 0


def test_no_call_under_required_or_named_is_a_call_not_returned() -> None:
    tally = _tally()
    tally.add(_request("required"), _answer(content="no"))
    tally.add(_request("named"), _answer(content="no"))
    report = _report(tally)
    assert (report.tool_calls_expected, report.tool_calls_returned) == (2, 0)


@pytest.mark.parametrize(
    ("choice", "call"),
    [
        ("required", ("get_weather", '{"city": 3}')),  # schema mismatch
        ("required", ("get_weather", '{"city": "Paris"')),  # not JSON
        ("required", ("get_weather", '["Paris"]')),  # not an object
        ("required", ("lookup", '{"city": "Paris"}')),  # undeclared
        ("named", ("other", "{}")),  # declared, but not the named one
    ],
)
def test_an_invalid_call_is_not_schema_valid(choice: str, call: tuple[str, str]) -> None:
    tally = _tally()
    tally.add(_request(choice), _answer([call]))
    report = _report(tally)
    assert (report.tool_calls, report.tool_calls_schema_valid) == (1, 0)
    assert report.tool_calls_returned == 1  # returned, though invalid
    assert tally.problems


@pytest.mark.parametrize(
    ("calls", "finish", "mismatch"),
    [
        ([GOOD_CALL], "stop", 1),
        ([], "tool_calls", 1),
        ([GOOD_CALL], "tool_calls", 0),
        ([], "stop", 0),
        ([GOOD_CALL], "length", 0),  # cut: neither
    ],
)
def test_finish_reason_mismatches(calls: list[Any], finish: str, mismatch: int) -> None:
    tally = _tally()
    tally.add(_request("auto"), _answer(calls, finish=finish))
    assert _report(tally).finish_reason_mismatches == mismatch


def test_a_call_cut_by_max_tokens_is_returned_but_not_checked() -> None:
    tally = _tally()
    tally.add(_request("required"), _answer([GOOD_CALL, ("get_weather", '{"ci')], "length"))
    report = _report(tally)
    assert (report.tool_calls_expected, report.tool_calls_returned) == (1, 1)
    assert (report.tool_calls, report.tool_calls_schema_valid) == (1, 1)
    assert report.finish_reason_mismatches == 0


def test_a_forced_answer_cut_before_its_call_is_a_call_not_returned() -> None:
    """A forced call the model never finished (cut by max_tokens inside its arguments, where
    the parser returns nothing) stays visible: a call not returned, and a problem line."""
    tally = _tally()
    tally.add(_request("required"), _answer(content="", finish="length"))
    tally.add(_request("named"), _answer([GOOD_CALL], "tool_calls"))
    report = _report(tally)
    assert (report.tool_calls_expected, report.tool_calls_returned) == (2, 1)
    assert report.live_errors == 0 and report.finish_reason_mismatches == 0
    assert any("no call under required, finish 'length'" in p for p in tally.problems)


def test_an_auto_answer_cut_by_max_tokens_counts_against_nothing() -> None:
    tally = _tally()
    tally.add(_request("auto"), _answer(content="jazz " * 50, finish="length"))
    report = _report(tally)
    assert (report.tool_calls_expected, report.tool_calls_returned, report.tool_calls) == (
        0,
        0,
        0,
    )
    assert report.live_errors == 0 and report.finish_reason_mismatches == 0
    assert tally.problems == ["live 0: auto answer cut by max_tokens (0 calls)"]


def test_markers_in_content_or_reasoning_leak_and_think_markers_in_content_unseparate() -> None:
    tally = _tally()
    tally.add(_request("auto"), _answer(content="x <|tool_call_begin|> y"))
    tally.add(_request("auto"), _answer(reasoning="a <|tool_calls_section_begin|>"))
    tally.add(_request("auto"), _answer(content="thought</think>answer"))
    report = _report(tally)
    assert report.leaked_markers == 3
    assert report.reasoning_unseparated == 1


def test_errors_count_as_failed_and_expected_calls_not_returned() -> None:
    tally = _tally()
    tally.error(_request("required"), "timeout")
    tally.add(_request("auto"), {"choices": []})
    report = _report(tally)
    assert (report.live_requests, report.live_errors) == (2, 2)
    assert (report.tool_calls_expected, report.tool_calls_returned) == (1, 0)
