"""Steps → inference.v1 messages shaped exactly like OpenAI's objects.

Chat chunks follow OpenAI's ChatCompletionChunk: the same id / created / model in every chunk,
a first chunk with `delta.role = "assistant"` and `content = ""`, reasoning in
`reasoning_content`, tool calls as `ChatCompletionDeltaToolCall` (a call's first fragment
carries index, id, type "function", name and its arguments so far; later ones index and
argument fragments), `finish_reason` on the last choice chunk, and an optional final chunk with
empty `choices` and `usage`. With `n` > 1 each chunk carries one choice, its `index` telling
which; `logprobs` (`pipeline/logprobs.py`) go on the chunk whose tokens they describe.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf import struct_pb2

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.parsers import ParseResult
from inferplane.replica.pipeline.generate import Step

CHAT_CHUNK = "chat.completion.chunk"
CHAT_COMPLETION = "chat.completion"
TEXT_COMPLETION = "text_completion"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int
) -> pb.Usage:
    """OpenAI's usage object (details always filled, zeros included)."""
    return pb.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=pb.PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=pb.CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
    )


class ChatChunks:
    """Builds the chunks of one streamed chat completion."""

    __slots__ = ("_created", "_fingerprint", "_id", "_model")

    def __init__(self, completion_id: str, created: int, model: str, fingerprint: str) -> None:
        self._id = completion_id
        self._created = created
        self._model = model
        self._fingerprint = fingerprint or None

    def _chunk(
        self, choice: pb.ChatCompletionChunkChoice | None, value: pb.Usage | None = None
    ) -> pb.StreamChatCompletionResponse:
        return pb.StreamChatCompletionResponse(
            id=self._id,
            object=CHAT_CHUNK,
            created=self._created,
            model=self._model,
            system_fingerprint=self._fingerprint,
            choices=[choice] if choice is not None else None,
            usage=value,
        )

    def role(self, index: int = 0) -> pb.StreamChatCompletionResponse:
        """The first chunk of choice `index`: `{"role": "assistant", "content": ""}`."""
        delta = pb.ChatCompletionDelta(role="assistant", content="")
        return self._chunk(pb.ChatCompletionChunkChoice(index=index, delta=delta))

    def step(
        self, step: Step, index: int = 0, logprobs: struct_pb2.Value | None = None
    ) -> pb.StreamChatCompletionResponse:
        """The chunk of one visible step of choice `index` (its finish_reason included), with
        the `logprobs` of its tokens when asked for."""
        delta = pb.ChatCompletionDelta()
        if step.content:
            delta.content = step.content
        if step.reasoning:
            delta.reasoning_content = step.reasoning
        for tc in step.tool_calls:
            call = delta.tool_calls.add(index=tc.index)
            if tc.id is not None:
                call.id = tc.id
                call.type = "function"
                call.function.name = tc.name or ""
            call.function.arguments = tc.arguments
        choice = pb.ChatCompletionChunkChoice(index=index, delta=delta, logprobs=logprobs)
        if step.finish_reason is not None:
            choice.finish_reason = step.finish_reason
        return self._chunk(choice)

    def usage(self, value: pb.Usage) -> pb.StreamChatCompletionResponse:
        """The final `include_usage` chunk: empty choices, usage."""
        return self._chunk(None, value)


def chat_completion(
    completion_id: str,
    created: int,
    model: str,
    fingerprint: str,
    result: ParseResult,
    finish_reason: str,
    value: pb.Usage,
    *,
    logprobs: struct_pb2.Value | None = None,
    more: Sequence[pb.ChatCompletionChoice] = (),
    reasoning: bool = True,
) -> pb.CreateChatCompletionResponse:
    """OpenAI's ChatCompletion: choice 0 from `result` (with its `logprobs`, else null;
    `chat_choice`), then the `more` choices (`n` > 1)."""
    response = pb.CreateChatCompletionResponse(
        id=completion_id,
        object=CHAT_COMPLETION,
        created=created,
        model=model,
        choices=[chat_choice(0, result, finish_reason, logprobs, reasoning=reasoning), *more],
        usage=value,
    )
    if fingerprint:
        response.system_fingerprint = fingerprint
    return response


