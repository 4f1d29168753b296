"""Speech-to-text requests and answers as OpenAI's audio API has them.

`speech_request` reads the multipart/form-data body of `POST /v1/audio/transcriptions` or
`/translations` (https://platform.openai.com/docs/api-reference/audio/createTranscription) into
a `SpeechRequest`, refusing what OpenAI refuses with its error shape (400 naming the field; 413
for a file over 25 MB). `render` writes a finished transcription in each `response_format`:
`json` (`{"text", "usage": {"type": "duration", "seconds"}}`), `text` (text/plain), `srt`
(SubRip cues), `vtt` (WebVTT), `verbose_json` (`task`, `language`, `duration`, `text`,
`segments`, `usage`). A streamed transcription (`stream=true`) is OpenAI's server-sent events:
`transcript.text.delta` per piece of text, then `transcript.text.done` with the whole text and
the usage (https://platform.openai.com/docs/api-reference/audio/transcript-text-delta-event).
vLLM answers `text` as JSON and has no `srt`/`vtt`: every format is written here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from inferplane.replica.engines.base import SpeechParams, SpeechResult
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import MAX_AUDIO_FILE_BYTES, FormError, FormFile, read_form

TRANSCRIBE = "transcribe"
TRANSLATE = "translate"
FORMATS: tuple[str, ...] = ("json", "text", "srt", "verbose_json", "vtt")
"""OpenAI's `response_format` values for whisper-1."""
TIMESTAMPED_FORMATS = frozenset({"srt", "verbose_json", "vtt"})
"""The formats that need timestamped segments from the model."""

#: Form fields each endpoint takes (OpenAI's createTranscription / createTranslation).
_FIELDS: Mapping[str, frozenset[str]] = {
    TRANSCRIBE: frozenset(
        {
            "file",
            "model",
            "language",
            "prompt",
            "response_format",
            "temperature",
            "stream",
            "timestamp_granularities[]",
            "timestamp_granularities",
        }
    ),
    TRANSLATE: frozenset({"file", "model", "prompt", "response_format", "temperature"}),
}
_TRUE = frozenset({"true", "1"})
_FALSE = frozenset({"false", "0", ""})

