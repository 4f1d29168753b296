"""The node-agents as the reconciler sees them: a small async port (`NodeAgents`) and its gRPC
adapter (one channel per node-agent address, reused).

`probe` is the warm-up request: one short streamed chat completion through the node-agent's
`InferenceService`, pinned to the replica with the `x-inferplane-replica` metadata, timed to
its first chunk (TTFT). `conformance` is the release's conformance gate (issue 30):
`ReplicaProcessService.RunConformance` at the replica process's own address.
"""

from __future__ import annotations

import dataclasses
import io
import time
import wave
from typing import Protocol

import grpc
from google.api import httpbody_pb2
from google.protobuf import struct_pb2

from inferplane.api.inference.v1 import inference_pb2, inference_pb2_grpc
from inferplane.api.nodeagent.v1 import (
    nodeagent_pb2,
    nodeagent_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from inferplane.runtime.security.identity import NODE_AGENT, PeerSecurity

PROBE_PROMPT = "Say OK."
#: The speech warm-up's audio: half a second of 16 kHz silence.
PROBE_AUDIO_SECONDS = 0.5
_PROBE_BOUNDARY = "inferplane-probe-boundary"


def probe_speech_form(model: str) -> tuple[str, bytes]:
    """A transcription request's multipart/form-data body (content type, bytes) for the
    speech warm-up: `model`, `response_format` verbose_json and a WAV of `PROBE_AUDIO_SECONDS`
    of silence (16-bit mono, 16 kHz), as an OpenAI client would upload it. verbose_json takes
    the timestamp path (logprobs in the engine), whose first request costs the engine ~8 s
    more than a plain one on CPU: paid by the warm-up, not by a client's first srt or vtt."""
    audio = io.BytesIO()
    with wave.open(audio, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * int(16000 * PROBE_AUDIO_SECONDS))
    dash = f"--{_PROBE_BOUNDARY}\r\n"
    field = dash + 'Content-Disposition: form-data; name="{}"\r\n\r\n{}\r\n'
    parts = [
        field.format("model", model).encode(),
        field.format("response_format", "verbose_json").encode(),
        (
            f'{dash}Content-Disposition: form-data; name="file"; filename="probe.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + audio.getvalue()
        + b"\r\n",
        f"--{_PROBE_BOUNDARY}--\r\n".encode(),
    ]
    return f"multipart/form-data; boundary={_PROBE_BOUNDARY}", b"".join(parts)


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeResult:
    """One warm-up/probe request: `ok`, time to the first chunk in seconds, `error` text."""

    ok: bool
    ttft_seconds: float = 0.0
    error: str = ""


class NodeAgents(Protocol):
    """Calls into node-agents by address (`host:port`). Errors: `grpc.aio.AioRpcError` (or any
    exception from a fake); callers treat them as "this node failed this time"."""

    async def list_replicas(self, address: str) -> list[nodeagent_pb2.Replica]: ...

    async def start_replica(
        self, address: str, replica_id: str, spec: nodeagent_pb2.ReplicaSpec
    ) -> nodeagent_pb2.Replica: ...

    async def drain_replica(
        self, address: str, replica_id: str, grace_seconds: int
    ) -> nodeagent_pb2.Replica: ...

    async def stop_replica(
        self, address: str, replica_id: str, grace_seconds: int
    ) -> nodeagent_pb2.Replica: ...

    async def probe(
        self,
        address: str,
        replica_id: str,
        model: str,
        *,
        embed: bool = False,
        speech: bool = False,
    ) -> ProbeResult: ...

    async def conformance(
        self, address: str, *, live_requests: int, timeout_seconds: float, seed: int
    ) -> replica_pb2.ConformanceReport: ...

    async def close(self) -> None: ...


class GrpcNodeAgents:
    """`NodeAgents` over grpc.aio. `timeout_seconds` bounds control RPCs; `probe_timeout_seconds`
    bounds one warm-up request (the engine's first request can be slow: compilation, caches);
    `security`: the orchestrator's identity toward node-agents and replicas."""

    def __init__(
        self,
        *,
        timeout_seconds: float = 30.0,
        probe_timeout_seconds: float = 60.0,
        security: PeerSecurity | None = None,
    ) -> None:
        self._security = security or PeerSecurity.plaintext()
        self._timeout = timeout_seconds
        self._probe_timeout = probe_timeout_seconds
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            # Node-agents are dialled at their node's address: their certificate is checked
            # against the node-agent identity, not that address.
            channel = self._channels[address] = self._security.aio_channel(
                address, self._security.server_options(NODE_AGENT)
            )
        return channel

    def _agent(self, address: str) -> nodeagent_pb2_grpc.NodeAgentServiceStub:
        return nodeagent_pb2_grpc.NodeAgentServiceStub(self._channel(address))

    async def list_replicas(self, address: str) -> list[nodeagent_pb2.Replica]:
        replicas: list[nodeagent_pb2.Replica] = []
        token = ""
        while True:
            page = await self._agent(address).ListReplicas(
                nodeagent_pb2.ListReplicasRequest(page_size=500, page_token=token),
                timeout=self._timeout,
            )
            replicas.extend(page.replicas)
            token = page.next_page_token
            if not token:
                return replicas

    async def start_replica(
        self, address: str, replica_id: str, spec: nodeagent_pb2.ReplicaSpec
    ) -> nodeagent_pb2.Replica:
        response = await self._agent(address).StartReplica(
            nodeagent_pb2.StartReplicaRequest(replica_id=replica_id, spec=spec),
            timeout=self._timeout,
        )
        return response.replica

    async def drain_replica(
        self, address: str, replica_id: str, grace_seconds: int
    ) -> nodeagent_pb2.Replica:
        response = await self._agent(address).DrainReplica(
            nodeagent_pb2.DrainReplicaRequest(
                name=f"replicas/{replica_id}", grace_period_seconds=grace_seconds
            ),
            timeout=self._timeout,
        )
        return response.replica

    async def stop_replica(
        self, address: str, replica_id: str, grace_seconds: int
    ) -> nodeagent_pb2.Replica:
        response = await self._agent(address).StopReplica(
            nodeagent_pb2.StopReplicaRequest(
                name=f"replicas/{replica_id}", grace_period_seconds=grace_seconds
            ),
            timeout=self._timeout + grace_seconds,
        )
        return response.replica

    async def probe(
        self,
        address: str,
        replica_id: str,
        model: str,
        *,
        embed: bool = False,
        speech: bool = False,
    ) -> ProbeResult:
        """One warm-up request: a 4-token streamed chat completion, with `embed` one
        embedding, with `speech` the transcription of half a second of silence (their latency
        stands for the TTFT). `address` is the replica's own (`Replica.inference_address`:
        its replica process serves that one replica, so nothing in the request names it;
        `replica_id` is the replica it reaches)."""
        stub = inference_pb2_grpc.InferenceServiceStub(self._channel(address))
        if embed:
            return await self._probe_embedding(stub, model)
        if speech:
            return await self._probe_speech(stub, model)
        request = inference_pb2.StreamChatCompletionRequest(
            request=inference_pb2.ChatCompletionRequest(
                model=model,
                messages=[
                    inference_pb2.ChatMessage(
                        role="user", content=struct_pb2.Value(string_value=PROBE_PROMPT)
                    )
                ],
                max_completion_tokens=4,
                stream=True,
            )
        )
        started = time.monotonic()
        ttft = 0.0
        finished = False
        try:
            call = stub.StreamChatCompletion(
                request,
                timeout=self._probe_timeout,
            )
            async for chunk in call:
                if not ttft:
                    ttft = time.monotonic() - started
                finished = finished or any(c.HasField("finish_reason") for c in chunk.choices)
        except grpc.aio.AioRpcError as exc:
            return ProbeResult(False, ttft, f"{exc.code().name}: {exc.details()}")
        if not finished:
            return ProbeResult(False, ttft, "the stream ended without a finish_reason")
        return ProbeResult(True, ttft)

    async def _probe_embedding(
        self, stub: inference_pb2_grpc.InferenceServiceStub, model: str
    ) -> ProbeResult:
        request = inference_pb2.CreateEmbeddingRequest(
            request=inference_pb2.EmbeddingRequest(
                model=model, input=struct_pb2.Value(string_value=PROBE_PROMPT)
            )
        )
        started = time.monotonic()
        try:
            response = await stub.CreateEmbedding(
                request,
                timeout=self._probe_timeout,
            )
        except grpc.aio.AioRpcError as exc:
            return ProbeResult(False, 0.0, f"{exc.code().name}: {exc.details()}")
        if len(response.data) != 1:
            return ProbeResult(False, 0.0, f"{len(response.data)} embeddings for one input")
        return ProbeResult(True, time.monotonic() - started)

    async def _probe_speech(
        self, stub: inference_pb2_grpc.InferenceServiceStub, model: str
    ) -> ProbeResult:
        content_type, data = probe_speech_form(model)
        request = inference_pb2.CreateTranscriptionRequest(
            body=httpbody_pb2.HttpBody(content_type=content_type, data=data)
        )
        started = time.monotonic()
        try:
            call = stub.CreateTranscription(
                request,
                timeout=self._probe_timeout,
            )
            answer = b"".join([message.data async for message in call])
        except grpc.aio.AioRpcError as exc:
            return ProbeResult(False, 0.0, f"{exc.code().name}: {exc.details()}")
        if not answer:
            return ProbeResult(False, 0.0, "the transcription came back empty")
        return ProbeResult(True, time.monotonic() - started)

    async def conformance(
        self, address: str, *, live_requests: int, timeout_seconds: float, seed: int
    ) -> replica_pb2.ConformanceReport:
        """`RunConformance` on the replica process at `address` (`Replica.inference_address`):
        `live_requests` live requests seeded by `seed`, the run bounded by `timeout_seconds`
        (the call's deadline is that plus the control timeout: the replica reports what it
        finished in time). Raises `grpc.aio.AioRpcError` (UNIMPLEMENTED from a replica that
        predates the gate, FAILED_PRECONDITION when its engine is not ready)."""
        stub = replica_pb2_grpc.ReplicaProcessServiceStub(self._channel(address))
        response = await stub.RunConformance(
            replica_pb2.RunConformanceRequest(
                live_requests=live_requests, seed=seed, timeout_seconds=timeout_seconds
            ),
            timeout=timeout_seconds + self._timeout,
        )
        return response.report

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close(grace=None)
