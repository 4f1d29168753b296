"""Speech-to-text's pieces without an engine: the multipart form's rules (`pipeline/speech.py`),
the answer's formats (json, text, srt, vtt, verbose_json), and audio decoding and resampling
(`pipeline/audio.py`) with its errors."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile

from inferplane.replica.engines.base import SpeechResult
from inferplane.replica.pipeline.audio import SAMPLE_RATE, AudioError, decode_audio
from inferplane.replica.pipeline.speech import (
    TRANSCRIBE,
    TRANSLATE,
    SpeechRequest,
    render,
    speech_request,
    to_srt,
    to_vtt,
    usage_seconds,
)
from inferplane.runtime import InvalidArgumentError


def form(file: bytes | None = b"RIFF....", **fields: Any) -> tuple[str, bytes]:
    """(content type, body) as the openai client (httpx) writes a multipart request."""
    data = {"model": "whisper-tiny", **fields}
    if file is None:  # `file` sent as a text field: the body is still multipart
        files = {"model": (None, data.pop("model"))}
        data["file"] = "a.wav"
    else:
        files = {"file": ("a.wav", file, "audio/wav")}
    request = httpx.Request("POST", "http://x", data=data, files=files)
    return request.headers["content-type"], request.read()


def parsed(
    task: str = TRANSCRIBE, file: bytes | None = b"RIFF....", **fields: Any
) -> SpeechRequest:
    content_type, body = form(file, **fields)
    return speech_request(content_type, body, task)


def refused(task: str = TRANSCRIBE, **fields: Any) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as info:
        parsed(task, **fields)
    return info.value


def test_a_form_with_defaults() -> None:
    request = parsed()
    assert (request.model, request.response_format, request.stream) == (
        "whisper-tiny",
        "json",
        False,
    )
    assert request.file.data == b"RIFF...." and request.file.filename == "a.wav"
    assert request.params.task == "transcribe" and request.params.language is None
    assert request.params.temperature == 0.0 and not request.params.timestamps


def test_a_form_with_every_field() -> None:
    request = parsed(
        language="EN",
        prompt="Spell it Kubernetes.",
        response_format="vtt",
        temperature="0.4",
        stream="false",
    )
    assert request.params.language == "en" and request.params.prompt == "Spell it Kubernetes."
    assert request.params.temperature == 0.4 and request.params.timestamps
    assert parsed(stream="true").stream


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"response_format": "xml"}, "response_format", "invalid_value"),
        ({"temperature": "1.5"}, "temperature", "invalid_value"),
        ({"temperature": "warm"}, "temperature", "invalid_value"),
        ({"stream": "maybe"}, "stream", "invalid_value"),
        ({"stream": "true", "response_format": "srt"}, "stream", "invalid_value"),
        ({"timestamp_granularities[]": "segment"}, "timestamp_granularities[]", "invalid_value"),
        (
            {"timestamp_granularities[]": "word", "response_format": "verbose_json"},
            "timestamp_granularities[]",
            "unsupported_value",
        ),
        ({"colour": "blue"}, "colour", "unknown_parameter"),
        ({"model": ""}, "model", "missing_required_parameter"),
    ],
)
def test_fields_openai_refuses(fields: dict[str, str], param: str, code: str) -> None:
    error = refused(**fields)
    assert (error.param, error.code) == (param, code)
    assert error.openai_type == "invalid_request_error"


def test_translations_take_no_language_and_no_stream() -> None:
    assert parsed(TRANSLATE).params.task == "translate"
    assert refused(TRANSLATE, language="de").param == "language"
    assert refused(TRANSLATE, stream="true").param == "stream"


def test_a_missing_file_and_a_body_that_is_not_a_form() -> None:
    assert refused(file=None).param == "file"
    with pytest.raises(InvalidArgumentError) as info:
        speech_request("application/json", b'{"model": "x"}', TRANSCRIBE)
    assert info.value.code == "invalid_body"
    content_type, body = form()
    with pytest.raises(InvalidArgumentError) as info:
        speech_request(content_type, body[: len(body) // 2], TRANSCRIBE)
    assert "truncated" in info.value.message


def test_a_file_over_the_limit_is_request_too_large() -> None:
    """The edge answers code request_too_large with HTTP 413 (error_shaper.lua)."""
    content_type, body = form(b"x" * 101)
    with pytest.raises(InvalidArgumentError) as info:
        speech_request(content_type, body, TRANSCRIBE, max_file_bytes=100)
    assert (info.value.code, info.value.param) == ("request_too_large", "file")
    speech_request(content_type, body, TRANSCRIBE, max_file_bytes=101)


SEGMENTS = (
    {"id": 0, "start": 0.0, "end": 1.5, "text": " Hello there.", "tokens": [1]},
    {"id": 1, "start": 1.5, "end": 3661.25, "text": " Long.", "tokens": [2]},
)


def test_srt_and_vtt_cues() -> None:
    assert to_srt(SEGMENTS) == (
        "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
        "2\n00:00:01,500 --> 01:01:01,250\nLong.\n\n"
    )
    assert to_vtt(SEGMENTS) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n"
        "00:00:01.500 --> 01:01:01.250\nLong.\n\n"
    )


def test_render_each_format() -> None:
    result = SpeechResult(text=" Hello there. Long.", language="en", segments=SEGMENTS)
    kind, body = render(parsed(), result, 2.2)
    assert kind == "application/json"
    assert json.loads(body) == {
        "text": "Hello there. Long.",
        "usage": {"type": "duration", "seconds": 3},
    }
    assert render(parsed(response_format="text"), result, 2.2) == (
        "text/plain; charset=utf-8",
        b"Hello there. Long.\n",
    )
    kind, body = render(parsed(response_format="verbose_json"), result, 2.2)
    verbose = json.loads(body)
    assert verbose["task"] == "transcribe" and verbose["language"] == "en"
    assert verbose["duration"] == 2.2 and len(verbose["segments"]) == 2
    assert verbose["usage"] == {"type": "duration", "seconds": 3}
    kind, body = render(parsed(TRANSLATE), result, 2.2)
    assert json.loads(body) == {"text": "Hello there. Long."}  # OpenAI's translation shape
    assert render(parsed(response_format="srt"), result, 2.2)[0].startswith("application/x-subrip")
    assert render(parsed(response_format="vtt"), result, 2.2)[0].startswith("text/vtt")


def test_a_result_without_timestamps_is_one_cue_over_the_whole_audio() -> None:
    result = SpeechResult(text=" no timestamps")
    _, body = render(parsed(response_format="srt"), result, 2.5)
    assert body.decode() == "1\n00:00:00,000 --> 00:00:02,500\nno timestamps\n\n"


def test_usage_seconds_round_up_and_are_at_least_one() -> None:
    assert [usage_seconds(s) for s in (0.01, 1.0, 1.0001, 59.5)] == [1, 1, 2, 60]


def _encoded(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize(("rate", "fmt"), [(16000, "WAV"), (44100, "WAV"), (8000, "FLAC")])
def test_audio_is_decoded_to_16khz_mono(rate: int, fmt: str) -> None:
    t = np.arange(rate * 2) / rate
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 300 * t), 0.5 * np.sin(2 * np.pi * 300 * t)], 1)
    audio = decode_audio(_encoded(stereo, rate, fmt))
    assert audio.source_rate == rate and audio.samples.dtype == np.float32
    assert abs(audio.seconds - 2.0) < 0.01
    # The tone survives the resampling: its peak stays near 0.5.
    assert 0.45 < float(np.abs(audio.samples[1000:-1000]).max()) < 0.55
    back, back_rate = soundfile.read(io.BytesIO(audio.wav_bytes()), dtype="float32")
    assert back_rate == SAMPLE_RATE and len(back) == len(audio.samples)


def test_a_compressed_container_falls_back_to_ffmpeg() -> None:
    """An AAC-in-MP4 file (what libsndfile cannot read) is decoded through PyAV."""
    av = pytest.importorskip("av")
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=44100)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(
            np.full((1, 44100), 0.1, dtype=np.float32), format="flt", layout="mono"
        )
        frame.sample_rate = 44100
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    audio = decode_audio(out.getvalue())
    assert audio.source_rate == 44100 and 0.9 < audio.seconds < 1.2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"this is not audio at all" * 40, "could not be decoded"),
        (b"RIFF\x00\x00\x00\x00WAVE", "could not be decoded"),
    ],
)
def test_unreadable_audio_is_an_audio_error(data: bytes, message: str) -> None:
    with pytest.raises(AudioError, match=message):
        decode_audio(data)


def test_audio_over_the_length_limit_is_refused() -> None:
    data = _encoded(np.zeros(16000 * 3), 16000, "WAV")
    with pytest.raises(AudioError, match="at most 2 s"):
        decode_audio(data, max_seconds=2)


def test_speech_replicas_run_on_inproc_only() -> None:
    """vLLM's speech serving is hosted in the replica process: a `transcribe` spec on a
    child-engine transport is refused naming the transport and the one that works."""
    from inferplane.replica.testing.pipeline import whisper_tiny_spec
    from inferplane.replica_contract import resolve_transport

    spec = whisper_tiny_spec()
    assert resolve_transport(spec) == "inproc"
    for transport in ("http-completions", "grpc"):
        spec.transport = transport
        with pytest.raises(ValueError, match=f"the {transport} engine transport cannot serve"):
            resolve_transport(spec)


def test_an_engine_without_speech_is_refused_by_the_tracked_engine() -> None:
    """The replica's TrackedEngine refuses speech on an engine that has none (a `rejected`
    EngineError: the replica answers 400, never counts it against the engine)."""
    import asyncio

    from inferplane.replica.engines.base import EngineError, SpeechParams, SpeechUsage
    from inferplane.replica.state import TrackedEngine
    from inferplane.replica.testing.pipeline import ScriptedEngine

    failures: list[int] = []
    tracked = TrackedEngine(ScriptedEngine(()), lambda: failures.append(1))
    with pytest.raises(EngineError) as info:
        asyncio.run(tracked.transcribe(b"", SpeechParams(task="transcribe"), SpeechUsage()))
    assert info.value.rejected and failures == []
