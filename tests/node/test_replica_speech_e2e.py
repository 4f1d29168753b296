"""A real replica process (`python -m inferplane.replica`, from the node-agent's own
launch plan) on the speech fixture model `whisper-tiny` (task `transcribe`, `inproc`), over gRPC
with the client's multipart bodies as the edge passes them (CreateTranscription's HttpBody):
the fixture's programmed transcript in every response format, 16 kHz and 44.1 kHz WAV, SSE
streaming, translations, the summary trailers' tokens; a garbage file is a 400 naming `file`, a
chat request is refused naming `model`.

Prints the start-up time and the latency of a 1 s transcription (median of 5)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.api import httpbody_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import whisper_tiny as wt
from inferplane.node_agent.supervisor.process import EngineProcess, ProcessSpawner, plan_launch
from inferplane.replica.testing.pipeline import whisper_tiny_spec
from inferplane.wire import ResponseSummary, chat_request_from_dict

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

READY_SECONDS = 180
TRANSCRIPT = wt.TRANSCRIPT.strip()


def form(file: bytes, **fields: Any) -> httpbody_pb2.HttpBody:
    """A multipart body as the openai client (httpx) writes it."""
    data = {"model": wt.SERVED_MODEL_NAME, **{k: str(v) for k, v in fields.items()}}
    request = httpx.Request(
        "POST", "http://x", data=data, files={"file": ("audio.wav", file, "audio/wav")}
    )
    return httpbody_pb2.HttpBody(content_type=request.headers["content-type"], data=request.read())


def test_a_replica_transcribes_in_every_format(tmp_path: Path) -> None:
    spec = whisper_tiny_spec()
    spec.kv_cache_bytes = 1 << 30
    plan = plan_launch("e2e-speech", spec, data_dir=tmp_path, cpu=True)

    async def run() -> None:
        process = await ProcessSpawner().spawn(plan)
        assert isinstance(process, EngineProcess)
        try:
            await _scenario(process, plan.inference_address)
        except BaseException:
            print(plan.log_path.read_text(errors="replace")[-6000:])
            raise
        finally:
            code = await process.stop(20)
        assert code == 0, f"the replica exited with {code} on SIGTERM"

    asyncio.run(run())


async def _transcribe(
    stub: inference_pb2_grpc.InferenceServiceStub, body: httpbody_pb2.HttpBody, *, translate=False
) -> tuple[str, bytes, ResponseSummary]:
    method = stub.CreateTranslation if translate else stub.CreateTranscription
    request_type = pb.CreateTranslationRequest if translate else pb.CreateTranscriptionRequest
    call = method(request_type(body=body))
    messages = [m async for m in call]
    summary = ResponseSummary.from_metadata(await call.trailing_metadata())
    return messages[0].content_type, b"".join(m.data for m in messages), summary


async def _scenario(process: EngineProcess, address: str) -> None:
    started = time.monotonic()
    options = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
    ]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = None
        while status != health_pb2.HealthCheckResponse.SERVING:
            assert process.returncode is None, "the replica exited during start-up"
            assert time.monotonic() - started < READY_SECONDS, "not ready in time"
            try:
                status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
            except grpc.aio.AioRpcError:
                status = None
            await asyncio.sleep(0.5)
        print(f"\nreplica_ready_seconds: {time.monotonic() - started:.1f}")
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        wav16 = wt.tone_wav_bytes(seconds=1.5)
        wav44 = wt.tone_wav_bytes(sample_rate=44100, seconds=2.2)

        # json: the programmed transcript and the duration usage (whole seconds, rounded up).
        kind, data, summary = await _transcribe(stub, form(wav16))
        assert kind == "application/json"
        assert json.loads(data) == {"text": TRANSCRIPT, "usage": {"type": "duration", "seconds": 2}}
        assert summary.finish_reason == "stop" and summary.completion_tokens > 0
        assert summary.prompt_tokens > 0 and summary.replica_id

        # 44.1 kHz is resampled: the same transcript, 3 s billed.
        kind, data, _ = await _transcribe(stub, form(wav44, language="en"))
        assert json.loads(data)["usage"]["seconds"] == 3
        assert json.loads(data)["text"] == TRANSCRIPT

        kind, data, _ = await _transcribe(stub, form(wav16, response_format="text"))
        assert kind.startswith("text/plain") and data.decode() == TRANSCRIPT + "\n"

        kind, data, _ = await _transcribe(stub, form(wav16, response_format="verbose_json"))
        verbose = json.loads(data)
        assert verbose["task"] == "transcribe" and verbose["language"] == wt.DETECTED_LANGUAGE
        assert verbose["duration"] == 1.5
        assert verbose["text"] == wt.TIMESTAMPED_TRANSCRIPT.strip()
        assert [(s["start"], s["end"]) for s in verbose["segments"]] == [
            (0.0, wt.SEGMENT_END_SECONDS)
        ]

        kind, data, _ = await _transcribe(stub, form(wav16, response_format="srt"))
        assert kind.startswith("application/x-subrip")
        assert data.decode() == (
            f"1\n00:00:00,000 --> 00:00:01,000\n{wt.TIMESTAMPED_TRANSCRIPT.strip()}\n\n"
        )
        kind, data, _ = await _transcribe(stub, form(wav16, response_format="vtt"))
        assert kind.startswith("text/vtt")
        assert data.decode() == (
            f"WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n{wt.TIMESTAMPED_TRANSCRIPT.strip()}\n\n"
        )

        # stream=true: OpenAI's transcript events whose deltas add up to the done text.
        kind, data, summary = await _transcribe(stub, form(wav16, stream="true"))
        assert kind == "text/event-stream"
        events = [
            json.loads(line[6:])
            for line in data.decode().split("\n\n")
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
        done = events[-1]
        assert done["type"] == "transcript.text.done" and done["text"] == TRANSCRIPT
        assert "".join(deltas).strip() == TRANSCRIPT and len(deltas) >= 1
        assert done["usage"] == {"type": "duration", "seconds": 2}
        assert summary.completion_tokens > 0

        # Translations: the same programmed path, no usage in OpenAI's translation shape.
        kind, data, _ = await _transcribe(stub, form(wav16), translate=True)
        assert json.loads(data) == {"text": TRANSCRIPT}

        # Unreadable audio: 400 naming the file; a chat request to the speech model: 400.
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await _transcribe(stub, form(b"not audio at all" * 64))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        trailers = dict(bad.value.trailing_metadata() or ())
        assert trailers.get("x-openai-error-param") == "file"
        # A language the model does not know: the model's own check, naming `language`.
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await _transcribe(stub, form(wav16, language="xx"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        trailers = dict(bad.value.trailing_metadata() or ())
        assert trailers.get("x-openai-error-param") == "language"
        assert "Unsupported language" in (bad.value.details() or "")
        chat = chat_request_from_dict(
            {"model": wt.SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "speech-to-text" in (refused.value.details() or "")

        latencies = []
        for _ in range(5):
            t0 = time.perf_counter()
            await _transcribe(stub, form(wav16))
            latencies.append(time.perf_counter() - t0)
        print(f"transcription_1s_latency_ms_median: {statistics.median(latencies) * 1000:.1f}")
