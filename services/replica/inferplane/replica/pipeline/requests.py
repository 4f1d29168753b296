"""OpenAI request → what the engine runs: validation (400s naming `param`), rendering,
sampling parameters and the decoding constraint.

What inferplane supports, and what it rejects with a clear 400 (OpenAI's
`invalid_request_error`; `code` "unsupported_parameter" for features it does not serve):

- `n` 1 to 8 (`MAX_CHOICES`; each choice is its own engine request); `logprobs` (chat: a
  bool, with `top_logprobs` 0 to 20; text: 0 to 20 alternatives); `suffix` is rejected;
- vLLM's extra fields follow `pipeline/fields.py` (honoured, ignored or refused, each with its
  reason; docs/request-fields.md): `stop_token_ids`, `include_stop_str_in_output`,
  `structured_outputs` / `guided_*` (`pipeline/structured.py`), `include_reasoning`,
  `stream_options.continuous_usage_stats`, a message's `reasoning` (vLLM >= 0.16's name for
  `reasoning_content`) are honoured;
- ranges follow OpenAI's API reference: temperature 0..2, top_p in (0, 1], presence and
  frequency penalties -2..2, logit_bias values -100..100 on token ids of the vocabulary;
- `max_completion_tokens` wins over the deprecated `max_tokens`; the default is the rest of the
  context for chat and 16 for text completions (OpenAI's default); prompt + max tokens beyond
  the context length is `context_length_exceeded`, worded as OpenAI words it;
- `response_format`: `text`, `json_object` and `json_schema` (mapped to a decoding
  constraint; with thinking on, the JSON follows the reasoning, see `_json_constraint`);
- `tool_choice`: `none` (tools are left out of the prompt and no tool call is returned; the same
  without `tools`: a tool section the model writes anyway is dropped, never a call), `auto`
  (constrained when the deployment profile's `constrain_tool_choice_auto` is on), `required` and
  a named function (always constrained; all three with `build_tool_constraint`);
- `reasoning_effort`: "none" turns thinking off, the other levels leave it on (the model has no
  finer budget): it sets the model family's thinking keyword (`chat_template_kwargs.thinking`
  for Kimi, `enable_thinking` for Qwen3; `inferplane.chat.ChatFamily`), and an explicit value
  there wins; a model without a known thinking keyword ignores it;
- `stream_interval` (vLLM's extension, 1..1024): at least that many generated tokens per
  streamed chunk after the first; the replica's profile value is the floor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.chat import ChatFamily, ChatRenderError, RenderedPrompt, render_chat
from inferplane.parsers import (
    CallSyntax,
    ConstraintError,
    build_json_constraint,
    build_tool_constraint,
    unenforced_keyword,
)
from inferplane.promptsize import check_prompt_size
from inferplane.replica.engines.base import EngineConstraint, SamplingParams
from inferplane.replica.pipeline import structured
from inferplane.replica.pipeline.assets import ModelAssets
from inferplane.replica.pipeline.fields import CHAT_FIELDS, refuse_unserved
from inferplane.replica.pipeline.schemas import check_compiles
from inferplane.runtime import InvalidArgumentError, UnavailableError
from inferplane.wire import chat_request_to_dict

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_STREAM_INTERVAL = 1024  # tokens per streamed chunk; more is a unary response in disguise
MAX_CHOICES = 8  # `n`: each choice costs a whole generation
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's top_logprobs bound, vLLM's max_logprobs


@dataclasses.dataclass(frozen=True, slots=True)
class Reporting:
    """How the response reports, shared by chat and text completions.

    Attributes:
        n: the number of choices (each its own engine request).
        logprobs: the request asked for log probabilities (their count is
            `SamplingParams.logprobs`).
        continuous_usage: `stream_options.continuous_usage_stats`: every chunk carries the
            usage so far (vLLM's extension).
        tokens_as_ids: `return_tokens_as_token_ids`: logprob tokens are "token_id:{id}".
        include_reasoning: False leaves reasoning out of a chat response.
    """

    n: int = 1
    logprobs: bool = False
    continuous_usage: bool = False
    tokens_as_ids: bool = False
    include_reasoning: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class ChatPlan:
    """A validated chat request, ready to generate.

    Attributes:
        prompt: the rendered prompt (text, token ids, thinking).
        params: the engine's sampling parameters.
        tools: the request's tools as OpenAI JSON (the parser resolves names and coerces
            arguments against them; the response's calls are validated against them).
        tool_calls_allowed: False for `tool_choice: "none"` or without tools (calls are
            dropped from the output).
        history_tool_calls: tool calls earlier in the conversation (the parser numbers ids).
        include_usage: `stream_options.include_usage`.
        report: how the response reports (choices, logprobs, usage on chunks).
        max_tool_calls: 1 for `parallel_tool_calls: false` (later calls are dropped, also
            when no decoding constraint enforces it), else None.
        calls_constrained: the engine decodes tool calls under the tool structural tag (their
            arguments are valid JSON by construction; the parser then keeps a marker inside a
            JSON string as data).
    """

    prompt: RenderedPrompt
    params: SamplingParams
    tools: tuple[Mapping[str, Any], ...]
    tool_calls_allowed: bool
    history_tool_calls: int
    include_usage: bool
    report: Reporting = dataclasses.field(default_factory=Reporting)
    max_tool_calls: int | None = None
    calls_constrained: bool = False


def _bad(message: str, param: str | None, code: str = "invalid_value") -> InvalidArgumentError:
    return InvalidArgumentError(message, param=param, code=code)


def _number(
    body: Mapping[str, Any], name: str, lo: float, hi: float, *, lo_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number", name)
    if value < lo or value > hi or (lo_open and value == lo):
        low = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise _bad(f"'{name}' must be {low} and at most {hi}; got {value}", name)
    return float(value)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("'stop' must be a non-empty string or an array of non-empty strings", "stop")
    return tuple(stop)


def _logit_bias(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if not bias:
        return ()
    if not isinstance(bias, Mapping):
        raise _bad("'logit_bias' must map token ids to numbers", "logit_bias")
    out: list[tuple[int, float]] = []
    for key, value in bias.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise _bad(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise _bad(f"logit_bias token id {tid} is outside the vocabulary", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(f"logit_bias value for {tid} must be a number", "logit_bias")
        if not -100 <= value <= 100:
            raise _bad(f"logit_bias value for {tid} must be between -100 and 100", "logit_bias")
        out.append((tid, float(value)))
    return tuple(out)


def _positive_int(body: Mapping[str, Any], name: str, *, minimum: int = 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(f"'{name}' must be an integer of at least {minimum}", name)
    return value


def _common_checks(body: Mapping[str, Any], rules: Mapping[str, Any]) -> int:
    """Refuses what the field policy refuses; returns `n`."""
    refuse_unserved(body, rules)
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise _bad(f"'n' must be an integer from 1 to {MAX_CHOICES}", "n")
    return n


def _stop_token_ids(body: Mapping[str, Any], vocab_size: int) -> tuple[int, ...]:
    ids = body.get("stop_token_ids") or ()
    for tid in ids:
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
            raise _bad(f"stop_token_ids: {tid!r} is not a token id of the model", "stop_token_ids")
    return tuple(int(t) for t in ids)


def _logprobs_count(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise _bad(f"'{param}' must be an integer from 0 to {MAX_LOGPROBS}", param)
    return value


def _reporting(body: Mapping[str, Any], n: int, logprobs: bool) -> Reporting:
    options = body.get("stream_options") or {}
    continuous = bool(options.get("continuous_usage_stats"))
    return Reporting(
        n=n,
        logprobs=logprobs,
        continuous_usage=continuous,
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
        include_reasoning=body.get("include_reasoning", True) is not False,
    )


def _context_error(
    max_len: int, prompt_len: int, max_tokens: int | None, where: str
) -> InvalidArgumentError:
    """OpenAI's wording for a request that does not fit the context."""
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {max_len} tokens. However, your {where} "
            f"resulted in {prompt_len} tokens. Please reduce the length of the {where}."
        )
    else:
        message = (
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in the "
            f"completion). Please reduce the length of the {where} or completion."
        )
    return InvalidArgumentError(message, param=where, code="context_length_exceeded")


