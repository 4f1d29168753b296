"""The message producers of the generation and embedding RPCs: the bodies `_serve` runs.

Each body takes the request, its `RequestFacts`, the replica and the model's assets, and yields
the RPC's messages (one for the unary RPCs): plan the request (`pipeline/requests.py`,
`pipeline/embeddings.py`), run it on the replica's engine (`pipeline/generate.py`), shape the
messages (`pipeline/chunks.py`, `pipeline/sse.py`). They record what the request's summary and
record need on its facts (the generation, the embedding's counts, tool-call verdicts, SSE
framing).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

from google.api import httpbody_pb2

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.parsers import PlainSession, ToolCallVerdict, ToolValidator
from inferplane.replica.engines.base import EngineError, LocalReplica, SamplingParams
from inferplane.replica.pipeline import chunks
from inferplane.replica.pipeline.assets import ModelAssets
from inferplane.replica.pipeline.embeddings import (
    embedding_response,
    needs_thread,
    plan_embedding,
)
from inferplane.replica.pipeline.generate import Generation, OutputSession, engine_error
from inferplane.replica.pipeline.requests import plan_chat
from inferplane.replica.pipeline.sse import sse_bodies
from inferplane.replica.pipeline.text_requests import plan_completion
from inferplane.replica.server.facts import RequestFacts
from inferplane.runtime import InternalError
from inferplane.runtime.time.clock import Clock

Body = Callable[[LocalReplica, ModelAssets], AsyncIterator[Any]]
"""A body with its request and facts bound: `(replica, assets)` → the RPC's messages."""


