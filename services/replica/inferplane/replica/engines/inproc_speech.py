"""Speech-to-text on the in-process `AsyncLLM` with vLLM's own request building.

vLLM's `OpenAIServingTranscription` / `OpenAIServingTranslation` (the classes behind
`vllm serve`'s `/v1/audio/*`, vllm/entrypoints/speech_to_text/) know each speech model's
prompts (Whisper's `<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`, language
detection, timestamp tokens and segments, chunking of audio longer than 30 s). They are hosted
here over the replica's own `AsyncLLM`, with no FastAPI request: the replica has already parsed
the form and decoded the audio (`pipeline/audio.py`), and formats the answer itself
(`pipeline/speech.py`), so only the generation and its text come from vLLM.

The engine client vLLM's classes get is `_Counting`, a view of the `AsyncLLM` whose
`generate` counts each request's tokens (decoder prompt and generated) into the `SpeechUsage`
of the call that started it: vLLM's non-streamed speech responses carry no token counts, and the
router's usage report needs them.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import structlog

from inferplane.replica.engines.base import (
    EngineError,
    SpeechParams,
    SpeechResult,
    SpeechUsage,
)

log = structlog.get_logger("inferplane.replica.engines.inproc_speech")

_usage: contextvars.ContextVar[SpeechUsage | None] = contextvars.ContextVar(
    "inferplane_speech_usage", default=None
)


class _Counting:
    """The `AsyncLLM` as vLLM's serving classes see it, with `generate` counting tokens into
    the calling request's `SpeechUsage` (captured when the request is started)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        from vllm.sampling_params import RequestOutputKind

        # DELTA outputs (vLLM's speech streams) carry the new tokens only, CUMULATIVE ones
        # (its whole answers) all tokens so far.
        delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        stream = self._llm.generate(prompt, sampling_params, request_id, *args, **kwargs)
        return self._counted(stream, _usage.get(), delta=delta)

    @staticmethod
    async def _counted(
        stream: AsyncIterator[Any], usage: SpeechUsage | None, *, delta: bool
    ) -> AsyncIterator[Any]:
        generated = 0
        prompt = 0
        try:
            # Closing this closes vLLM's generator at once, which aborts the engine request
            # (a client gone must not leave the decoder running).
            async with aclosing(stream):  # type: ignore[type-var]
                async for out in stream:
                    if out.prompt_token_ids is not None:
                        prompt = len(out.prompt_token_ids)
                    if out.outputs:
                        ids = out.outputs[0].token_ids
                        generated = generated + len(ids) if delta else len(ids)
                    yield out
        finally:
            if usage is not None:
                usage.prompt_tokens += prompt
                usage.completion_tokens += generated


