"""Mid-stream migration (issue 31): a stream outlives its engine.

When a replica's engine dies after the first byte of a response, the replica process is still
up: it owns the client's stream (through Envoy), the incremental detokenizer and the parser
session. `MigratingEngine` wraps the replica's engine for one request: it passes the engine's
increments through and keeps their token ids; when the engine fails mid-way it sends the
prompt followed by those ids to a sibling replica of the same profile revision
(`ReplicaProcessService.ContinueGeneration`, the node-agent identity: every replica process
presents it) and passes the sibling's increments on as if its own engine had made them. The
`Generation` above sees one stream: no error event, no token repeated or lost, one usage
(the original prompt, every generated token; the sibling reports nothing of its own).

Which streams move:
- the engine failed (`EngineError`, not a refusal) after it produced output; a failure before
  output is left to Envoy, which retries the request on the next replica of the pick;
- the request has no structured-output constraint (json_schema, regex, grammar, choice, the
  constrained tool calls' structural tag): vLLM's constraint backends compile the grammar from
  the first generated token, and the tokens already generated reach the sibling as prompt, so
  its grammar cannot be advanced by them; such a stream ends with an error event as before
  (`inferplane_stream_migrations_total{outcome="constrained"}`);
- a sibling is named by the picker (`headers.SIBLINGS`: the pick's replicas from the routing
  table), runs the same revision, and takes it within `SIBLING_ANSWER_SECONDS` (it counts the
  continuation as a request in flight and refuses beyond its `max_num_seqs`); siblings are
  tried in the pick's order, and when none takes it the stream ends with an error event.

Sampling: limits count down (`max_tokens`, `min_tokens` minus the tokens generated); a seed
restarts at the sibling, so a seeded sampled stream is a valid sample, not the one the dead
engine would have drawn; greedy output is the same. Repetition penalties see the generated
tokens as prompt on the sibling (frequency and presence penalties apply to the continuation's
own output only).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter

from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.replica.engines.base import (
    EngineClient,
    EngineError,
    EngineOutput,
    SamplingParams,
    TokenLogprob,
    TracksRequests,
)
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.wire.siblings import Sibling

log = structlog.get_logger("inferplane.replica.migration")

SIBLING_ANSWER_SECONDS = 10.0
"""How long a sibling may take to send its first increment before the next one is tried."""

OUTCOMES = ("migrated", "no_sibling", "constrained", "failed")


class MigrationMetrics:
    """`inferplane_stream_migrations_total{outcome}`: streams whose engine failed after output,
    by what happened: migrated (a sibling took it), no_sibling (none named or none took it),
    constrained (a structured-output stream, not movable), failed (the sibling failed after
    taking it: also counted as migrated)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.streams = Counter(
            "inferplane_stream_migrations",
            "Streams whose engine failed after output, by outcome: migrated (a sibling "
            "replica continued it), no_sibling, constrained (structured output: not movable), "
            "failed (the sibling failed after taking it).",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.streams.labels(outcome)


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """The replica a stream starts on: its id, profile revision and served model name."""

    replica_id: str
    revision: str
    served_model_name: str


class Migrator:
    """Continues streams on siblings: one gRPC channel per sibling address (kept), the metric.

    Args:
        origin: this replica.
        security: the identity this process presents to its siblings (mTLS) or plaintext.
        registry: where `inferplane_stream_migrations_total` is registered.
        answer_seconds: `SIBLING_ANSWER_SECONDS`.
        channel_options: the siblings' channel options (keepalive, the identity their
            certificates are checked against).
    """

    def __init__(
        self,
        origin: Origin,
        security: PeerSecurity,
        registry: CollectorRegistry,
        *,
        answer_seconds: float = SIBLING_ANSWER_SECONDS,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._options = tuple(channel_options)
        self.origin = origin
        self.metrics = MigrationMetrics(registry)
        self._security = security
        self._answer_seconds = answer_seconds
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.active = 0  # streams running on a sibling now

    def wrap(
        self, engine: EngineClient, siblings: Sequence[Sibling], adapter: tuple[str, str] = ("", "")
    ) -> MigratingEngine:
        """`engine` for one request whose pick named `siblings` (this replica and other
        revisions are left out); `adapter`: its LoRA adapter's (name, folder)."""
        origin = self.origin
        usable = tuple(
            s
            for s in siblings
            if s.replica_id != origin.replica_id and s.revision == origin.revision
        )
        return MigratingEngine(engine, self, usable, adapter)

    async def continuation(
        self,
        siblings: Sequence[Sibling],
        request: replica_pb2.ContinueGenerationRequest,
    ) -> tuple[Sibling, AsyncIterator[replica_pb2.ContinueGenerationResponse]] | None:
        """The first sibling that takes `request` and its stream (its first increment already
        read and replayed), or None when none did."""
        for sibling in siblings:
            stub = replica_pb2_grpc.ReplicaProcessServiceStub(self._channel(sibling.address))
            call = stub.ContinueGeneration(request)
            try:
                first = await asyncio.wait_for(call.read(), self._answer_seconds)
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                call.cancel()
                log.warning(
                    "migration_sibling_refused",
                    request_id=request.request_id,
                    sibling=sibling.replica_id,
                    error=str(exc.code() if isinstance(exc, grpc.aio.AioRpcError) else exc),
                )
                continue
            if first is grpc.aio.EOF:
                call.cancel()
                continue
            return sibling, _replayed(first, call)
        return None

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._security.aio_channel(address, self._options)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        """Closes the siblings' channels."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


async def _replayed(
    first: replica_pb2.ContinueGenerationResponse, call: Any
) -> AsyncIterator[replica_pb2.ContinueGenerationResponse]:
    try:
        yield first
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                return
            yield message
    finally:
        call.cancel()  # the client went away or the stream finished: nothing left there


class MigratingEngine:
    """One request's engine: the replica's, continued on a sibling if it fails mid-way (module
    docstring). `generate` is the only generation it serves; `abort` reaches both."""

    def __init__(
        self,
        inner: EngineClient,
        migrator: Migrator,
        siblings: tuple[Sibling, ...],
        adapter: tuple[str, str],
    ) -> None:
        self._inner = inner
        self._migrator = migrator
        self._siblings = siblings
        self._adapter = adapter
        self._tracking = inner if isinstance(inner, TracksRequests) else None

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """The engine's increments, then the sibling's after a failure mid-way (their counts
        made the request's: the original prompt, cached tokens as the engine said, completion
        tokens generated here plus there).

        Raises:
            EngineError: as the engine's, when the stream cannot move (module docstring) or the
                sibling failed after taking it.
        """
        generated: list[int] = []
        cached = 0
        try:
            async for out in self._inner.generate(request_id, prompt_token_ids, params):
                generated.extend(out.token_ids)
                cached = out.cached_tokens or cached
                yield out
                if out.finished:
                    return
            return  # ended without a finish: the Generation says so
        except EngineError as exc:
            if exc.rejected or not generated:
                raise
            failure = exc
        outcome = self._refusal(params)
        if outcome:
            self._migrator.metrics.streams.labels(outcome).inc()
            log.warning("stream_not_migrated", request_id=request_id, reason=outcome)
            raise failure
        left = params.max_tokens - len(generated)
        base = EngineOutput((), prompt_tokens=len(prompt_token_ids), cached_tokens=cached)
        if left <= 0:  # it died on the last token: nothing left to generate
            yield dataclasses.replace(
                base, finished=True, finish_reason="length", completion_tokens=len(generated)
            )
            return
        async for out in self._continue(request_id, prompt_token_ids, generated, params, failure):
            yield dataclasses.replace(
                out,
                prompt_tokens=base.prompt_tokens,
                cached_tokens=base.cached_tokens,
                completion_tokens=len(generated) + out.completion_tokens,
            )

    def _refusal(self, params: SamplingParams) -> str:
        """Why the stream cannot move ("" when it can)."""
        if params.constraint is not None:
            return "constrained"
        if not self._siblings:
            return "no_sibling"
        return ""

    async def _continue(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        generated: list[int],
        params: SamplingParams,
        failure: EngineError,
    ) -> AsyncIterator[EngineOutput]:
        migrator = self._migrator
        request = replica_pb2.ContinueGenerationRequest(
            request_id=request_id,
            revision=migrator.origin.revision,
            served_model_name=migrator.origin.served_model_name,
            token_ids=[*prompt_ids, *generated],
            generated_tokens=len(generated),
            params=continuation_params(params, len(generated)),
            adapter=self._adapter[0],
            adapter_source=self._adapter[1],
        )
        migrator.active += 1  # from the search on: the dying replica waits for it
        try:
            found = await migrator.continuation(self._siblings, request)
            if found is None:
                migrator.metrics.streams.labels("no_sibling").inc()
                log.warning("stream_not_migrated", request_id=request_id, reason="no_sibling")
                raise failure
            sibling, stream = found
            log.info(
                "stream_migrated",
                request_id=request_id,
                sibling=sibling.replica_id,
                error=str(failure),
                generated_ids=generated,
            )
            migrator.metrics.streams.labels("migrated").inc()
            try:
                async for message in stream:
                    yield output_of(message)
            except grpc.aio.AioRpcError as exc:
                migrator.metrics.streams.labels("failed").inc()
                raise EngineError(f"the sibling {sibling.replica_id} failed: {exc.code()}") from exc
        finally:
            migrator.active -= 1

    async def abort(self, request_id: str) -> None:
        """Aborts the request in the replica's engine (a sibling's part ends when its stream
        is closed, which the generation does first)."""
        await self._inner.abort(request_id)

    # `TracksRequests`, for the replica's own engine.
    def was_shut(self, request_id: str) -> bool:
        return self._tracking.was_shut(request_id) if self._tracking is not None else False

    def release(self, request_id: str, *, failed: bool) -> None:
        if self._tracking is not None:
            self._tracking.release(request_id, failed=failed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # embed, healthy, close: the replica's engine


def continuation_params(params: SamplingParams, generated: int) -> replica_pb2.ContinuationParams:
    """`params` for the rest of a generation `generated` tokens in (limits counted down)."""
    msg = replica_pb2.ContinuationParams(
        max_tokens=max(1, params.max_tokens - generated),
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logit_bias=[replica_pb2.TokenBias(token_id=t, bias=b) for t, b in params.logit_bias],
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "logprobs",
        "stream_interval",
    ):
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.min_tokens is not None:
        msg.min_tokens = max(0, params.min_tokens - generated)
    return msg


def params_of(msg: replica_pb2.ContinuationParams) -> SamplingParams:
    """The engine's `SamplingParams` of a continuation (no adapter: the caller resolves it)."""

    def opt(name: str) -> Any:
        return getattr(msg, name) if msg.HasField(name) else None

    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=opt("temperature"),
        top_p=opt("top_p"),
        top_k=opt("top_k"),
        min_p=opt("min_p"),
        min_tokens=opt("min_tokens"),
        presence_penalty=opt("presence_penalty"),
        frequency_penalty=opt("frequency_penalty"),
        repetition_penalty=opt("repetition_penalty"),
        seed=opt("seed"),
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=opt("logprobs"),
        logit_bias=tuple((b.token_id, b.bias) for b in msg.logit_bias),
        skip_special_tokens=msg.skip_special_tokens,
        stream_interval=opt("stream_interval"),
        include_stop_str_in_output=msg.include_stop_str_in_output,
    )


def message_of(out: EngineOutput) -> replica_pb2.ContinueGenerationResponse:
    """One engine increment on the wire (counts: the sibling's own)."""
    msg = replica_pb2.ContinueGenerationResponse(
        token_ids=list(out.token_ids),
        finished=out.finished,
        finish_reason=out.finish_reason or "",
        completion_tokens=out.completion_tokens,
    )
    for lp in out.logprobs or ():
        msg.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[replica_pb2.TokenBias(token_id=t, bias=v) for t, v in lp.top],
        )
    return msg


def output_of(msg: replica_pb2.ContinueGenerationResponse) -> EngineOutput:
    """A sibling's increment as an engine increment (its own counts)."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    if msg.logprobs:
        logprobs = tuple(
            TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.bias) for t in lp.top))
            for lp in msg.logprobs
        )
    return EngineOutput(
        token_ids=tuple(msg.token_ids),
        finished=msg.finished,
        finish_reason=msg.finish_reason or None,
        completion_tokens=msg.completion_tokens,
        logprobs=logprobs,
    )
