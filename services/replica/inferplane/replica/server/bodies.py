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
from inferplane.replica.engines.base import (
    EngineError,
    LocalReplica,
    SamplingParams,
    TokenLogprob,
)
from inferplane.replica.pipeline import chunks
from inferplane.replica.pipeline.assets import ModelAssets
from inferplane.replica.pipeline.choices import merged_steps, seed_of_choice
from inferplane.replica.pipeline.embeddings import (
    embedding_response,
    needs_thread,
    plan_embedding,
)
from inferplane.replica.pipeline.generate import Generation, OutputSession, engine_error
from inferplane.replica.pipeline.logprobs import CompletionLogprobs, TokenText, chat_logprobs
from inferplane.replica.pipeline.requests import ChatPlan, plan_chat
from inferplane.replica.pipeline.sse import sse_bodies
from inferplane.replica.pipeline.text_requests import CompletionPlan, plan_completion
from inferplane.replica.server.facts import RequestFacts
from inferplane.replica.server.planning import planned
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
        """A chat completion's typed chunks: per choice the role, one per visible step (with
        its logprobs when asked for); the usage (on every chunk with
        `continuous_usage_stats`, and last with `include_usage`)."""
        plan = await planned(
            req.ByteSize(),
            lambda: plan_chat(
                req, assets, constrain_tool_choice_auto=replica.spec.constrain_tool_choice_auto
            ),
        )
        report = plan.report
        gens = self._generations(replica, assets, plan, "chatcmpl-", facts, chat=True)
        out = chunks.ChatChunks(
            gens[0].request_id,
            int(self.clock.time()),
            facts.model,
            replica.spec.revision,
        )
        texts = TokenText(assets.backend, report.tokens_as_ids) if report.logprobs else None
        started = [False] * len(gens)
        strict = self.strict_tool_calls
        verdicts: list[ToolCallVerdict] = []
        async with aclosing(merged_steps(gens)) as steps:
            async for index, step in steps:
                if not started[index]:
                    started[index] = True
                    yield _with_usage(out.role(index), gens, report.continuous_usage)
                if step.finish_reason is not None and strict:
                    verdicts += self._validate(plan.tools, gens[index].session.result().tool_calls)
                    facts.verdicts = tuple(verdicts)
                if not report.include_reasoning:
                    step.reasoning = ""
                if not step.empty:
                    logprobs = None
                    if texts is not None and step.logprobs:
                        logprobs = chat_logprobs(step.logprobs, texts)
                    chunk = out.step(step, index, logprobs)
                    yield _with_usage(chunk, gens, report.continuous_usage)
        if not strict:
            facts.verdicts = tuple(
                v
                for gen in gens
                for v in self._validate(plan.tools, gen.session.result().tool_calls)
            )
        if plan.include_usage:
            yield out.usage(_usage_of(gens))

    async def chat_whole(
        self,
        req: pb.ChatCompletionRequest,
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.CreateChatCompletionResponse]:
        """A whole chat completion (usage always included, summed over choices)."""
        plan = await planned(
            req.ByteSize(),
            lambda: plan_chat(
                req, assets, constrain_tool_choice_auto=replica.spec.constrain_tool_choice_auto
            ),
        )
        report = plan.report
        gens = self._generations(replica, assets, plan, "chatcmpl-", facts, chat=True)
        entries = await _drain_all(gens, report.logprobs)
        texts = TokenText(assets.backend, report.tokens_as_ids) if report.logprobs else None
        results = [gen.session.result() for gen in gens]
        facts.verdicts = tuple(
            v for result in results for v in self._validate(plan.tools, result.tool_calls)
        )
        logprobs = [chat_logprobs(e, texts) if texts is not None else None for e in entries]
        yield chunks.chat_completion(
            gens[0].request_id,
            int(self.clock.time()),
            facts.model,
            replica.spec.revision,
            results[0],
            gens[0].finish_reason or "stop",
            _usage_of(gens),
            logprobs=logprobs[0],
            more=[
                chunks.chat_choice(
                    i,
                    results[i],
                    gens[i].finish_reason or "stop",
                    logprobs[i],
                    reasoning=report.include_reasoning,
                )
                for i in range(1, len(gens))
            ],
            reasoning=report.include_reasoning,
        )

    async def completion_chunks(
        self,
        req: pb.CompletionRequest,
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.StreamCompletionResponse]:
        """A text completion's typed chunks (per choice the echo before its first text, its
        logprobs when asked for), the usage (see `chat_chunks`)."""
        plan = await planned(req.ByteSize(), lambda: plan_completion(req, assets), param="prompt")
        report = plan.report
        gens = self._generations(replica, assets, plan, "cmpl-", facts, chat=False)
        out = chunks.CompletionChunks(
            gens[0].request_id,
            int(self.clock.time()),
            facts.model,
            replica.spec.revision,
        )
        logprobs = None
        if report.logprobs:
            texts = TokenText(assets.backend, report.tokens_as_ids)
            logprobs = [CompletionLogprobs(texts, len(plan.echo_text)) for _ in gens]
        started = [False] * len(gens)
        async with aclosing(merged_steps(gens)) as steps:
            async for index, step in steps:
                text = step.content
                if not started[index]:
                    started[index] = True
                    text = plan.echo_text + text
                if text or step.finish_reason is not None:
                    value = None
                    if logprobs is not None and step.logprobs:
                        value = logprobs[index].build(step.logprobs)
                    chunk = out.text(text, step.finish_reason, index, value)
                    yield _with_usage(chunk, gens, report.continuous_usage)
        if plan.include_usage:
            yield out.usage(_usage_of(gens))

    async def completion_whole(
        self,
        req: pb.CompletionRequest,
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.CreateCompletionResponse]:
        """A whole text completion (no chat template, no parsing)."""
        plan = await planned(req.ByteSize(), lambda: plan_completion(req, assets), param="prompt")
        report = plan.report
        gens = self._generations(replica, assets, plan, "cmpl-", facts, chat=False)
        entries = await _drain_all(gens, report.logprobs)
        texts = TokenText(assets.backend, report.tokens_as_ids) if report.logprobs else None
        logprobs = [
            CompletionLogprobs(texts, len(plan.echo_text)).build(e) if texts is not None else None
            for e in entries
        ]
        texts_out = [plan.echo_text + gen.session.result().content for gen in gens]
        yield chunks.completion(
            gens[0].request_id,
            int(self.clock.time()),
            facts.model,
            replica.spec.revision,
            texts_out[0],
            gens[0].finish_reason or "stop",
            _usage_of(gens),
            logprobs=logprobs[0],
            more=[
                chunks.completion_choice(
                    i, texts_out[i], gens[i].finish_reason or "stop", logprobs[i]
                )
                for i in range(1, len(gens))
            ],
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
        *,
        engine: Any = None,
    ) -> Generation:
        """The `Generation` of a planned chat request (`plan_chat`), its id `prefix` + a fresh
        id, recorded on `facts`: what another wire format of a conversation (Anthropic
        Messages, OpenAI Responses) runs, exactly as chat does. `engine`: a wrapper of the
        replica's engine to run it on (the Responses body keeps the generated ids), else the
        replica's own."""
        return self._generation(replica, assets, plan, prefix, facts, chat=True, engine=engine)

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
        choice: int = 0,
        request_id: str | None = None,
        engine: Any = None,
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
        params = with_stream_floor(plan.params, replica.spec.stream_interval)
        if facts.adapter is not None:  # the request's LoRA adapter (the template resolved it)
            params = dataclasses.replace(params, adapter=facts.adapter)
        if choice:
            params = dataclasses.replace(params, seed=seed_of_choice(params.seed, choice))
        gen = Generation(
            engine=engine if engine is not None else facts.engine_of(replica),
            request_id=request_id or prefix + self.new_id(),
            prompt_ids=plan.prompt.token_ids if chat else plan.prompt_ids,
            params=params,
            backend=assets.backend,
            stop_token_ids=assets.eos_token_ids,
            session=session,
            clock=self.clock,
            started=facts.started,
        )
        if not choice:
            facts.gen = gen
        return gen

    def _generations(
        self,
        replica: LocalReplica,
        assets: ModelAssets,
        plan: ChatPlan | CompletionPlan,
        prefix: str,
        facts: RequestFacts,
        *,
        chat: bool,
    ) -> list[Generation]:
        """The request's `plan.report.n` generations: choice 0 as `_generation` makes it (the
        response's id, `facts.gen`), choice i its own engine request `{id}-{i}` with the seed
        + i; all are on `facts.choices` (the usage ledger and the trailers count them all)."""
        first = self._generation(replica, assets, plan, prefix, facts, chat=chat)
        gens = [first]
        for i in range(1, plan.report.n):
            gens.append(
                self._generation(
                    replica,
                    assets,
                    plan,
                    prefix,
                    facts,
                    chat=chat,
                    choice=i,
                    request_id=f"{first.request_id}-{i}",
                )
            )
        if len(gens) > 1:
            facts.choices = tuple(gens)
        return gens

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


async def _drain_all(gens: Sequence[Generation], logprobs: bool) -> list[list[TokenLogprob]]:
    """Runs the generations to their end; returns each one's logprobs (empty lists without)."""
    entries: list[list[TokenLogprob]] = [[] for _ in gens]
    async with aclosing(merged_steps(gens)) as steps:
        async for index, step in steps:
            if logprobs and step.logprobs:
                entries[index].extend(step.logprobs)
    return entries


def _usage_of(gens: Sequence[Generation]) -> pb.Usage:
    """The request's usage: the prompt once (the engine's prefix cache serves it to the other
    choices, and OpenAI counts it once), every choice's generated and reasoning tokens."""
    first = gens[0]
    return chunks.usage(
        first.prompt_tokens,
        sum(gen.completion_tokens for gen in gens),
        first.cached_tokens,
        sum(gen.session.reasoning_tokens for gen in gens),
    )


def _with_usage(chunk: Any, gens: Sequence[Generation], continuous: bool) -> Any:
    """`chunk` with the usage so far when `continuous_usage_stats` asked for it."""
    if continuous:
        chunk.usage.CopyFrom(_usage_of(gens))
    return chunk
