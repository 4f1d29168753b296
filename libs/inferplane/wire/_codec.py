"""Codec between OpenAI JSON and inference.v1 messages (see the package docstring)."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import descriptor, json_format, struct_pb2

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.runtime import InvalidArgumentError

SSE_DONE = b"data: [DONE]\n\n"

# Request fields whose JSON comes through google.protobuf.Struct/Value (numbers become floats).
_CHAT_STRUCT_FIELDS = (
    "response_format",
    "metadata",
    "chat_template_kwargs",
    "logit_bias",
    "structured_outputs",
    "guided_json",
    "thinking_token_budget",
)
_COMPLETION_STRUCT_FIELDS = (
    "prompt",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "guided_json",
    "thinking_token_budget",
)


def _int64_fields(message: Any) -> tuple[str, ...]:
    """The (u)int64 fields of a message type: proto3 JSON writes them as strings."""
    wide = (descriptor.FieldDescriptor.TYPE_INT64, descriptor.FieldDescriptor.TYPE_UINT64)
    return tuple(f.name for f in message.DESCRIPTOR.fields if f.type in wide)


_CHAT_INT64_FIELDS = _int64_fields(pb.ChatCompletionRequest)
_COMPLETION_INT64_FIELDS = _int64_fields(pb.CompletionRequest)


def _restore_int64(out: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = out.get(name)
        if isinstance(value, list):
            out[name] = [int(v) for v in value]
        elif value is not None:
            out[name] = int(value)


def restore_ints(value: Any) -> Any:
    """Returns `value` with integral floats turned back into ints, recursively.

    Protobuf's Struct stores every number as a double, so `{"minimum": 0}` comes back as
    `{"minimum": 0.0}`; JSON schemas and chat templates must see the original ints.
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: restore_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_ints(v) for v in value]
    return value


def _parse(body: dict[str, Any], message: Any, what: str) -> Any:
    if not isinstance(body, dict):
        raise InvalidArgumentError(f"the {what} body must be a JSON object")
    try:
        return json_format.ParseDict(body, message, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise InvalidArgumentError(f"invalid {what}: {exc}") from exc


def chat_request_from_dict(body: dict[str, Any]) -> pb.ChatCompletionRequest:
    """Parses an OpenAI chat request body; unknown fields are ignored as the edge does.

    Raises:
        InvalidArgumentError: a field has the wrong type.
    """
    return _parse(body, pb.ChatCompletionRequest(), "chat completion request")  # type: ignore[no-any-return]


def completion_request_from_dict(body: dict[str, Any]) -> pb.CompletionRequest:
    """Parses an OpenAI text completion request body (see chat_request_from_dict)."""
    return _parse(body, pb.CompletionRequest(), "completion request")  # type: ignore[no-any-return]


def _to_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def chat_request_to_dict(request: pb.ChatCompletionRequest) -> dict[str, Any]:
    """The request as OpenAI JSON: the fields that were set, with ints restored."""
    out = _to_dict(request)
    _restore_int64(out, _CHAT_INT64_FIELDS)
    for name in _CHAT_STRUCT_FIELDS:
        if name in out:
            out[name] = restore_ints(out[name])
    for tool in out.get("tools", []):
        function = tool.get("function", {})
        if "parameters" in function:
            function["parameters"] = restore_ints(function["parameters"])
    return out


def completion_request_to_dict(request: pb.CompletionRequest) -> dict[str, Any]:
    """The text completion request as OpenAI JSON (prompt token ids restored to ints)."""
    out = _to_dict(request)
    _restore_int64(out, _COMPLETION_INT64_FIELDS)
    for name in _COMPLETION_STRUCT_FIELDS:
        if name in out:
            out[name] = restore_ints(out[name])
    return out


def chat_completion_to_dict(response: pb.CreateChatCompletionResponse) -> dict[str, Any]:
    """The ChatCompletion as the edge prints it (proto field names, primitives always printed)."""
    return json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def completion_to_dict(response: pb.CreateCompletionResponse) -> dict[str, Any]:
    """The Completion as the edge prints it."""
    return json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _value(value: struct_pb2.Value) -> Any:
    # Struct numbers are doubles: integral ones print as ints (logprobs' `bytes` lists).
    return restore_ints(json_format.MessageToDict(value))


def _usage(usage: pb.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": usage.completion_tokens_details.reasoning_tokens
        },
    }


def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _header(chunk: Any, obj: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": chunk.id,
        "object": chunk.object or obj,
        "created": chunk.created,
        "model": chunk.model,
    }
    if chunk.HasField("system_fingerprint"):
        out["system_fingerprint"] = chunk.system_fingerprint
    return out


def chunk_to_json(chunk: pb.StreamChatCompletionResponse) -> bytes:
    """A ChatCompletionChunk as OpenAI writes it: compact JSON, explicit `finish_reason` and
    `logprobs` nulls, delta keys only when set, `usage` only on the usage chunk."""
    out = _header(chunk, "chat.completion.chunk")
    choices = []
    for choice in chunk.choices:
        d = choice.delta
        delta: dict[str, Any] = {}
        if d.HasField("role"):
            delta["role"] = d.role
        if d.HasField("content"):
            delta["content"] = d.content
        if d.HasField("reasoning_content"):
            delta["reasoning_content"] = d.reasoning_content
        if d.tool_calls:
            calls = []
            for call in d.tool_calls:
                item: dict[str, Any] = {"index": call.index}
                if call.HasField("id"):
                    item["id"] = call.id
                if call.HasField("type"):
                    item["type"] = call.type
                function: dict[str, Any] = {}
                if call.function.HasField("name"):
                    function["name"] = call.function.name
                if call.function.HasField("arguments"):
                    function["arguments"] = call.function.arguments
                item["function"] = function
                calls.append(item)
            delta["tool_calls"] = calls
        choices.append(
            {
                "index": choice.index,
                "delta": delta,
                "logprobs": _value(choice.logprobs) if choice.HasField("logprobs") else None,
                "finish_reason": choice.finish_reason if choice.HasField("finish_reason") else None,
            }
        )
    out["choices"] = choices
    if chunk.HasField("usage"):
        out["usage"] = _usage(chunk.usage)
    return _dumps(out)


def completion_chunk_to_json(chunk: pb.StreamCompletionResponse) -> bytes:
    """A streamed text completion chunk as OpenAI writes it."""
    out = _header(chunk, "text_completion")
    out["choices"] = [
        {
            "index": choice.index,
            "text": choice.text,
            "logprobs": _value(choice.logprobs) if choice.HasField("logprobs") else None,
            "finish_reason": (
                _value(choice.finish_reason) if choice.HasField("finish_reason") else None
            ),
        }
        for choice in chunk.choices
    ]
    if chunk.HasField("usage"):
        out["usage"] = _usage(chunk.usage)
    return _dumps(out)


def sse_event(payload: bytes) -> bytes:
    """Frames one JSON payload as a Server-Sent Event (`data: ...\\n\\n`)."""
    return b"data: " + payload + b"\n\n"


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_error(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    """The error event that ends a stream which failed after its first byte."""
    return sse_event(_dumps(error_body(message, type_, code, param)))