class InprocSpeech:
    """vLLM's transcription and translation serving over one `AsyncLLM` (built on first use:
    constructing them loads the tokenizer and the model class's speech config)."""

    def __init__(self, llm: Any) -> None:
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.entrypoints.speech_to_text.transcription.serving import (
            OpenAIServingTranscription,
        )
        from vllm.entrypoints.speech_to_text.translation.serving import (
            OpenAIServingTranslation,
        )

        self._llm = llm
        client: Any = _Counting(llm)
        config = llm.model_config
        names = config.served_model_name
        name = names[0] if isinstance(names, list | tuple) else (names or config.model)
        self.model_name = str(name)
        models = OpenAIServingModels(
            engine_client=client,
            base_model_paths=[BaseModelPath(name=self.model_name, model_path=config.model)],
        )
        self._serving = {
            "transcribe": OpenAIServingTranscription(client, models, request_logger=None),
            "translate": OpenAIServingTranslation(client, models, request_logger=None),
        }

    def _request(self, params: SpeechParams, wav: bytes, *, stream: bool) -> Any:
        from fastapi import UploadFile
        from pydantic import ValidationError
        from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionRequest
        from vllm.entrypoints.speech_to_text.translation.protocol import TranslationRequest

        fields: dict[str, Any] = {
            "file": UploadFile(file=io.BytesIO(wav), filename="audio.wav"),
            "model": self.model_name,
            "prompt": params.prompt,
            "response_format": "verbose_json" if params.timestamps else "json",
            "temperature": params.temperature,
            "stream": stream,
        }
        if params.language:
            fields["language"] = params.language
        kind = TranscriptionRequest if params.task == "transcribe" else TranslationRequest
        try:
            return kind.model_validate(fields)
        except ValidationError as exc:
            raise EngineError(f"invalid speech request: {exc}", rejected=True) from exc

    def _check_language(self, params: SpeechParams) -> None:
        """The model's own language check (Whisper: its language codes), before any work.

        Raises:
            EngineError: `rejected`, param `language`, with the model's message.
        """
        if not params.language:
            return
        try:
            self._serving[params.task].model_cls.validate_language(params.language)
        except ValueError as exc:
            raise EngineError(str(exc), rejected=True, param="language") from exc

    async def transcribe(
        self, wav: bytes, params: SpeechParams, usage: SpeechUsage
    ) -> SpeechResult:
        """The whole transcription (or translation) of `wav` (16 kHz audio as WAV bytes).

        Raises:
            EngineError: vLLM refused the request (`rejected`: an unsupported language, a
                prompt too long...), or the engine failed or died (`retryable`).
        """
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        self._check_language(params)
        request = self._request(params, wav, stream=False)
        token = _usage.set(usage)
        try:
            result = await self._call(params, wav, request)
        finally:
            _usage.reset(token)
        if isinstance(result, ErrorResponse):
            raise _refused(result)
        segments: tuple[dict[str, Any], ...] = ()
        language = params.language or None
        if params.timestamps:
            segments = tuple(s.model_dump() for s in (getattr(result, "segments", None) or ()))
            language = getattr(result, "language", None) or language
        return SpeechResult(text=result.text, language=language, segments=segments)

    async def transcribe_stream(
        self, wav: bytes, params: SpeechParams, usage: SpeechUsage
    ) -> AsyncIterator[str]:
        """The transcription's text as it is generated (vLLM's stream, its deltas only).

        Raises:
            EngineError: as `transcribe`; an error vLLM reports inside its stream too.
        """
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        self._check_language(params)
        request = self._request(params, wav, stream=True)
        # Every engine request (language detection, each 30 s chunk) is started inside
        # `_call`: the usage is captured there, so the variable is set around it only.
        token = _usage.set(usage)
        try:
            events = await self._call(params, wav, request)
        finally:
            _usage.reset(token)
        if isinstance(events, ErrorResponse):
            raise _refused(events)
        # Closed at once when our caller stops reading: vLLM then aborts its requests.
        async with aclosing(events):
            async for event in events:
                for text in _deltas(event):
                    yield text

    async def _call(self, params: SpeechParams, wav: bytes, request: Any) -> Any:
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        serving: Any = self._serving[params.task]
        method = (
            serving.create_transcription
            if params.task == "transcribe"
            else serving.create_translation
        )
        try:
            return await method(wav, request, None)
        except EngineDeadError as exc:
            raise EngineError(f"the in-process engine died: {exc}", retryable=True) from exc
        except (VLLMValidationError, ValueError) as exc:
            if self._llm.errored:
                raise EngineError(f"the in-process engine died: {exc}", retryable=True) from exc
            raise EngineError(f"engine rejected the request: {exc}", rejected=True) from exc
        except (EngineError, asyncio.CancelledError):
            raise
        except Exception as exc:
            if self._llm.errored:
                raise EngineError(
                    f"the in-process engine died: {type(exc).__name__}: {exc}", retryable=True
                ) from exc
            raise EngineError(f"engine failed the request: {type(exc).__name__}: {exc}") from exc


def _deltas(event: str) -> list[str]:
    """The text pieces of one of vLLM's speech SSE events (`data: {chunk}` with
    `choices[].delta.content`); `data: [DONE]` has none.

    Raises:
        EngineError: the event is vLLM's mid-stream error event.
    """
    pieces: list[str] = []
    for line in event.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        payload = json.loads(line[len("data: ") :])
        if "error" in payload:
            message = (payload["error"] or {}).get("message")
            raise EngineError(f"the engine failed the request: {message}")
        for choice in payload.get("choices") or ():
            text = (choice.get("delta") or {}).get("content")
            if text:
                pieces.append(text)
    return pieces


def _refused(error: Any) -> EngineError:
    """vLLM's ErrorResponse as an EngineError: a 4xx is the request's fault (`rejected`)."""
    info = error.error
    if 400 <= int(info.code) < 500:
        return EngineError(f"engine rejected the request: {info.message}", rejected=True)
    return EngineError(f"engine failed the request: {info.message}")