CONTENT_TYPES: Mapping[str, str] = {
    "json": "application/json",
    "verbose_json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}


@dataclasses.dataclass(frozen=True, slots=True)
class SpeechRequest:
    """One audio request, validated.

    Attributes:
        task: "transcribe" or "translate" (the endpoint).
        model: the form's `model`.
        file: the uploaded audio (at most `MAX_AUDIO_FILE_BYTES`).
        response_format: one of `FORMATS`.
        stream: answer as server-sent events (transcriptions in `json` / `text` only).
        params: what the engine needs (language, prompt, temperature, timestamps).
    """

    task: str
    model: str
    file: FormFile
    response_format: str
    stream: bool
    params: SpeechParams


def _invalid(message: str, param: str | None, code: str = "invalid_value") -> InvalidArgumentError:
    return InvalidArgumentError(message, param=param, code=code)


def speech_request(
    content_type: str,
    body: bytes,
    task: str,
    *,
    max_file_bytes: int = MAX_AUDIO_FILE_BYTES,
) -> SpeechRequest:
    """Reads and checks an audio request's multipart/form-data `body` for endpoint `task`.

    Raises:
        InvalidArgumentError: not a readable form; `file` or `model` missing; a field the
            endpoint does not take (code `unknown_parameter`); a `response_format`,
            `temperature` (0 to 1), `stream` or `timestamp_granularities[]` OpenAI would
            refuse; `stream` with `srt`/`vtt`/`verbose_json` or on translations; a file over
            `max_file_bytes` (code `request_too_large`, which the edge answers as HTTP 413).
    """
    try:
        form = read_form(content_type, body, max_file_bytes=max_file_bytes)
    except FormError as exc:
        if exc.too_large:
            raise _invalid(str(exc), exc.param, "request_too_large") from None
        raise _invalid(str(exc), exc.param, "invalid_body") from None
    known = _FIELDS[task]
    for name in (*form.fields, *form.files):
        if name not in known:
            raise _invalid(
                f"Unrecognized request argument supplied: {name}", name, "unknown_parameter"
            )
    upload = form.files.get("file")
    if upload is None:
        if "file" in form.fields:
            raise _invalid("'file' must be an uploaded file, not a text field", "file")
        raise _invalid("you must provide a file parameter", "file", "missing_required_parameter")
    model = form.get("model")
    if not model:
        raise _invalid("you must provide a model parameter", "model", "missing_required_parameter")
    response_format = form.get("response_format") or "json"
    if response_format not in FORMATS:
        raise _invalid(
            f"'{response_format}' is not one of {', '.join(FORMATS)} - 'response_format'",
            "response_format",
        )
    temperature = _temperature(form.get("temperature"))
    stream = _flag(form.get("stream"), "stream")
    if stream and task == TRANSLATE:
        raise _invalid("streaming is not supported for translations", "stream")
    if stream and response_format in TIMESTAMPED_FORMATS:
        raise _invalid(
            f"response_format '{response_format}' is not supported with stream=true; "
            "use json or text",
            "stream",
        )
    granularities = form.fields.get("timestamp_granularities[]", ()) + form.fields.get(
        "timestamp_granularities", ()
    )
    for granularity in granularities:
        if granularity not in ("segment", "word"):
            raise _invalid(
                f"'{granularity}' is not one of word, segment - 'timestamp_granularities[]'",
                "timestamp_granularities[]",
            )
        if response_format != "verbose_json":
            raise _invalid(
                "timestamp_granularities requires response_format 'verbose_json'",
                "timestamp_granularities[]",
            )
        if granularity == "word":
            raise _invalid(
                "word timestamps are not supported by this model; use 'segment'",
                "timestamp_granularities[]",
                "unsupported_value",
            )
    language = (form.get("language") or "").strip().lower() or None
    params = SpeechParams(
        task=task,
        language=language,
        prompt=form.get("prompt") or "",
        temperature=temperature,
        timestamps=response_format in TIMESTAMPED_FORMATS,
    )
    return SpeechRequest(
        task=task,
        model=model,
        file=upload,
        response_format=response_format,
        stream=stream,
        params=params,
    )


def _temperature(raw: str | None) -> float:
    if raw is None or raw.strip() == "":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise _invalid(f"'{raw}' is not a number - 'temperature'", "temperature") from None
    if not 0.0 <= value <= 1.0 or math.isnan(value):
        raise _invalid(f"{raw} is not between 0 and 1 - 'temperature'", "temperature")
    return value


def _flag(raw: str | None, name: str) -> bool:
    value = (raw or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _invalid(f"'{raw}' is not a boolean - '{name}'", name)


def usage_seconds(seconds: float) -> int:
    """Billed audio seconds: whole seconds, rounded up (OpenAI's `usage.seconds` is an
    integer), at least 1 for any audio."""
    return max(1, math.ceil(seconds - 1e-9))


def duration_usage(seconds: float) -> dict[str, Any]:
    """OpenAI's usage object of a duration-billed transcription."""
    return {"type": "duration", "seconds": usage_seconds(seconds)}


def segments_of(result: SpeechResult, seconds: float) -> list[dict[str, Any]]:
    """The result's segments; a model that wrote no timestamps gets one segment over the whole
    audio (0 to `seconds`) holding the whole text, so every format has its cues."""
    if result.segments:
        return [dict(s) for s in result.segments]
    return [
        {
            "id": 0,
            "seek": 0,
            "start": 0.0,
            "end": round(seconds, 3),
            "text": result.text,
            "tokens": [],
            "temperature": 0.0,
            "avg_logprob": 0.0,
            "compression_ratio": 0.0,
            "no_speech_prob": None,
        }
    ]


def _timestamp(seconds: float, separator: str) -> str:
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def to_srt(segments: Sequence[Mapping[str, Any]]) -> str:
    """SubRip: numbered cues from 1, `HH:MM:SS,mmm --> HH:MM:SS,mmm`, the text, a blank line."""
    cues = []
    for number, segment in enumerate(segments, start=1):
        start = _timestamp(float(segment["start"]), ",")
        end = _timestamp(float(segment["end"]), ",")
        cues.append(f"{number}\n{start} --> {end}\n{str(segment['text']).strip()}\n")
    return "\n".join(cues) + ("\n" if cues else "")


def to_vtt(segments: Sequence[Mapping[str, Any]]) -> str:
    """WebVTT (https://www.w3.org/TR/webvtt1/): the `WEBVTT` header, then one cue per
    segment, `HH:MM:SS.mmm --> HH:MM:SS.mmm` and its text."""
    cues = ["WEBVTT\n"]
    for segment in segments:
        start = _timestamp(float(segment["start"]), ".")
        end = _timestamp(float(segment["end"]), ".")
        cues.append(f"{start} --> {end}\n{str(segment['text']).strip()}\n")
    return "\n".join(cues) + "\n"


def render(request: SpeechRequest, result: SpeechResult, seconds: float) -> tuple[str, bytes]:
    """The whole answer in the request's `response_format`: (content type, body bytes).
    `seconds` is the audio's duration. Transcriptions carry a duration usage in `json` and
    `verbose_json` (translations, like OpenAI's, do not)."""
    fmt = request.response_format
    text = result.text.strip()
    transcribing = request.task == TRANSCRIBE
    if fmt == "text":
        body = text + "\n"
    elif fmt == "srt":
        body = to_srt(segments_of(result, seconds))
    elif fmt == "vtt":
        body = to_vtt(segments_of(result, seconds))
    elif fmt == "verbose_json":
        verbose: dict[str, Any] = {
            "task": "transcribe" if transcribing else "translate",
            "language": result.language or request.params.language or "",
            "duration": round(seconds, 3),
            "text": text,
            "segments": segments_of(result, seconds),
        }
        if transcribing:
            verbose["usage"] = duration_usage(seconds)
        body = json.dumps(verbose, ensure_ascii=False)
    else:
        whole: dict[str, Any] = {"text": text}
        if transcribing:
            whole["usage"] = duration_usage(seconds)
        body = json.dumps(whole, ensure_ascii=False)
    return CONTENT_TYPES[fmt], body.encode("utf-8")


def sse(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


def delta_event(text: str) -> bytes:
    """OpenAI's `transcript.text.delta` event."""
    return sse({"type": "transcript.text.delta", "delta": text})


def done_event(text: str, seconds: float) -> bytes:
    """OpenAI's `transcript.text.done` event: the whole text and the usage."""
    return sse(
        {"type": "transcript.text.done", "text": text.strip(), "usage": duration_usage(seconds)}
    )
