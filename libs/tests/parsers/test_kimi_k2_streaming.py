"""Delta-level behaviour a streaming client sees: OpenAI chunk mapping, hold-back of partial
markers, end-of-stream flush, and marker matching by token id resolved from a vocab."""

from __future__ import annotations

from inferplane.parsers import (
    KIMI_K2_MARKERS,
    Delta,
    Parser,
    PlainSession,
    ToolCallDelta,
    build_parser,
)

TB, TE = "<think>", "</think>"
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def kimi() -> Parser:
    return build_parser("kimi_k2")


def test_first_fragment_carries_id_and_name_then_only_arguments() -> None:
    """Each call maps onto OpenAI chunks: index 0-based, id + name once, then argument
    fragments that concatenate to the arguments."""
    s = kimi().start(thinking=False)
    out = (
        f"{SB}{CB}functions.get_weather:5{AB}"
        + '{"city": "Tokyo"}'
        + f"{CE}{CB}functions.search:6{AB}"
        + '{"q": "x"}'
        + f"{CE}{SE}"
    )
    frags = [tc for ch in out for tc in s.feed(ch).tool_calls] + s.finish().tool_calls
    firsts = [f for f in frags if f.id is not None]
    assert firsts == [
        ToolCallDelta(0, "functions.get_weather:5", "get_weather", ""),
        ToolCallDelta(1, "functions.search:6", "search", ""),
    ]
    assert all(f.name is None for f in frags if f.id is None)
    assert "".join(f.arguments for f in frags if f.index == 0) == '{"city": "Tokyo"}'
    assert "".join(f.arguments for f in frags if f.index == 1) == '{"q": "x"}'


def test_arguments_stream_before_the_call_ends() -> None:
    """Argument text is streamed as it arrives, not buffered until ``<|tool_call_end|>``."""
    s = kimi().start(thinking=False)
    s.feed(f"{SB}{CB}functions.f:0{AB}")
    d = s.feed('{"text": "hello wor')
    assert d.tool_calls == [ToolCallDelta(0, None, None, '{"text": "hello wor')]


def test_one_feed_gives_at_most_one_fragment_per_call() -> None:
    """Fragments of one call produced in one feed are merged (one chunk entry per index)."""
    d = kimi().start(thinking=False).feed(f"{SB}{CB}functions.f:0{AB}" + '{"a": 1}' + CE)
    assert d.tool_calls == [ToolCallDelta(0, "functions.f:0", "f", '{"a": 1}')]


def test_partial_marker_is_held_back_until_resolved() -> None:
    """A delta ending in what may be the start of a marker shows nothing of it yet."""
    s = kimi().start(thinking=True)
    assert s.feed("Let me think <|tool_calls_sec") == Delta(reasoning="Let me think")
    d = s.feed("tion_begin|>")
    assert d.is_empty  # reasoning ended by the section; the held space is dropped
    assert s.state == "section"


def test_held_text_that_is_not_a_marker_is_released() -> None:
    s = kimi().start(thinking=False)
    assert s.feed("I <").content == "I"
    assert s.feed("3 you").content == " <3 you"


def test_finish_flushes_held_text() -> None:
    s = kimi().start(thinking=False)
    assert s.feed("x <|tool_call").content == "x"
    assert s.finish().content == " <|tool_call"


def test_trailing_whitespace_is_released_when_more_text_follows() -> None:
    s = kimi().start(thinking=False)
    assert s.feed("a \n").content == "a"
    assert s.feed("b").content == " \nb"
    assert s.feed("  ").content == ""
    assert s.finish().is_empty


def test_feed_after_finish_is_ignored() -> None:
    s = kimi().start()
    s.feed("r")
    s.finish()
    assert s.feed("more</think>text").is_empty
    assert s.finish().is_empty


def test_reasoning_end_persists_across_deltas() -> None:
    """Once reasoning ended on the tool section, no later delta is reasoning."""
    s = kimi().start(thinking=True)
    deltas = [
        s.feed("plan"),
        s.feed(SB),
        s.feed(f"{CB}functions.f:0{AB}{{}}{CE}"),
        s.feed(SE),
        s.feed(TE),
        s.feed("tail"),
        s.finish(),
    ]
    assert [d.reasoning for d in deltas] == ["plan", "", "", "", "", "", ""]
    assert all(not d.content for d in deltas)


def _vocab(offset: int) -> dict[str, int]:
    """A fixture-like vocab: marker ids are whatever this tokenizer says, never Kimi's."""
    vocab = {chr(c): c for c in range(32, 127)}
    for i, m in enumerate(KIMI_K2_MARKERS):
        vocab[m] = offset + i
    return vocab


def test_marker_ids_are_resolved_from_the_vocab() -> None:
    p = build_parser("kimi_k2", vocab=_vocab(1000))
    assert p.marker_token_ids == {m: 1000 + i for i, m in enumerate(KIMI_K2_MARKERS)}
    assert build_parser("kimi_k2").marker_token_ids == {}