@dataclasses.dataclass(frozen=True, slots=True)
class Bodies:
    """The bodies of chat, text completions and embeddings.

    Args:
        clock: `created` of responses (wall seconds) and the time to an embedding's result.
        new_id: a fresh unique hex id (completion, embedding and engine request ids).
        strict_tool_calls: a tool call that fails validation against the request's tools
            ends the request with an error (InternalError, code invalid_tool_call).
    """

    clock: Clock
    new_id: Callable[[], str]
    strict_tool_calls: bool = False

    async def chat_chunks(
        self,
        req: pb.ChatCompletionRequest,
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.StreamChatCompletionResponse]:
        """A chat completion's typed chunks: the role, one per visible step, the usage."""
        plan = plan_chat(
            req, assets, constrain_tool_choice_auto=replica.spec.constrain_tool_choice_auto
        )
        gen = self._generation(replica, assets, plan, "chatcmpl-", facts, chat=True)
        out = chunks.ChatChunks(
            gen.request_id,
            int(self.clock.time()),
            replica.spec.served_model_name,
            replica.spec.revision,
        )
        first = True
        strict = self.strict_tool_calls
        async with aclosing(gen.steps()) as steps:
            async for step in steps:
                if first:
                    first = False
                    yield out.role()
                if step.finish_reason is not None and strict:
                    facts.verdicts = self._validate(plan.tools, gen.session.result().tool_calls)
                if not step.empty:
                    yield out.step(step)
        if not strict:
            facts.verdicts = self._validate(plan.tools, gen.session.result().tool_calls)
        if plan.include_usage:
            yield out.usage(_usage(gen))

    async def chat_whole(
        self,
        req: pb.ChatCompletionRequest,
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.CreateChatCompletionResponse]:
        """A whole chat completion (usage always included)."""
        plan = plan_chat(
            req, assets, constrain_tool_choice_auto=replica.spec.constrain_tool_choice_auto
        )
        gen = self._generation(replica, assets, plan, "chatcmpl-", facts, chat=True)
        await _drain(gen)
        result = gen.session.result()
        facts.verdicts = self._validate(plan.tools, result.tool_calls)
        yield chunks.chat_completion(
            gen.request_id,
            int(self.clock.time()),
            replica.spec.served_model_name,
            replica.spec.revision,
            result,
            gen.finish_reason or "stop",
            _usage(gen),
        )

    async def completion_chunks(
        self,
        req: pb.CompletionRequest,
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.StreamCompletionResponse]:
        """A text completion's typed chunks (the echo before the first text), the usage."""
        plan = plan_completion(req, assets)
        gen = self._generation(replica, assets, plan, "cmpl-", facts, chat=False)
        out = chunks.CompletionChunks(
            gen.request_id,
            int(self.clock.time()),
            replica.spec.served_model_name,
            replica.spec.revision,
        )
        first = True
        async with aclosing(gen.steps()) as steps:
            async for step in steps:
                text = step.content
                if first:
                    first = False
                    text = plan.echo_text + text
                if text or step.finish_reason is not None:
                    yield out.text(text, step.finish_reason)
        if plan.include_usage:
            yield out.usage(_usage(gen))

    async def completion_whole(
        self,
        req: pb.CompletionRequest,
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.CreateCompletionResponse]:
        """A whole text completion (no chat template, no parsing)."""
        plan = plan_completion(req, assets)
        gen = self._generation(replica, assets, plan, "cmpl-", facts, chat=False)
        await _drain(gen)
        yield chunks.completion(
            gen.request_id,
            int(self.clock.time()),
            replica.spec.served_model_name,
            replica.spec.revision,
            plan.echo_text + gen.session.result().content,
            gen.finish_reason or "stop",
            _usage(gen),
        )

    async def embedding(
        self,
        req: pb.EmbeddingRequest,
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.CreateEmbeddingResponse]:
        """The embeddings of the request's inputs; their tokens and the time to the engine's
        result go on `facts`.

        Raises:
            InferplaneError: the request's rules (`pipeline/embeddings.py`) or the engine's
                error (`engine_error`).
        """
        if needs_thread(req):  # a large batch: tokenizing it would stall the event loop
            plan = await asyncio.to_thread(plan_embedding, req, assets)
        else:
            plan = plan_embedding(req, assets)
        facts.request_id = "embd-" + self.new_id()
        facts.prompt_tokens = plan.prompt_tokens
        try:
            vectors = await replica.engine.embed(
                facts.request_id, plan.inputs, dimensions=plan.dimensions
            )
        except EngineError as exc:
            raise engine_error(exc) from exc
        facts.ttft_seconds = self.clock.monotonic() - facts.started
        yield embedding_response(vectors, plan, replica.spec.served_model_name or facts.model)

    def events(
        self,
        typed: Body,
        to_json: Callable[[Any], bytes],
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """`typed`'s chunks as SSE bodies; a failure after the first byte is recorded on
        `facts` (the summary and the record say error) and becomes the stream's error event."""
        facts.framing = "sse"
        return sse_bodies(typed(replica, assets), to_json, on_error=facts.fail)

    def chat_generation(
        self,
        replica: LocalReplica,
        assets: ModelAssets,
        plan: Any,
        prefix: str,
        facts: RequestFacts,
    ) -> Generation:
        """The `Generation` of a planned chat request (`plan_chat`), its id `prefix` + a fresh
        id, recorded on `facts`: what another wire format of a conversation (Anthropic
        Messages) runs, exactly as chat does."""
        return self._generation(replica, assets, plan, prefix, facts, chat=True)

    def validate(self, tools: Sequence[Any], calls: Any) -> tuple[ToolCallVerdict, ...]:
        """Verdicts on a response's tool calls (`_validate`: strict mode raises)."""
        return self._validate(tools, calls)

    def _generation(
        self,
        replica: LocalReplica,
        assets: ModelAssets,
        plan: Any,
        prefix: str,
        facts: RequestFacts,
        *,
        chat: bool,
    ) -> Generation:
        session: OutputSession = PlainSession()
        if chat and assets.parser is not None:
            session = assets.parser.start(
                plan.prompt.thinking,
                history_tool_calls=plan.history_tool_calls,
                tool_calls=plan.tool_calls_allowed,
                tools=plan.tools,
                max_tool_calls=plan.max_tool_calls,
                constrained=plan.calls_constrained,
            )
        gen = Generation(
            engine=replica.engine,
            request_id=prefix + self.new_id(),
            prompt_ids=plan.prompt.token_ids if chat else plan.prompt_ids,
            params=with_stream_floor(plan.params, replica.spec.stream_interval),
            backend=assets.backend,
            stop_token_ids=assets.eos_token_ids,
            session=session,
            clock=self.clock,
            started=facts.started,
        )
        facts.gen = gen
        return gen

    def _validate(self, tools: Sequence[Any], calls: Any) -> tuple[ToolCallVerdict, ...]:
        """Verdicts on the response's tool calls; in strict mode an invalid call is an error.

        Raises:
            InternalError: strict mode and a call is invalid (code invalid_tool_call): the model
                produced it, not the client.
        """
        if not calls:
            return ()
        verdicts = tuple(ToolValidator(tools).validate(calls))
        bad = [v for v in verdicts if not v.valid]
        if bad and self.strict_tool_calls:
            detail = "; ".join(f"call {v.index} ({v.name}): {v.reason}: {v.message}" for v in bad)
            raise InternalError(
                f"the model produced an invalid tool call: {detail}",
                reason="INVALID_TOOL_CALL",
                code="invalid_tool_call",
            )
        return verdicts


def with_stream_floor(params: SamplingParams, floor: int) -> SamplingParams:
    """`params` with the replica's stream interval as the floor of the request's (vLLM clamps
    a request's `stream_interval` to the engine's the same way)."""
    if floor > (params.stream_interval or 1):
        return dataclasses.replace(params, stream_interval=floor)
    return params


async def _drain(gen: Generation) -> None:
    async with aclosing(gen.steps()) as steps:
        async for _ in steps:
            pass


def _usage(gen: Generation) -> pb.Usage:
    return chunks.usage(
        gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, gen.session.reasoning_tokens
    )
