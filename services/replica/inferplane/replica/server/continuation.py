"""`ReplicaProcessService.ContinueGeneration`: this replica continues a sibling's stream whose
engine died (issue 31; the caller's side: `inferplane.replica.engines.migration`).

The request carries the prompt and the tokens generated so far as token ids; this replica's
engine generates the rest and streams the ids back (the caller detokenizes and parses them in
the client's own session). It is one request in flight here (`ReplicaState.admit`: refused
while not ready, draining or dead, so the caller tries the next sibling), and refused with
RESOURCE_EXHAUSTED when the replica already has `max_num_seqs` requests in flight: a
continuation must not queue behind a full batch while the client waits. The caller reports the
request's usage and records; this side reports nothing (one request, counted once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import structlog

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.replica.engines.base import EngineError
from inferplane.replica.engines.lora import AdapterRegistry
from inferplane.replica.engines.migration import message_of, params_of
from inferplane.replica.pipeline.generate import engine_error
from inferplane.replica.state import ReplicaState
from inferplane.runtime import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
)

log = structlog.get_logger("inferplane.replica.continuation")


class Continuations:
    """Serves continuations on this replica's engine.

    Args:
        state: the replica (its spec, admission and engine).
        adapters: resolves the request's LoRA adapter as a chat request's headers would.
    """

    def __init__(self, state: ReplicaState, adapters: AdapterRegistry) -> None:
        self._state = state
        self._adapters = adapters

    async def serve(
        self, request: replica_pb2.ContinueGenerationRequest
    ) -> AsyncIterator[replica_pb2.ContinueGenerationResponse]:
        """The rest of the generation, increment by increment (counts: this replica's own).

        Raises:
            FailedPreconditionError: another revision or model (code revision_mismatch).
            InvalidArgumentError: no token ids or no `max_tokens`.
            ResourceExhaustedError: `max_num_seqs` requests in flight (code replica_full).
            UnavailableError: not admitting (`ReplicaState.admit`), or the engine failed.
        """
        state, spec = self._state, self._state.spec
        if request.revision != spec.revision or request.served_model_name != (
            spec.served_model_name
        ):
            raise FailedPreconditionError(
                f"replica {state.replica_id} runs {spec.served_model_name!r} revision "
                f"{spec.revision!r}, not {request.served_model_name!r} {request.revision!r}",
                code="revision_mismatch",
            )
        if not request.token_ids or request.params.max_tokens < 1:
            raise InvalidArgumentError("a continuation needs token ids and max_tokens")
        if spec.max_num_seqs and state.in_flight >= spec.max_num_seqs:
            raise ResourceExhaustedError(
                f"replica {state.replica_id} has {state.in_flight} requests in flight",
                code="replica_full",
            )
        params = params_of(request.params)
        if request.adapter:
            adapter = self._adapters.resolve(request.adapter, request.adapter_source)
            params = dataclasses.replace(params, adapter=adapter)
        engine_id = f"{request.request_id}-cont-{state.replica_id}"
        generated: list[int] = []
        async with state.admit():
            log.info(
                "continuation_started",
                request_id=request.request_id,
                prompt_tokens=len(request.token_ids) - request.generated_tokens,
                generated_tokens=request.generated_tokens,
            )
            try:
                async for out in state.engine.generate(engine_id, request.token_ids, params):
                    generated.extend(out.token_ids)
                    yield message_of(out)
            except EngineError as exc:
                raise engine_error(exc) from exc
            finally:
                log.info(
                    "continuation_ended",
                    request_id=request.request_id,
                    continued_ids=generated,
                )