def test_token_ids_distinguish_marker_tokens_from_spelled_text() -> None:
    """With token ids, only a marker's own token is a marker; the same characters produced
    by ordinary tokens stay text (here: inside a JSON string argument)."""
    vocab = _vocab(500)
    ids = {m: vocab[m] for m in KIMI_K2_MARKERS}
    p = build_parser("kimi_k2", vocab=vocab)
    s = p.start(thinking=True)
    deltas = [s.feed("plan", [ord(c) for c in "plan"]), s.feed(TE, [ids[TE]])]
    deltas.append(s.feed(SB, [ids[SB]]))
    deltas.append(s.feed(CB, [ids[CB]]))
    deltas.append(s.feed("functions.f:0", [ord(c) for c in "functions.f:0"]))
    deltas.append(s.feed(AB, [ids[AB]]))
    spelled = '{"doc": "ends with ' + CE + '"}'
    deltas.append(s.feed(spelled, [ord(c) for c in spelled]))
    deltas.append(s.feed(CE, [ids[CE]]))
    deltas.append(s.feed(SE, [ids[SE]]))
    deltas.append(s.finish())
    res = p.collect(deltas)
    assert res.reasoning == "plan"
    assert [(c.name, c.arguments) for c in res.tool_calls] == [("f", spelled)]


def test_token_ids_one_token_per_delta_matches_text_mode() -> None:
    """Fed one token per delta with ids, the result equals text-only parsing."""
    vocab = _vocab(200)
    p = build_parser("kimi_k2", vocab=vocab)
    out = f"r{TE}c{SB}{CB}functions.f:0{AB}" + '{"a": "<|x"}' + f"{CE}{SE}"
    pieces: list[tuple[str, int]] = []
    i = 0
    while i < len(out):
        m = next((m for m in KIMI_K2_MARKERS if out.startswith(m, i)), None)
        if m is not None:
            pieces.append((m, vocab[m]))
            i += len(m)
        else:
            pieces.append((out[i], ord(out[i])))
            i += 1
    s = p.start()
    res = p.collect([*(s.feed(t, [tid]) for t, tid in pieces), s.finish()])
    assert res == build_parser("kimi_k2").parse(out)


def test_vocab_missing_a_marker_falls_back_to_text_matching() -> None:
    """If the tokenizer lacks a marker token, markers are matched as text (never leaked)."""
    vocab = _vocab(300)
    del vocab[CE]
    p = build_parser("kimi_k2", vocab=vocab)
    assert p.marker_token_ids == {}
    out = f"{TE}{SB}{CB}functions.f:0{AB}{{}}{CE}{SE}"
    s = p.start()
    res = p.collect([s.feed(out, [1, 2, 3]), s.finish()])
    assert [(c.name, c.arguments) for c in res.tool_calls] == [("f", "{}")]
    assert not res.marker_leaked


def test_reasoning_tokens_count_ids_fed_in_reasoning_end_marker_included() -> None:
    """``reasoning_tokens`` counts the ids of every feed that starts in reasoning: the
    reasoning text and ``</think>`` count, content and call tokens do not."""
    vocab = _vocab(700)
    p = build_parser("kimi_k2", vocab=vocab)
    s = p.start(thinking=True)
    for t in "plan it":
        s.feed(t, [ord(t)])
    s.feed(TE, [vocab[TE]])
    for t in "ok":
        s.feed(t, [ord(t)])
    s.feed(SB, [vocab[SB]])
    s.finish()
    assert s.reasoning_tokens == len("plan it") + 1
    assert s.result().reasoning == "plan it" and s.result().content == "ok"


def test_reasoning_tokens_are_zero_without_reasoning_or_without_ids() -> None:
    p = build_parser("kimi_k2", vocab=_vocab(800))
    off = p.start(thinking=False)
    off.feed("answer", [ord(c) for c in "answer"])
    assert off.reasoning_tokens == 0
    text_only = p.start(thinking=True)
    text_only.feed(f"plan{TE}answer")
    assert text_only.reasoning_tokens == 0


def test_result_so_far_grows_with_the_stream_and_is_stable_after_finish() -> None:
    s = kimi().start(thinking=True)
    s.feed("plan")
    assert s.result().reasoning == "plan"
    s.feed(f" more{TE}an")
    assert (s.result().reasoning, s.result().content) == ("plan more", "an")
    s.feed("swer")
    s.finish()
    assert s.result() is s.result()
    assert s.result().content == "answer"


def test_plain_session_is_verbatim_content() -> None:
    """No format: every text is content as is (whitespace and marker-like text included)."""
    s = PlainSession()
    deltas = [s.feed(" a "), s.feed(""), s.feed(f"{TE}\n", [1, 2]), s.finish()]
    assert [d.content for d in deltas] == [" a ", "", f"{TE}\n", ""]
    res = s.result()
    assert (res.reasoning, res.content, res.tool_calls) == ("", f" a {TE}\n", [])
    assert (s.reasoning_tokens, s.dropped_tool_calls) == (0, 0)
    assert s.feed("late").is_empty and s.result().content == f" a {TE}\n"
