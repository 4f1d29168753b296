"""Which request fields the replica serves: the field policy of chat and text completions.

The policy follows vLLM 0.32's OpenAI-compatible server (the ecosystem's reference: clients
written for vLLM send its fields), field by field, and is written out for users in
docs/request-fields.md. Every field of vLLM's request models (`ChatCompletionRequest` in
vllm/entrypoints/openai/chat_completion/protocol.py, `CompletionRequest` in
vllm/entrypoints/openai/completion/protocol.py, `EmbeddingCompletionRequest` in
vllm/entrypoints/pooling/embed/protocol.py, `StreamOptions`, and the message keys of
vllm/renderers/chat_utils.py `CustomChatCompletionMessageParam`) is in exactly one category:

- `HONOURED`: served as vLLM serves it (sampling, constraints, stopping, rendering, reporting);
- `IGNORED`: accepted and without effect, because it only names, routes or shapes a report
  the platform does its own way (each has its reason, `FieldRule.why`);
- `REFUSED`: a value that asks for something inferplane does not do is a 400
  (`unsupported_parameter`, `param` naming the field); the value that asks for nothing
  (vLLM's default, e.g. `use_beam_search: false`, `priority: 0`) passes, because clients
  built on vLLM's models send defaults explicitly;
- `EDGE`: not a field of the request proto, so the edge's unknown-field guard answers the
  400 naming it before any service sees the request (a message's `tools` and `task`).

A test (services/replica/tests/test_request_fields.py) reads vLLM's models and fails when
vLLM defines a field that no table here categorises, and when a table's field is missing from
the proto (the edge would refuse a field the policy accepts). Keys nobody defines stay the
edge's 400 (`libs/inferplane/edge/lua/field_guard.lua`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from inferplane.runtime import InvalidArgumentError


class Treatment(enum.Enum):
    """What the platform does with a request field (see the module docstring)."""

    HONOURED = "honoured"
    IGNORED = "ignored"
    REFUSED = "refused"
    EDGE = "edge"


def _is_default(default: Any) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if isinstance(default, bool) or isinstance(value, bool):
            return value is default
        return bool(value == default)

    return check


def _empty(value: Any) -> bool:
    return value in (None, "", [], {}, ())


@dataclasses.dataclass(frozen=True, slots=True)
class FieldRule:
    """One field's treatment.

    Attributes:
        treatment: the category.
        why: the reason, for IGNORED and REFUSED fields (the 400's message quotes it), or what
            honouring means where it is not obvious.
        asks_nothing: for REFUSED fields, the test of a value that asks for nothing and passes
            (default: an empty value: null, "", [], {}).
        passes: for REFUSED fields, that value in words (docs/request-fields.md).
    """

    treatment: Treatment
    why: str = ""
    asks_nothing: Callable[[Any], bool] = _empty
    passes: str = ""


H = Treatment.HONOURED


def _h(why: str = "") -> FieldRule:
    return FieldRule(H, why)


def _ignored(why: str) -> FieldRule:
    return FieldRule(Treatment.IGNORED, why)


def _refused(why: str, default: Any = None) -> FieldRule:
    if default is None:
        return FieldRule(Treatment.REFUSED, why, _empty, "null or empty")
    return FieldRule(Treatment.REFUSED, why, _is_default(default), json.dumps(default))


_NO_MEDIA = "inferplane serves text models: no multimodal input"
_INTERNAL = "engine-internal transfer parameters are the platform's, never a client's"
_RENDER_ONLY = "vLLM uses it on its /render endpoints only and ignores it on generation"
_NOT_SERVED = "the platform's engine interface does not carry it"

# Fields the two request kinds share, with the same treatment.
_COMMON: dict[str, FieldRule] = {
    "model": _h(),
    "frequency_penalty": _h(),
    "presence_penalty": _h(),
    "logit_bias": _h(),
    "max_tokens": _h(),
    "n": _h("1 to 8 choices, each generated as its own engine request (seed + i when seeded)"),
    "seed": _h(),
    "stop": _h(),
    "stream": _h(),
    "stream_options": _h(),
    "temperature": _h(),
    "top_p": _h(),
    "top_k": _h(),
    "min_p": _h(),
    "repetition_penalty": _h(),
    "ignore_eos": _h(),
    "min_tokens": _h(),
    "stream_interval": _h(),
    "user": _h("an end-user id: the router's session-affinity key"),
    "response_format": _h("text, json_object, json_schema (a decoding constraint)"),
    "stop_token_ids": _h("added to the model's end-of-sequence ids; never shown"),
    "include_stop_str_in_output": _h("a matched stop string stays at the end of the text"),
    "structured_outputs": _h(
        "one of json, json_object, regex, choice, grammar, structural_tag (the engine's "
        "structured outputs, like response_format)"
    ),
    "return_tokens_as_token_ids": _h("with logprobs, each token is written 'token_id:{id}'"),
    "allowed_token_ids": _refused(_NOT_SERVED),
    "bad_words": _refused(_NOT_SERVED),
    "logprob_token_ids": _refused(_NOT_SERVED),
    "prompt_logprobs": _refused("log probabilities of prompt tokens are not returned"),
    "repetition_detection": _refused(_NOT_SERVED),
    "vllm_xargs": _refused("custom engine extensions are not installed on the platform"),
    "watermarking": _refused("the engines run without a watermarking processor", False),
    "use_beam_search": _refused("beam search is not served", False),
    "length_penalty": _refused("a beam search parameter; beam search is not served", 1.0),
    "thinking_token_budget": FieldRule(
        Treatment.REFUSED,
        "a reasoning token budget needs the engine's reasoning parser, which the platform's "
        "engines run without; -1 (unlimited) passes",
        lambda v: v is None or v == -1,
        "null or -1",
    ),
    "truncate_prompt_tokens": _refused(
        "the platform never cuts a prompt (a prompt that does not fit is a clear "
        "context_length_exceeded)"
    ),
    "truncation_side": _refused("only with truncate_prompt_tokens, which is refused"),
    "spaces_between_special_tokens": _refused("text is decoded exactly as the tokens decode", True),
    "return_token_ids": _refused("responses carry no token ids", False),
    "priority": _refused(
        "the router's fair queuing across API keys orders requests; a client cannot jump it",
        0,
    ),
    "cache_salt": _refused(
        "the prefix cache is the platform's: its router places requests by shared prefixes, "
        "which a client salt would silently defeat"
    ),
    "kv_transfer_params": _refused(_INTERNAL),
    "ec_transfer_params": _refused(_INTERNAL),
    "request_id": _ignored("the platform names its requests (the response's id is its own)"),
    "session_id": _ignored("session affinity is keyed by `user` (or the key), not this id"),
    "mm_payload": _ignored(_RENDER_ONLY),
    "return_mm_kwargs": _ignored(_RENDER_ONLY),
    "return_token_offsets": _ignored(_RENDER_ONLY),
    "routed_experts_prompt_start": _ignored("responses carry no routed-expert data"),
    # vLLM < 0.12's spellings of structured_outputs (removed from vLLM's models; old clients).
    "guided_json": _h("structured_outputs.json"),
    "guided_regex": _h("structured_outputs.regex"),
    "guided_choice": _h("structured_outputs.choice"),
    "guided_grammar": _h("structured_outputs.grammar"),
}

#: ChatCompletionRequest's fields (vLLM 0.32 and OpenAI's), with their treatment.
CHAT_FIELDS: Mapping[str, FieldRule] = {
    **_COMMON,
    "messages": _h(),
    "max_completion_tokens": _h(),
    "logprobs": _h("choices[].logprobs.content[]: token, logprob, bytes, top_logprobs"),
    "top_logprobs": _h("0 to 20, with logprobs"),
    "tools": _h(),
    "tool_choice": _h(),
    "parallel_tool_calls": _h(),
    "reasoning_effort": _h("'none' turns thinking off; other levels leave it on"),
    "chat_template_kwargs": _h(),
    "metadata": _h(),
    "include_reasoning": _h("false leaves reasoning_content out of the response"),
    "skip_special_tokens": _refused(
        "chat content never shows the model's special tokens (the parser needs them to find "
        "reasoning and tool calls, and removes them)",
        True,
    ),
    "add_generation_prompt": _refused(
        "the prompt always ends with the assistant turn's opening", True
    ),
    "continue_final_message": _refused("continuing a final assistant message is not served", False),
    "add_special_tokens": _refused("the chat template writes the special tokens", False),
    "echo": _refused("chat completions do not echo the last message", False),
    "chat_template": _refused(
        "the model's own chat template renders every prompt; a template from the client "
        "would run client code in the replica"
    ),
    "documents": _refused("retrieval documents are not rendered by the supported templates"),
    "return_prompt_text": _refused("responses do not carry the rendered prompt", False),
    "media_io_kwargs": _refused(_NO_MEDIA),
    "mm_processor_kwargs": _refused(_NO_MEDIA),
}

#: CompletionRequest's fields (vLLM 0.32 and OpenAI's), with their treatment.
COMPLETION_FIELDS: Mapping[str, FieldRule] = {
    **_COMMON,
    "prompt": _h(),
    "logprobs": _h("0 to 5 top tokens: choices[].logprobs {tokens, token_logprobs, ...}"),
    "echo": _h(),
    "add_special_tokens": _h("true (the default) lets the tokenizer add BOS to a text prompt"),
    "skip_special_tokens": _h("true leaves special tokens out of the text (default false)"),
    "suffix": _refused("the model has no fill-in-the-middle mode"),
    "prompt_embeds": _refused("prompts are text or token ids"),
}

#: EmbeddingRequest's fields (vLLM 0.32's EmbeddingCompletionRequest and OpenAI's).
EMBEDDING_FIELDS: Mapping[str, FieldRule] = {
    "model": _h(),
    "input": _h(),
    "encoding_format": _h("float or base64 (little-endian float32)"),
    "dimensions": _h("a Matryoshka size of the model"),
    "user": _h(),
    "add_special_tokens": _refused("strings are always tokenized with the model's BOS/EOS", True),
    "embed_dtype": _refused("values are float32", "float32"),
    "endianness": FieldRule(
        Treatment.REFUSED,
        "base64 values are little-endian float32 (the platform's hosts are little-endian)",
        lambda v: v in (None, "native", "little"),
        '"native" or "little"',
    ),
    "padding": _refused("inputs are embedded as given, without padding"),
    "use_activation": FieldRule(
        Treatment.REFUSED,
        "the model's pooler normalises as it was trained to",
        lambda v: v is None or v is True,
        "null or true",
    ),
    "truncate_prompt_tokens": _COMMON["truncate_prompt_tokens"],
    "truncation_side": _COMMON["truncation_side"],
    "priority": _COMMON["priority"],
    "cache_salt": _COMMON["cache_salt"],
    "request_id": _COMMON["request_id"],
    "mm_processor_kwargs": _refused(_NO_MEDIA),
}

#: StreamOptions' fields.
STREAM_OPTIONS_FIELDS: Mapping[str, FieldRule] = {
    "include_usage": _h("a last chunk with usage and empty choices"),
    "continuous_usage_stats": _h("every chunk also carries the usage so far"),
}

#: The keys of one chat message (OpenAI's message types and vLLM's custom message).
MESSAGE_FIELDS: Mapping[str, FieldRule] = {
    "role": _h(),
    "content": _h(),
    "name": _h(),
    "tool_call_id": _h(),
    "tool_calls": _h(),
    "reasoning_content": _h("an earlier assistant turn's reasoning, rendered as the template does"),
    "reasoning": _h("vLLM >= 0.16's name for reasoning_content"),
    "tools": FieldRule(Treatment.EDGE, "tools are declared in the request's `tools`"),
    "task": FieldRule(Treatment.EDGE, "a DeepSeek V4 marker; no served template reads it"),
}


def unsupported(param: str, why: str) -> InvalidArgumentError:
    """The 400 for a field inferplane does not serve (code `unsupported_parameter`)."""
    return InvalidArgumentError(
        f"'{param}' is not supported: {why}", param=param, code="unsupported_parameter"
    )


def set_fields(message: Message, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields set on a request `message` (those in `skip` left out: a large `input` is
    not copied) as `refuse_unserved` reads them: scalars as they are, repeated fields as
    lists, Struct / Value fields as their JSON value."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.name in skip:
            continue
        if isinstance(value, Message):
            value = json_format.MessageToDict(value)
        elif not isinstance(value, str | bytes) and hasattr(value, "__iter__"):
            value = list(value)  # a repeated field
        out[field.name] = value
    return out


def refuse_unserved(body: Mapping[str, Any], rules: Mapping[str, FieldRule]) -> None:
    """Raises the 400 for the first REFUSED field of `body` whose value asks for something.

    Raises:
        InvalidArgumentError: code `unsupported_parameter`, `param` the field, the message
            quoting the rule's reason.
    """
    for name, value in body.items():
        rule = rules.get(name)
        if (
            rule is not None
            and rule.treatment is Treatment.REFUSED
            and not rule.asks_nothing(value)
        ):
            raise unsupported(name, rule.why)