def chat_choice(
    index: int,
    result: ParseResult,
    finish_reason: str,
    logprobs: struct_pb2.Value | None = None,
    *,
    reasoning: bool = True,
) -> pb.ChatCompletionChoice:
    """One ChatCompletion choice: content null when the model only called tools; reasoning
    left out when `reasoning` is False (`include_reasoning: false`); `logprobs` null unless
    given."""
    message = pb.ChatCompletionMessage(role="assistant")
    if result.tool_calls and not result.content:
        message.content.null_value = struct_pb2.NULL_VALUE
    else:
        message.content.string_value = result.content
    if result.reasoning and reasoning:
        message.reasoning_content = result.reasoning
    for call in result.tool_calls:
        message.tool_calls.add(
            id=call.id,
            type="function",
            function=pb.FunctionCall(name=call.name, arguments=call.arguments),
        )
    choice = pb.ChatCompletionChoice(index=index, message=message, finish_reason=finish_reason)
    if logprobs is None:
        choice.logprobs.null_value = struct_pb2.NULL_VALUE
    else:
        choice.logprobs.CopyFrom(logprobs)
    return choice


class CompletionChunks:
    """Builds the chunks of one streamed text completion (`finish_reason` null until the last)."""

    __slots__ = ("_created", "_fingerprint", "_id", "_model")

    def __init__(self, completion_id: str, created: int, model: str, fingerprint: str) -> None:
        self._id = completion_id
        self._created = created
        self._model = model
        self._fingerprint = fingerprint or None

    def _chunk(
        self, choice: pb.CompletionChoice | None, value: pb.Usage | None = None
    ) -> pb.StreamCompletionResponse:
        return pb.StreamCompletionResponse(
            id=self._id,
            object=TEXT_COMPLETION,
            created=self._created,
            model=self._model,
            system_fingerprint=self._fingerprint,
            choices=[choice] if choice is not None else None,
            usage=value,
        )

    def text(
        self,
        text: str,
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: struct_pb2.Value | None = None,
    ) -> pb.StreamCompletionResponse:
        """One chunk of choice `index`'s text (and the finish reason on its last), with the
        `logprobs` of its tokens when asked for."""
        choice = pb.CompletionChoice(index=index, text=text, logprobs=logprobs)
        if finish_reason is not None:
            choice.finish_reason.string_value = finish_reason
        return self._chunk(choice)

    def usage(self, value: pb.Usage) -> pb.StreamCompletionResponse:
        """The final `include_usage` chunk."""
        return self._chunk(None, value)


def completion(
    completion_id: str,
    created: int,
    model: str,
    fingerprint: str,
    text: str,
    finish_reason: str,
    value: pb.Usage,
    *,
    logprobs: struct_pb2.Value | None = None,
    more: Sequence[pb.CompletionChoice] = (),
) -> pb.CreateCompletionResponse:
    """OpenAI's Completion object: choice 0 (`logprobs` null unless given), then `more`
    (`completion_choice`; `n` > 1)."""
    response = pb.CreateCompletionResponse(
        id=completion_id,
        object=TEXT_COMPLETION,
        created=created,
        model=model,
        choices=[completion_choice(0, text, finish_reason, logprobs), *more],
        usage=value,
    )
    if fingerprint:
        response.system_fingerprint = fingerprint
    return response


def completion_choice(
    index: int, text: str, finish_reason: str, logprobs: struct_pb2.Value | None = None
) -> pb.CompletionChoice:
    """One Completion choice (`logprobs` null unless given)."""
    choice = pb.CompletionChoice(index=index, text=text)
    choice.finish_reason.string_value = finish_reason
    if logprobs is None:
        choice.logprobs.null_value = struct_pb2.NULL_VALUE
    else:
        choice.logprobs.CopyFrom(logprobs)
    return choice
