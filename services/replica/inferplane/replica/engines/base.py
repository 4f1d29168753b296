"""The replica process's view of its engine: the one small interface pipeline and engines share.

The replica process (`inferplane.replica.app`) hosts one engine and hands the server
(`inferplane.replica.server`) its one `LocalReplica`; the inference pipeline
(`inferplane.replica.pipeline`) renders, generates through `EngineClient`, and parses. Engine
transports (vLLM's AsyncLLM in-process, vLLM's HTTP server, vLLM's gRPC `VllmEngine/Generate`)
implement `EngineClient`; nothing above this file knows which.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from inferplane.api.nodeagent.v1 import nodeagent_pb2

if TYPE_CHECKING:
    from inferplane.replica.engines.lora import Adapter


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConstraint:
    """A structured-output constraint: `kind` is one of json_schema, regex, grammar,
    structural_tag, json_object, choice (vLLM's `SamplingParams.constraint` oneof); `value` is
    its text (JSON for json_schema / structural_tag)."""

    kind: str
    value: str


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters as the engine takes them; None means the engine's default.

    `max_tokens` is required (the pipeline resolves it from the request and the context length).
    """

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log probabilities per generated token with this many most likely alternatives (0: the
    # sampled token's only); None: none (`EngineOutput.logprobs` stays None).
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Token ids always come back whole (the pipeline decodes them itself: Kimi's think/tool
    # markers are not special tokens, and no marker may be hidden from the parser); True only
    # leaves special tokens out of the pipeline's text (text completions that ask for it).
    skip_special_tokens: bool = False
    constraint: EngineConstraint | None = None
    # Generated tokens per streamed increment at least (vLLM's `stream_interval`; None or 1:
    # every token). The first token and the finish are never held back.
    stream_interval: int | None = None
    # A matched stop string stays at the end of the output (vLLM's option; stop strings are
    # matched by the pipeline, so transports need not pass it).
    include_stop_str_in_output: bool = False
    # The LoRA adapter to run the request with (`engines/lora.py`: resolved and checked by the
    # replica's AdapterRegistry from the picker's headers); None: the base model.
    adapter: Adapter | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log probability of one generated token.

    Attributes:
        token_id: the generated token.
        logprob: its natural-log probability.
        top: the most likely tokens at its position as `(token id, logprob)`, most likely
            first: `SamplingParams.logprobs` of them (may include `token_id` itself).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class EngineOutput:
    """One increment of a generation.

    `token_ids` are the NEW tokens of this increment (may be several). The last increment has
    `finished=True` and `finish_reason` in {"stop", "length", "abort"}; token counts are
    cumulative for the request and are exact on the last increment.
    """

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    matched_stop: str | int | None = None
    # With `SamplingParams.logprobs` set: one entry per id of `token_ids`, in order.
    logprobs: tuple[TokenLogprob, ...] | None = None


class EngineError(Exception):
    """The engine failed or died; `retryable` is True when nothing was generated yet.

    `rejected` is True when the engine refused the request itself (its validation: a schema
    its constraint backend cannot compile, a parameter out of its range): the client's fault,
    answered 400, never retried elsewhere and never counted against the replica; `param`
    names the request field at fault when the engine's check says which (e.g. `language`)."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        rejected: bool = False,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable and not rejected
        self.rejected = rejected
        self.param = param


@dataclasses.dataclass(frozen=True, slots=True)
class SpeechParams:
    """One speech-to-text request as the engine runs it.

    Attributes:
        task: "transcribe" (text in the audio's language) or "translate" (English text).
        language: ISO-639-1 code of the audio's language; None: the model detects it.
        prompt: text to continue from (the previous segment, spellings), "" for none.
        temperature: sampling temperature, 0 to 1 (0: greedy).
        timestamps: ask for timestamped segments (verbose_json, srt, vtt).
    """

    task: str
    language: str | None = None
    prompt: str = ""
    temperature: float = 0.0
    timestamps: bool = False


@dataclasses.dataclass(slots=True)
class SpeechUsage:
    """Tokens a speech request used, filled in while the engine runs it (decoder prompt
    tokens, generated tokens; language detection and every 30 s chunk included)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SpeechResult:
    """A whole transcription: its `text`, the `language` (detected or given; None when not
    known) and, with `SpeechParams.timestamps`, OpenAI's segment objects (`id`, `start`, `end`
    in seconds, `text`, `tokens`, `avg_logprob`, ...)."""

    text: str
    language: str | None = None
    segments: tuple[Mapping[str, Any], ...] = ()


@runtime_checkable
class SpeechEngine(Protocol):
    """An engine that serves speech-to-text (a `transcribe` replica's engine; the transports
    in `inferplane.replica_contract.SPEECH_TRANSPORTS`). `wav` is the decoded upload at 16 kHz
    as WAV bytes."""

    async def transcribe(
        self, wav: bytes, params: SpeechParams, usage: SpeechUsage
    ) -> SpeechResult:
        """The whole transcription or translation.

        Raises:
            EngineError: refused (`rejected`: e.g. an unsupported language), failed or dead.
        """
        ...

    def transcribe_stream(
        self, wav: bytes, params: SpeechParams, usage: SpeechUsage
    ) -> AsyncIterator[str]:
        """The text as it is generated; closing the iteration aborts the request.

        Raises:
            EngineError: as `transcribe`, also after text was yielded.
        """
        ...


class EngineClient(Protocol):
    """A connection to one engine process."""

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Streams increments; raises EngineError when the engine fails mid-way. Cancelling the
        iteration (client gone, deadline) must abort the request in the engine."""
        ...

    async def embed(
        self, request_id: str, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> list[array[float]]:
        """The embeddings of `inputs` (token ids each, embedded as given: nothing is added), in
        input order: one `array("f")` (float32) per input, pooled and normalised as the
        model's pooler does (vLLM's `embed` task); `dimensions` (a Matryoshka size the
        pipeline checked) cuts each vector to that many values before normalising.
        Cancelling the call aborts the request in the engine.

        Raises:
            EngineError: the engine failed (`retryable`: nothing is half-done for embeddings)
                or refused the request (`rejected`: its own validation, e.g. a length or
                `dimensions` it does not accept).
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Aborts a request; unknown ids are ignored."""
        ...

    async def healthy(self) -> bool:
        """True when the engine answers its health check."""
        ...

    async def close(self) -> None:
        """Closes the connection."""
        ...


@runtime_checkable
class TracksRequests(Protocol):
    """An engine that keeps its generations in flight (the replica's `state.TrackedEngine`),
    so that shutdown can abort them. A `Generation` tells it about each request once, never
    per token: `was_shut` when the engine reports the request finished, `release` when the
    request leaves the generation however it ended."""

    def was_shut(self, request_id: str) -> bool:
        """True when the replica aborted the request at shutdown (`abort_all`): its finish
        is then an error, never a complete response."""
        ...

    def release(self, request_id: str, *, failed: bool) -> None:
        """The request is no longer in flight; `failed`: it ended with an `EngineError`."""
        ...


@dataclasses.dataclass(slots=True)
class Admitted:
    """One admitted request: `gpu_seconds` is set when it leaves the replica
    (`inferplane.replica.pipeline.gpu_share`; 0 on replicas without accelerators)."""

    gpu_seconds: float = 0.0


class LocalReplica(Protocol):
    """The process's replica as the server sees it (`state.ReplicaState`; fakes in tests)."""

    @property
    def replica_id(self) -> str:
        """The replica id (`replicas/{replica_id}`)."""
        ...

    @property
    def spec(self) -> nodeagent_pb2.ReplicaSpec:
        """What the replica runs (served_model_name, model_source, max_model_len, parsers...)."""
        ...

    @property
    def engine(self) -> EngineClient:
        """The engine connection."""
        ...

    def admit(self) -> AbstractAsyncContextManager[Admitted]:
        """Counts a request in flight for its duration; the `Admitted` it yields carries the
        request's GPU-seconds once the context exits. Raises
        `inferplane.runtime.UnavailableError` when the replica is not READY (draining, starting,
        restarting) so that the router can go elsewhere."""
        ...
