"""The speech RPCs' bodies (CreateTranscription, CreateTranslation): the decoded upload run on
the replica's speech engine, answered in the request's `response_format` or as OpenAI's
transcript events.

`pipeline/speech.py` has the form's rules and the answer's formats, `pipeline/audio.py` the
decoding; the server reads the form (`InferenceServicer._speech`) and runs `speech_body` through
its one template like every other RPC.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from google.api import httpbody_pb2

from inferplane.replica.engines.base import EngineError, LocalReplica, SpeechEngine, SpeechUsage
from inferplane.replica.pipeline.assets import ModelAssets
from inferplane.replica.pipeline.audio import AudioError, decode_audio
from inferplane.replica.pipeline.generate import engine_error
from inferplane.replica.pipeline.speech import (
    SpeechRequest,
    duration_usage,
    render,
)
from inferplane.replica.pipeline.sse import sse_bodies
from inferplane.replica.server.bodies import Bodies
from inferplane.replica.server.facts import RequestFacts
from inferplane.runtime import InvalidArgumentError, UnavailableError


def json_bytes(payload: Any) -> bytes:
    """Compact UTF-8 JSON of an event (the speech stream's `transcript.text.*` events)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


async def speech_body(
    bodies: Bodies,
    speech: SpeechRequest,
    facts: RequestFacts,
    replica: LocalReplica,
    assets: ModelAssets,
) -> AsyncIterator[httpbody_pb2.HttpBody]:
    """One transcription or translation: the whole answer in `speech`'s format, or its
    events as SSE with `stream=true`. The decoder prompt's and the generated tokens go on
    `facts` however it ends; the time to the first result is its TTFT.

    Raises:
        UnavailableError: the replica's engine serves no speech (code bad_replica_config), or
            it failed (code engine_failed, `engine_error`).
        InvalidArgumentError: the file is not audio it can decode (param `file`, code
            invalid_file_format), or the engine refused the request.
    """
    engine = replica.engine
    if not isinstance(engine, SpeechEngine):
        raise UnavailableError(
            "this replica's engine transport cannot serve speech-to-text",
            code="bad_replica_config",
        )
    try:
        audio = await asyncio.to_thread(decode_audio, speech.file.data)
    except AudioError as exc:
        raise InvalidArgumentError(str(exc), param="file", code="invalid_file_format") from exc
    wav = audio.wav_bytes()
    facts.request_id = "audio-" + bodies.new_id()
    usage = SpeechUsage()
    try:
        if not speech.stream:
            try:
                result = await engine.transcribe(wav, speech.params, usage)
            except EngineError as exc:
                raise engine_error(exc) from exc
            facts.ttft_seconds = bodies.clock.monotonic() - facts.started
            content_type, data = render(speech, result, audio.seconds)
            yield httpbody_pb2.HttpBody(content_type=content_type, data=data)
            return
        facts.framing = "sse"
        events = _speech_events(bodies, engine, wav, speech, audio.seconds, usage, facts)
        async with aclosing(sse_bodies(events, json_bytes, on_error=facts.fail)) as messages:
            async for message in messages:
                yield message
    finally:
        facts.prompt_tokens = usage.prompt_tokens
        facts.completion_tokens = usage.completion_tokens


async def _speech_events(
    bodies: Bodies,
    engine: SpeechEngine,
    wav: bytes,
    speech: SpeechRequest,
    seconds: float,
    usage: SpeechUsage,
    facts: RequestFacts,
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's transcript events: one `transcript.text.delta` per piece of text, then
    `transcript.text.done`; an engine failure is an `InferplaneError` (an error event once
    text was sent, `sse_bodies`)."""
    pieces: list[str] = []
    try:
        async with aclosing(engine.transcribe_stream(wav, speech.params, usage)) as stream:
            async for text in stream:
                if not pieces:
                    facts.ttft_seconds = bodies.clock.monotonic() - facts.started
                pieces.append(text)
                yield {"type": "transcript.text.delta", "delta": text}
    except EngineError as exc:
        raise engine_error(exc) from exc
    yield {
        "type": "transcript.text.done",
        "text": "".join(pieces).strip(),
        "usage": duration_usage(seconds),
    }
