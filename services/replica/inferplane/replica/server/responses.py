"""The body of `CreateResponse` (OpenAI's `POST /v1/responses`), unary and streamed, on the
chat pipeline: load the stored conversation behind `previous_response_id` → convert
(`inferplane.apis.responses`) → `plan_chat` → splice the stored turn's token ids into the
prompt (`pipeline/responses_replay.py`) → the `Generation` → the Response object or its events
(`pipeline/responses_events.py`) → save the finished response when `store` is on.

- Errors before the engine's first output are raised (the edge answers them in OpenAI's shape;
  Envoy may retry an UNAVAILABLE elsewhere): nothing is written before the first engine step,
  not even `response.created`. After it, a failure is `response.failed` then an `error` event,
  and the facts record it (never a stream that looks complete).
- `store` (true by default, as OpenAI's): the finished response (completed or incomplete) is
  saved in the response store (auth) before the client sees `response.completed` or the
  object; a failed save is the request's error (`response_store_unavailable`), never a turn
  reported stored that is not. A request without a tenant (no edge: tests, direct gRPC
  callers) or a replica without a store is answered with `"store": false`.
- The response id is the engine request id (`resp_` + hex).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

from google.api import httpbody_pb2

from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.apis import responses as api
from inferplane.replica.engines.base import LocalReplica
from inferplane.replica.pipeline.assets import ModelAssets
from inferplane.replica.pipeline.generate import Generation
from inferplane.replica.pipeline.requests import ChatPlan, plan_chat
from inferplane.replica.pipeline.responses_events import ResponseWriter, sse, usage
from inferplane.replica.pipeline.responses_replay import probe_messages, splice
from inferplane.replica.server.bodies import Bodies
from inferplane.replica.server.facts import RequestFacts
from inferplane.replica.server.planning import planned
from inferplane.replica.server.response_store import ResponseStore
from inferplane.runtime import InferplaneError, InvalidArgumentError, UnavailableError
from inferplane.wire import chat_request_from_dict, chat_request_to_dict

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
_ITEM_PREFIX = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "reasoning": "rs_",
}


@dataclasses.dataclass(frozen=True, slots=True)
class ResponsesBody:
    """Serves `CreateResponse` on the replica.

    Args:
        bodies: the chat bodies' settings (clock, ids, tool-call strictness).
        store: the response store (None: nothing is stored, `previous_response_id` is a 503).
    """

    bodies: Bodies
    store: ResponseStore | None = None

    async def run(
        self,
        request: rpb.ResponseRequest,
        tenant: str,
        facts: RequestFacts,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """The response: one `HttpBody` (JSON) or SSE events (`request.stream`)."""
        history, stored = await self._history(request, tenant)
        converted = api.convert(request, history)
        plan = await planned(
            converted.chat.ByteSize(),
            lambda: plan_chat(
                converted.chat,
                assets,
                constrain_tool_choice_auto=replica.spec.constrain_tool_choice_auto,
            ),
            param="input",
        )
        render_key = _render_key(converted.body, plan)
        if stored is not None and stored.render_key == render_key:
            plan = _replayed(plan, converted, stored, assets, replica)
        if request.HasField("max_tool_calls"):
            if request.max_tool_calls < 1:
                raise InvalidArgumentError(
                    "'max_tool_calls' must be at least 1", param="max_tool_calls"
                )
            cap = min(request.max_tool_calls, plan.max_tool_calls or request.max_tool_calls)
            plan = dataclasses.replace(plan, max_tool_calls=cap)
        recorder = _Recording(facts.engine_of(replica))
        gen = self.bodies.chat_generation(replica, assets, plan, "resp_", facts, engine=recorder)
        store_it = request.store if request.HasField("store") else True
        store_it = store_it and self.store is not None and bool(tenant)
        writer = ResponseWriter(
            _head(
                converted.body,
                facts.model,
                store_it,
                self.bodies.clock.time(),
            ),
            gen.request_id,
            self.bodies.new_id,
            summary=bool((converted.body.get("reasoning") or {}).get("summary")),
            encrypted_reasoning=converted.encrypted_reasoning,
            namespaced=converted.namespaced,
        )
        stream = bool(request.stream)
        if stream:
            facts.framing = "sse"
        started = False
        try:
            async with aclosing(gen.steps()) as steps:
                async for step in steps:
                    events = [] if started else writer.start()
                    started = True
                    events += writer.step(step)
                    if stream and events:
                        yield _events(events)
            facts.verdicts = self.bodies.validate(plan.tools, gen.session.result().tool_calls)
            used = usage(
                gen.prompt_tokens,
                gen.cached_tokens,
                gen.completion_tokens,
                gen.session.reasoning_tokens,
            )
            final = writer.finish(gen.finish_reason or "stop", used)
            if store_it:
                await self._save(
                    request,
                    tenant,
                    history,
                    converted,
                    writer,
                    used,
                    gen,
                    recorder,
                    render_key,
                    plan,
                )
        except InferplaneError as exc:
            if not (stream and started):
                raise
            facts.fail(exc)
            yield _events(writer.fail(exc.code, exc.message, exc.param))
            return
        if stream:
            yield _events(final)
        else:
            body = json.dumps(final[-1]["response"], separators=(",", ":"), ensure_ascii=False)
            yield httpbody_pb2.HttpBody(content_type=JSON, data=body.encode())

    # -- the store -----------------------------------------------------------------------------

    async def _history(
        self, request: rpb.ResponseRequest, tenant: str
    ) -> tuple[list[dict[str, Any]], rpb.LoadResponseResponse | None]:
        """The stored conversation's items (its input items, then its output) and the stored
        response, or `([], None)` without `previous_response_id`.

        Raises:
            NotFoundError: unknown to the tenant (param `previous_response_id`).
            UnavailableError: no store, or it cannot be reached.
        """
        previous = request.previous_response_id
        if not previous:
            return [], None
        if self.store is None or not tenant:
            raise UnavailableError(
                "'previous_response_id' needs the response store, which this replica has not "
                "been given",
                code="response_store_unavailable",
            )
        stored = await self.store.load(tenant, previous)
        items = json.loads(stored.input_items_json)
        items += json.loads(stored.response_json).get("output", [])
        return items, stored

    async def _save(
        self,
        request: rpb.ResponseRequest,
        tenant: str,
        history: Sequence[Mapping[str, Any]],
        converted: api.Converted,
        writer: ResponseWriter,
        used: Mapping[str, Any],
        gen: Generation,
        recorder: _Recording,
        render_key: str,
        plan: ChatPlan,
    ) -> None:
        assert self.store is not None
        items = [*history, *(self._with_id(item) for item in converted.items)]
        status = "incomplete" if gen.finish_reason == "length" else "completed"
        response = writer.response(status, used)
        await self.store.save(
            rpb.SaveResponseRequest(
                tenant=tenant,
                response_id=writer.response_id,
                model=response["model"],
                previous_response_id=request.previous_response_id,
                response_json=json.dumps(response, separators=(",", ":")).encode(),
                input_items_json=json.dumps(items, separators=(",", ":")).encode(),
                prompt_token_ids=plan.prompt.token_ids,
                output_token_ids=recorder.ids,
                render_key=render_key,
                created_at=int(response["created_at"]),
            )
        )

    def _with_id(self, item: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(item)
        if not out.get("id"):
            out["id"] = _ITEM_PREFIX.get(str(out.get("type")), "item_") + self.bodies.new_id()
        return out


class _Recording:
    """The replica's engine, keeping the ids it generates for a request (the stored response
    replays them); everything else is the engine's own (`TracksRequests` included)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.ids: list[int] = []

    async def generate(self, request_id: str, prompt_ids: Any, params: Any) -> AsyncIterator[Any]:
        async with aclosing(self._engine.generate(request_id, prompt_ids, params)) as outputs:
            async for out in outputs:
                self.ids.extend(out.token_ids)
                yield out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _replayed(
    plan: ChatPlan,
    converted: api.Converted,
    stored: rpb.LoadResponseResponse,
    assets: ModelAssets,
    replica: LocalReplica,
) -> ChatPlan:
    """`plan` with the stored turn's prompt and output ids in place of the rendered history
    (`responses_replay.splice`), or unchanged when they cannot be spliced.

    Raises:
        InvalidArgumentError: the spliced prompt (longer than the rendering when the template
            drops history reasoning) leaves no room for the output (context_length_exceeded).
    """
    body = chat_request_to_dict(converted.chat)
    messages = body.get("messages", [])
    if converted.history_messages >= len(messages):
        return plan
    body["messages"] = probe_messages(messages, converted.history_messages)
    probed = plan_chat(
        chat_request_from_dict(body),
        assets,
        constrain_tool_choice_auto=replica.spec.constrain_tool_choice_auto,
    )
    ids = splice(
        plan.prompt.token_ids,
        probed.prompt.token_ids,
        stored.prompt_token_ids,
        stored.output_token_ids,
        assets.eos_token_ids,
    )
    if ids is None:
        return plan
    room = assets.max_model_len - len(ids)
    requested = (
        converted.chat.max_completion_tokens
        if converted.chat.HasField("max_completion_tokens")
        else None
    )
    if room <= 0 or (requested is not None and requested > room):
        raise InvalidArgumentError(
            f"This model's maximum context length is {assets.max_model_len} tokens. However, "
            f"the conversation replayed from 'previous_response_id' holds {len(ids)} tokens"
            + (f" and {requested} were requested for the output." if requested else "."),
            param="input",
            code="context_length_exceeded",
        )
    params = (
        plan.params if requested is not None else dataclasses.replace(plan.params, max_tokens=room)
    )
    prompt = dataclasses.replace(plan.prompt, token_ids=ids)
    return dataclasses.replace(plan, prompt=prompt, params=params)


def _render_key(body: Mapping[str, Any], plan: ChatPlan) -> str:
    """What rendered the prompt's head and the output's format: a turn replays a stored
    prompt only when this is equal (`api.settings_json`, and the thinking switch)."""
    text = api.settings_json(body) + ("|thinking" if plan.prompt.thinking else "")
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _head(body: Mapping[str, Any], model: str, stored: bool, now: float) -> dict[str, Any]:
    """The Response object's echo of the request's settings (OpenAI's defaults where unset)."""
    reasoning = body.get("reasoning") or {}
    text = dict(body.get("text") or {})
    text.setdefault("format", {"type": "text"})
    return {
        "created_at": int(now),
        "model": model,
        "instructions": body.get("instructions"),
        "tools": body.get("tools", []),
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "text": text,
        "truncation": body.get("truncation", "disabled"),
        "metadata": body.get("metadata", {}),
        "store": stored,
        "background": False,
        "service_tier": "default",
        "top_logprobs": 0,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "safety_identifier": body.get("safety_identifier"),
        "user": body.get("user"),
    }


def _events(events: Sequence[Mapping[str, Any]]) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type=EVENT_STREAM, data=b"".join(sse(e) for e in events))