def _max_tokens(
    requested: int | None, prompt_len: int, assets: ModelAssets, default: int | None, where: str
) -> int:
    max_len = assets.max_model_len
    if prompt_len >= max_len:
        raise _context_error(max_len, prompt_len, None, where)
    if requested is None:
        remaining = max_len - prompt_len
        return remaining if default is None else min(default, remaining)
    if prompt_len + requested > max_len:
        raise _context_error(max_len, prompt_len, requested, where)
    return requested


def _sampling(
    body: Mapping[str, Any],
    assets: ModelAssets,
    *,
    max_tokens: int,
    constraint: EngineConstraint | None,
    logprobs: int | None = None,
    skip_special_tokens: bool = False,
) -> SamplingParams:
    # The model's generation_config defaults fill what the request omits (vLLM's
    # `--generation-config auto`), before the engine: every transport alike.
    missing = [(k, v) for k, v in assets.sampling_defaults if body.get(k) is None]
    if missing:
        body = {**body, **dict(missing)}
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    min_p = _number(body, "min_p", 0.0, 1.0)
    presence = _number(body, "presence_penalty", -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", -2.0, 2.0)
    repetition = _number(body, "repetition_penalty", 0.0, 2.0, lo_open=True)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise _bad("'top_k' must be -1 or 0 (disabled) or a positive integer", "top_k")
        top_k = max(top_k, 0)  # 0 = disabled, whichever way the client said it
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise _bad("'min_tokens' must be a non-negative integer", "min_tokens")
        if min_tokens > max_tokens:
            raise _bad(
                f"'min_tokens' ({min_tokens}) must not exceed the maximum tokens ({max_tokens})",
                "min_tokens",
            )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("'seed' must be an integer", "seed")
    ignore_eos = bool(body.get("ignore_eos") or False)
    stream_interval = body.get("stream_interval")
    if stream_interval is not None and (
        isinstance(stream_interval, bool)
        or not isinstance(stream_interval, int)
        or not 1 <= stream_interval <= MAX_STREAM_INTERVAL
    ):
        raise _bad(
            f"'stream_interval' must be an integer from 1 to {MAX_STREAM_INTERVAL}",
            "stream_interval",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        min_tokens=min_tokens,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        seed=seed,
        stop=_stop(body),
        # vLLM's HTTP server adds generation_config's eos ids the same way; with ignore_eos the
        # client asked to run past them (its own stop_token_ids still stop, as in vLLM).
        stop_token_ids=tuple(
            sorted(
                (frozenset() if ignore_eos else assets.eos_token_ids)
                | frozenset(_stop_token_ids(body, assets.vocab_size))
            )
        ),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        logit_bias=_logit_bias(body, assets.vocab_size),
        skip_special_tokens=skip_special_tokens,
        constraint=constraint,
        stream_interval=stream_interval,
        include_stop_str_in_output=bool(body.get("include_stop_str_in_output")),
    )


# -- chat ----------------------------------------------------------------------------------------


def _thinking_from_effort(body: dict[str, Any], family: ChatFamily) -> None:
    """`reasoning_effort` → `chat_template_kwargs[family.thinking_kwarg]` unless the client set
    it there (nothing for a family without a thinking keyword)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return
    if effort not in REASONING_EFFORTS:
        raise _bad(
            f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort"
        )
    if family.thinking_kwarg is None:
        return
    kwargs = body.setdefault("chat_template_kwargs", {})
    if isinstance(kwargs, dict):
        kwargs.setdefault(family.thinking_kwarg, effort != "none")


def _json_constraint(
    schema: Mapping[str, Any] | None,
    thinking: bool,
    syntax: CallSyntax | None,
    markers: tuple[str, ...] = (),
) -> EngineConstraint:
    """The constraint for `response_format` json_object / json_schema, in the model's own
    output format (`inferplane.parsers.build_json_constraint`; `syntax` is the replica's
    parser's, None for Kimi's).

    Without thinking the whole output is the JSON value (vLLM's `json_schema` / `json_object`).
    With thinking on, the K2.5 prompt opened `<think>`, so the output is reasoning, `</think>`,
    then the JSON: an xgrammar structural tag of that sequence (the same shape
    `build_tool_constraint` uses), so reasoning is not forced into JSON; gpt-oss answers in its
    `final` channel after an optional `analysis` message. The JSON value's strings cannot hold
    `markers` (the model's marker and special-token texts, `ModelAssets.marker_texts`): the
    grammar would otherwise let the model write `<|tool_calls_section_begin|>` inside a value,
    where the parser ends the content (`inferplane.parsers._answer`).
    """
    built = build_json_constraint(schema, syntax=syntax, thinking=thinking, markers=markers)
    return EngineConstraint(built.kind, built.value)


def _answer_markers(
    body: Mapping[str, Any], schema: Mapping[str, Any] | None, markers: tuple[str, ...]
) -> tuple[str, ...]:
    """The marker texts a `response_format` answer excludes: all of them, unless the schema
    uses a keyword xgrammar does not enforce (`inferplane.parsers.unenforced_keyword`). Such
    a schema under `strict: true` is a 400 (the answer could not be guaranteed to validate;
    OpenAI's strict mode refuses keywords it does not support too); otherwise it is served as
    before the exclusion (thinking off: vLLM's plain json_schema, which vLLM hands to a
    backend that enforces the keyword)."""
    if schema is None:
        return markers
    where = unenforced_keyword(schema)
    if where is None:
        return markers
    spec = (body.get("response_format") or {}).get("json_schema") or {}
    if spec.get("strict") is True:
        raise InvalidArgumentError(
            f"Invalid schema for response_format: strict mode cannot enforce {where}",
            param="response_format.json_schema.schema",
            code="invalid_json_schema",
        )
    return ()


def _refuse_cuts(body: Mapping[str, Any], param: str) -> None:
    """A JSON answer either validates or ends with `length`: refuses what would end it
    elsewhere or run past it. A `stop` string the model writes inside a value would cut the
    value; `ignore_eos` runs on past the finished value (the grammar then lets anything
    follow); `min_tokens` longer than the value masks every token the finished grammar allows
    (vLLM's min-tokens processor bans the stop ids, the grammar everything else)."""
    for name, why in (
        ("stop", "a stop sequence inside the JSON value would cut it"),
        ("ignore_eos", "the JSON value ends the answer"),
        ("min_tokens", "the JSON value ends the answer when it is complete"),
    ):
        if body.get(name):
            raise _bad(f"'{name}' cannot be combined with '{param}': {why}", name)


def _response_format(body: Mapping[str, Any]) -> tuple[bool, Mapping[str, Any] | None]:
    """`(wants_json, schema or None)` from `response_format`."""
    fmt = body.get("response_format")
    if not fmt:
        return False, None
    kind = fmt.get("type")
    if kind in (None, "text"):
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise _bad(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format.json_schema.schema",
            )
        return True, schema
    raise _bad(
        "response_format.type must be 'text', 'json_object' or 'json_schema'",
        "response_format.type",
    )


def _tool_schemas(tools: tuple[Mapping[str, Any], ...]) -> list[tuple[str, Mapping[str, Any]]]:
    """`(param, parameters schema)` of every function tool that declares one."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        params = fn.get("parameters") if isinstance(fn, Mapping) else None
        if isinstance(params, Mapping):
            out.append((f"tools[{i}].function.parameters", params))
    return out


def plan_chat(
    request: pb.ChatCompletionRequest,
    assets: ModelAssets,
    *,
    constrain_tool_choice_auto: bool = False,
) -> ChatPlan:
    """Validates and renders a chat request for `assets`' model.

    `constrain_tool_choice_auto` (the deployment profile's option) also constrains
    `tool_choice: "auto"` with tools: any tool section must hold declared functions with
    schema-valid arguments, one call when `parallel_tool_calls` is false. It needs the model's
    tool parser (the constraint is written in its format: `EngineConfig.call_syntax`), and a
    `response_format` JSON constraint wins over it (the JSON constraint already rules a tool
    section out).

    Raises:
        InvalidArgumentError: the request is invalid or asks for something unsupported
            (`param` names the field); a prompt whose size alone exceeds the context
            (`context_length_exceeded`, `inferplane.promptsize`).
        UnavailableError: the model has no chat template (a deployment error).
    """
    # Before anything renders or tokenizes it: a prompt too large to fit by its size alone.
    check_prompt_size(request, assets.max_model_len, assets.token_bound)
    body = chat_request_to_dict(request)
    n = _common_checks(body, CHAT_FIELDS)
    logprobs: int | None = None
    if body.get("top_logprobs") is not None:
        logprobs = _logprobs_count(body["top_logprobs"], "top_logprobs")
        if logprobs and not body.get("logprobs"):
            raise _bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    logprobs = (logprobs or 0) if body.get("logprobs") else None
    _reasoning_alias(body)
    _thinking_from_effort(body, assets.chat_family)
    wants_json, schema = _response_format(body)
    tool_choice = body.get("tool_choice")
    # OpenAI never returns a call that was not offered: without tools (or with "none"), a
    # tool section the model writes anyway is parsed out of the text and dropped (counted in
    # the outcome's dropped_tool_calls), and the finish reason stays "stop" / "length".
    allowed = tool_choice != "none" and bool(body.get("tools"))
    render_body = body if allowed else {k: v for k, v in body.items() if k != "tools"}
    try:
        prompt = render_chat(render_body, assets.tokenizer, family=assets.chat_family)
    except ChatRenderError as exc:
        raise InvalidArgumentError(exc.message, param=exc.param) from exc
    except RuntimeError as exc:
        raise UnavailableError(str(exc), code="bad_replica_config") from exc
    tools = tuple(body.get("tools") or ())
    constraint: EngineConstraint | None = None
    calls_constrained = False
    if allowed and tools:
        try:
            built = build_tool_constraint(
                tools,
                tool_choice,
                # The grammar is written in the model's own call format (Kimi's without one).
                syntax=assets.parser.config.call_syntax if assets.parser is not None else None,
                thinking=prompt.thinking,
                parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
                constrain_auto=(
                    constrain_tool_choice_auto and assets.parser is not None and not wants_json
                ),
            )
        except ConstraintError as exc:
            raise _bad(str(exc), "tool_choice") from exc
        if built is not None:
            check_compiles(_tool_schemas(tools))
            constraint = EngineConstraint(built.kind, built.value)
            calls_constrained = True
    if wants_json:
        if constraint is not None:
            raise _bad(
                "response_format json cannot be combined with a required or named tool_choice",
                "response_format",
            )
        if schema is not None:
            check_compiles([("response_format.json_schema.schema", schema)])
        _refuse_cuts(body, "response_format")
        syntax = assets.parser.config.call_syntax if assets.parser is not None else None
        markers = _answer_markers(body, schema, assets.marker_texts)
        constraint = _json_constraint(schema, prompt.thinking, syntax, markers)
    wanted = structured.requested(body)
    if wanted is not None:
        if constraint is not None:
            raise _bad(
                f"'{wanted[0]}' cannot be combined with response_format json or a required or "
                "named tool_choice",
                wanted[0],
            )
        syntax = assets.parser.config.call_syntax if assets.parser is not None else None
        if wanted[1] == "json" and isinstance(wanted[2], Mapping):
            check_compiles([(wanted[0], wanted[2])])
        if wanted[1] in ("json", "json_object"):
            _refuse_cuts(body, wanted[0])
        constraint = structured.build(
            wanted, thinking=prompt.thinking, syntax=syntax, markers=assets.marker_texts
        )
    requested = _positive_int(body, "max_completion_tokens")
    if requested is None:
        requested = _positive_int(body, "max_tokens")
    max_tokens = _max_tokens(requested, len(prompt.token_ids), assets, None, "messages")
    params = _sampling(
        body, assets, max_tokens=max_tokens, constraint=constraint, logprobs=logprobs
    )
    history = sum(
        len(m.get("tool_calls") or ())
        for m in body.get("messages", ())
        if m.get("role") == "assistant"
    )
    options = body.get("stream_options") or {}
    return ChatPlan(
        prompt=prompt,
        params=params,
        tools=tools,
        tool_calls_allowed=allowed,
        history_tool_calls=history,
        include_usage=bool(options.get("include_usage")),
        report=_reporting(body, n, logprobs is not None),
        max_tool_calls=1 if body.get("parallel_tool_calls") is False else None,
        calls_constrained=calls_constrained,
    )


def _reasoning_alias(body: dict[str, Any]) -> None:
    """A message's `reasoning` (vLLM >= 0.16's name) → `reasoning_content`, which the
    renderer reads; the same text under both names is one, different texts are a 400."""
    for i, msg in enumerate(body.get("messages") or ()):
        if not isinstance(msg, dict) or "reasoning" not in msg:
            continue
        text = msg.pop("reasoning")
        other = msg.get("reasoning_content")
        if other is not None and other != text:
            raise _bad(
                f"messages[{i}] has different 'reasoning' and 'reasoning_content'; send one",
                f"messages[{i}].reasoning",
            )
        msg["reasoning_content"] = text
