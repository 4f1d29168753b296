"""OpenAI request → what the engine runs: validation (400s naming `param`), rendering,
sampling parameters and the decoding constraint.

What inferplane supports, and what it rejects with a clear 400 (OpenAI's
`invalid_request_error`; `code` "unsupported_parameter" for features it does not serve):

- `n` must be 1 (one choice per request); `logprobs` / `top_logprobs` / `suffix` are rejected
  (the engine interface returns no log probabilities yet);
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
)
from inferplane.replica.engines.base import EngineConstraint, SamplingParams
from inferplane.replica.pipeline.assets import ModelAssets
from inferplane.replica.pipeline.schemas import check_compiles
from inferplane.runtime import InvalidArgumentError, UnavailableError
from inferplane.wire import chat_request_to_dict, completion_request_to_dict

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_STREAM_INTERVAL = 1024  # tokens per streamed chunk; more is a unary response in disguise


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
    max_tool_calls: int | None = None
    calls_constrained: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionPlan:
    """A validated text completion request.

    Attributes:
        prompt_ids: the prompt's token ids.
        echo_text: the prompt text to prepend to the output (`echo`), else "".
        params: the engine's sampling parameters.
        include_usage: `stream_options.include_usage`.
    """

    prompt_ids: list[int]
    echo_text: str
    params: SamplingParams
    include_usage: bool


def _bad(message: str, param: str | None, code: str = "invalid_value") -> InvalidArgumentError:
    return InvalidArgumentError(message, param=param, code=code)


def _unsupported(param: str, why: str) -> InvalidArgumentError:
    return _bad(f"'{param}' is not supported: {why}", param, code="unsupported_parameter")


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


def _common_checks(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad("'n' must be 1: inferplane returns one choice per request", "n")


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
) -> SamplingParams:
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
        # client asked to run past them.
        stop_token_ids=() if ignore_eos else tuple(sorted(assets.eos_token_ids)),
        ignore_eos=ignore_eos,
        logit_bias=_logit_bias(body, assets.vocab_size),
        skip_special_tokens=False,
        constraint=constraint,
        stream_interval=stream_interval,
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
    schema: Mapping[str, Any] | None, thinking: bool, syntax: CallSyntax | None
) -> EngineConstraint:
    """The constraint for `response_format` json_object / json_schema, in the model's own
    output format (`inferplane.parsers.build_json_constraint`; `syntax` is the replica's
    parser's, None for Kimi's).

    Without thinking the whole output is the JSON value (vLLM's `json_schema` / `json_object`).
    With thinking on, the K2.5 prompt opened `<think>`, so the output is reasoning, `</think>`,
    then the JSON: an xgrammar structural tag of that sequence (the same shape
    `build_tool_constraint` uses), so reasoning is not forced into JSON; gpt-oss answers in its
    `final` channel after an optional `analysis` message.
    """
    built = build_json_constraint(schema, syntax=syntax, thinking=thinking)
    return EngineConstraint(built.kind, built.value)


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
            (`param` names the field).
        UnavailableError: the model has no chat template (a deployment error).
    """
    body = chat_request_to_dict(request)
    _common_checks(body)
    if body.get("logprobs"):
        raise _unsupported("logprobs", "inferplane does not return log probabilities yet")
    if body.get("top_logprobs"):
        raise _unsupported("top_logprobs", "inferplane does not return log probabilities yet")
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
        syntax = assets.parser.config.call_syntax if assets.parser is not None else None
        constraint = _json_constraint(schema, prompt.thinking, syntax)
    requested = _positive_int(body, "max_completion_tokens")
    if requested is None:
        requested = _positive_int(body, "max_tokens")
    max_tokens = _max_tokens(requested, len(prompt.token_ids), assets, None, "messages")
    params = _sampling(body, assets, max_tokens=max_tokens, constraint=constraint)
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
        max_tool_calls=1 if body.get("parallel_tool_calls") is False else None,
        calls_constrained=calls_constrained,
    )


# -- text completions --------------------------------------------------------------------------


def _prompt_ids(prompt: Any, assets: ModelAssets) -> tuple[list[int], str]:
    """`(token ids, prompt text)` of a completion prompt: a string, a list of token ids, or a
    one-element list of either (OpenAI's batch forms with several prompts are refused)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        ids = [int(i) for i in assets.tokenizer.encode(prompt, add_special_tokens=True)]
        return ids, prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    ):
        bad = next((i for i in prompt if not 0 <= i < assets.vocab_size), None)
        if bad is not None:
            raise _bad(f"prompt token id {bad} is outside the vocabulary", "prompt")
        return list(prompt), ""
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad(
            "'prompt' must be one prompt: inferplane serves one choice per request", "prompt"
        )
    raise _bad("'prompt' must be a string or an array of token ids", "prompt")


def plan_completion(request: pb.CompletionRequest, assets: ModelAssets) -> CompletionPlan:
    """Validates a text completion request for `assets`' model.

    Raises:
        InvalidArgumentError: the request is invalid or asks for something unsupported.
    """
    body = completion_request_to_dict(request)
    _common_checks(body)
    if body.get("logprobs") is not None:
        raise _unsupported("logprobs", "inferplane does not return log probabilities yet")
    if body.get("suffix"):
        raise _unsupported("suffix", "the model has no fill-in-the-middle mode")
    if "prompt" not in body:
        raise _bad("'prompt' is required", "prompt")
    ids, text = _prompt_ids(body["prompt"], assets)
    echo = bool(body.get("echo"))
    if echo and not text:
        text = assets.tokenizer.decode(ids, skip_special_tokens=False)
    max_tokens = _max_tokens(
        _positive_int(body, "max_tokens"), len(ids), assets, DEFAULT_COMPLETION_MAX_TOKENS, "prompt"
    )
    params = _sampling(body, assets, max_tokens=max_tokens, constraint=None)
    options = body.get("stream_options") or {}
    return CompletionPlan(
        prompt_ids=ids,
        echo_text=text if echo else "",
        params=params,
        include_usage=bool(options.get("include_usage")),
    )
