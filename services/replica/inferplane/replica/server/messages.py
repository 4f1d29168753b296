"""The Anthropic Messages RPCs' bodies (CreateMessage, CountMessageTokens): the request
converted once to the chat request (`inferplane.apis.anthropic.to_chat`, the same conversion
the endpoint picker decided on), planned and generated exactly as chat (`plan_chat`,
`Bodies.chat_generation`), written as Anthropic's `Message` JSON or its events
(`pipeline/anthropic_events.py`). The field mapping, ids and stop reasons:
docs/api-messages.md.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from google.api import httpbody_pb2

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.apis import anthropic
from inferplane.replica.engines.base import LocalReplica
from inferplane.replica.pipeline import anthropic_events as events
from inferplane.replica.pipeline.assets import ModelAssets
from inferplane.replica.pipeline.generate import Generation
from inferplane.replica.pipeline.requests import ChatPlan, plan_chat
from inferplane.replica.pipeline.sse import JSON_CONTENT_TYPE
from inferplane.replica.server.bodies import Bodies
from inferplane.replica.server.facts import RequestFacts
from inferplane.replica.server.planning import planned


def _plan(request: apb.MessagesRequest, replica: LocalReplica, assets: ModelAssets) -> ChatPlan:
    chat = anthropic.to_chat(request)
    return plan_chat(
        chat, assets, constrain_tool_choice_auto=replica.spec.constrain_tool_choice_auto
    )


def _usage(gen: Generation) -> dict[str, int]:
    return events.usage(gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens)


def _model(replica: LocalReplica, facts: RequestFacts) -> str:
    return facts.model  # the served name (`{base}:{adapter}` with a LoRA adapter)


async def message_body(
    bodies: Bodies,
    request: apb.MessagesRequest,
    facts: RequestFacts,
    replica: LocalReplica,
    assets: ModelAssets,
) -> AsyncIterator[httpbody_pb2.HttpBody]:
    """One Messages request: the whole `Message` as JSON, or with `stream` its events.

    Raises:
        InvalidArgumentError: the request is refused (conversion or chat planning; 400).
        InferplaneError: the engine failed before the first byte (streamed) or at all (whole).
    """
    plan = await planned(request.ByteSize(), lambda: _plan(request, replica, assets))
    gen = bodies.chat_generation(replica, assets, plan, anthropic.MESSAGE_ID_PREFIX, facts)
    thinking = anthropic.thinking_on(request)
    show = anthropic.thinking_shown(request)
    model = _model(replica, facts)
    if not request.stream:
        async with aclosing(gen.steps()) as steps:
            async for _ in steps:
                pass
        result = gen.session.result()
        facts.verdicts = bodies.validate(plan.tools, result.tool_calls)
        finish = gen.finish_reason or "stop"
        body = events.message(
            gen.request_id,
            model,
            result,
            show_thinking=show,
            thinking=thinking,
            stop_reason=anthropic.stop_reason(finish, gen.stop_sequence),
            stop_sequence=gen.stop_sequence,
            usage_=_usage(gen),
        )
        yield httpbody_pb2.HttpBody(content_type=JSON_CONTENT_TYPE, data=events.dumps(body))
        return
    facts.framing = "sse"
    writer = events.MessageEvents(gen.request_id, model, show_thinking=show, thinking=thinking)
    batches = _event_batches(bodies, gen, plan, writer, facts)
    async with aclosing(events.sse_bodies(batches, on_error=facts.fail)) as messages:
        async for message in messages:
            yield message


async def _event_batches(
    bodies: Bodies,
    gen: Generation,
    plan: ChatPlan,
    writer: events.MessageEvents,
    facts: RequestFacts,
) -> AsyncIterator[list[events.Event]]:
    """The events of a streamed message, one batch per visible step (`message_start` with the
    first engine output: its prompt and cached tokens are known then)."""
    first = True
    async with aclosing(gen.steps()) as steps:
        async for step in steps:
            batch: list[events.Event] = []
            if first:
                first = False
                batch.extend(writer.start(_usage(gen)))
            batch.extend(writer.step(step))
            if step.finish_reason is not None:
                result = gen.session.result()
                facts.verdicts = bodies.validate(plan.tools, result.tool_calls)
                batch.extend(
                    writer.finish(
                        anthropic.stop_reason(step.finish_reason, gen.stop_sequence),
                        gen.stop_sequence,
                        _usage(gen),
                    )
                )
            yield batch


async def count_body(
    bodies: Bodies,
    request: apb.MessagesRequest,
    facts: RequestFacts,
    replica: LocalReplica,
    assets: ModelAssets,
) -> AsyncIterator[apb.CountMessageTokensResponse]:
    """`/v1/messages/count_tokens`: the tokens of the prompt the model's chat template renders
    from the request, tools and system prompt included. Nothing is generated; the summary
    reports no tokens (counting is free, as Anthropic's is), its time to result as TTFT.

    Raises:
        InvalidArgumentError: the request is refused, or its prompt does not fit the model's
            context (`context_length_exceeded`, which states the count).
    """
    started = time.perf_counter()
    plan = await planned(
        request.ByteSize(), lambda: plan_chat(anthropic.count_to_chat(request), assets)
    )
    facts.request_id = "count-" + bodies.new_id()
    facts.ttft_seconds = time.perf_counter() - started
    yield apb.CountMessageTokensResponse(input_tokens=len(plan.prompt.token_ids))
