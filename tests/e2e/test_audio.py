"""Speech-to-text end to end (issue 19 item 2): the official `openai` client through the edge
(ext_authz, the transcoder passing the multipart body through as an HttpBody, the endpoint
picker reading the form's `model`) to the whisper-tiny replica (vLLM's speech serving in the
replica process). The fixture is random but programmed (`inferplane.fixtures.whisper_tiny`):
greedy decoding writes `TRANSCRIPT` (or `TIMESTAMPED_TRANSCRIPT` in one 0-1 s segment when
timestamps are asked for) whatever the audio, so the answers are checked exactly.

The module has its own stack (whisper-tiny alone), gone before the session's stack starts."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile

from inferplane.fixtures import whisper_tiny as wt
from inferplane.localstack import SPEECH_MODEL_NAME, Stack, running_stack

from .conftest import local_config

pytestmark = pytest.mark.e2e

TRANSCRIPT = wt.TRANSCRIPT.strip()
TIMESTAMPED = wt.TIMESTAMPED_TRANSCRIPT.strip()
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def speech_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = local_config(tmp_path_factory.mktemp("speech-stack"), speech=True, chat=False)
    started = time.monotonic()
    with running_stack(config, print) as stack:
        print(f"speech_stack_start_seconds: {time.monotonic() - started:.1f}")
        yield stack


def _admin(stack: Stack) -> dict[str, str]:
    return {"authorization": f"Bearer {stack.admin_key}"}


@pytest.fixture(scope="module")
def speech_key(speech_stack: Stack) -> tuple[str, str]:
    """A fresh key (secret, key id) whose ledger rows are this module's requests only."""
    body = {"tenant": "speech-e2e", "scopes": ["inference"]}
    answer = httpx.post(
        f"{speech_stack.config.base_url}/admin/api-keys",
        json=body,
        headers=_admin(speech_stack),
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    created = answer.json()
    return created["secret"], created["api_key"]["name"].removeprefix("api-keys/")


@pytest.fixture(scope="module")
def client(speech_stack: Stack, speech_key: tuple[str, str]) -> openai.OpenAI:
    """The module's own client (shadows the session's): the speech stack's edge."""
    return openai.OpenAI(
        base_url=speech_stack.config.base_url,
        api_key=speech_key[0],
        max_retries=0,
        timeout=120,
    )


def wav16(seconds: float = 1.5) -> bytes:
    """A 16 kHz mono 16-bit WAV of a tone (numpy + soundfile)."""
    t = np.arange(round(16000 * seconds)) / 16000
    buf = io.BytesIO()
    soundfile.write(buf, 0.3 * np.sin(2 * np.pi * 440 * t), 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def flac44(seconds: float = 2.2) -> bytes:
    """A 44.1 kHz stereo FLAC of two tones: the replica mixes it down and resamples it."""
    t = np.arange(round(44100 * seconds)) / 44100
    frames = np.stack([0.2 * np.sin(2 * np.pi * 330 * t), 0.2 * np.sin(2 * np.pi * 550 * t)], 1)
    buf = io.BytesIO()
    soundfile.write(buf, frames, 44100, format="FLAC")
    return buf.getvalue()


def test_a_16khz_wav_is_transcribed_with_duration_usage(client: openai.OpenAI) -> None:
    answer = client.audio.transcriptions.create(
        model=SPEECH_MODEL_NAME, file=("speech.wav", wav16(), "audio/wav")
    )
    assert answer.text == TRANSCRIPT
    assert answer.usage is not None and answer.usage.type == "duration"
    assert answer.usage.seconds == 2  # 1.5 s, whole seconds rounded up


def test_a_44khz_stereo_flac_is_resampled_and_transcribed(client: openai.OpenAI) -> None:
    answer = client.audio.transcriptions.create(
        model=SPEECH_MODEL_NAME,
        file=("speech.flac", flac44(), "audio/flac"),
        language="en",
        prompt="A tone.",
        temperature=0,
    )
    assert answer.text == TRANSCRIPT
    assert answer.usage is not None and answer.usage.seconds == 3


def test_every_response_format(client: openai.OpenAI) -> None:
    """text is text/plain, srt and vtt their cue formats, verbose_json the language, duration
    and segments (the fixture's one timestamped segment)."""
    audio = ("speech.wav", wav16(), "audio/wav")
    create = client.audio.transcriptions.create
    text = create(model=SPEECH_MODEL_NAME, file=audio, response_format="text")
    assert text == TRANSCRIPT + "\n"
    srt = create(model=SPEECH_MODEL_NAME, file=audio, response_format="srt")
    assert srt == f"1\n00:00:00,000 --> 00:00:01,000\n{TIMESTAMPED}\n\n"
    vtt = create(model=SPEECH_MODEL_NAME, file=audio, response_format="vtt")
    assert vtt == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n{TIMESTAMPED}\n\n"
    verbose = create(
        model=SPEECH_MODEL_NAME,
        file=audio,
        response_format="verbose_json",
        timestamp_granularities=["segment"],
    )
    assert verbose.language == wt.DETECTED_LANGUAGE and verbose.duration == 1.5
    assert verbose.text == TIMESTAMPED
    assert verbose.segments is not None
    assert [(s.start, s.end, s.text.strip()) for s in verbose.segments] == [
        (0.0, wt.SEGMENT_END_SECONDS, TIMESTAMPED)
    ]


def test_raw_http_content_types(speech_stack: Stack, speech_key: tuple[str, str]) -> None:
    """The media types on the wire: JSON, text/plain, SubRip, WebVTT."""
    expected = {
        "json": "application/json",
        "text": "text/plain",
        "srt": "application/x-subrip",
        "vtt": "text/vtt",
    }
    for fmt, media in expected.items():
        answer = httpx.post(
            f"{speech_stack.config.base_url}/audio/transcriptions",
            headers={"authorization": f"Bearer {speech_key[0]}"},
            data={"model": SPEECH_MODEL_NAME, "response_format": fmt},
            files={"file": ("speech.wav", wav16(), "audio/wav")},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith(media), fmt


def test_stream_true_is_transcript_events(client: openai.OpenAI) -> None:
    events = list(
        client.audio.transcriptions.create(
            model=SPEECH_MODEL_NAME, file=("speech.wav", wav16(), "audio/wav"), stream=True
        )
    )
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert deltas and "".join(deltas).strip() == TRANSCRIPT
    done = events[-1]
    assert done.type == "transcript.text.done" and done.text == TRANSCRIPT
    assert done.model_dump(exclude_none=True)["usage"] == {"type": "duration", "seconds": 2}


def test_a_translation_is_english_text(client: openai.OpenAI) -> None:
    answer = client.audio.translations.create(
        model=SPEECH_MODEL_NAME, file=("speech.wav", wav16(), "audio/wav")
    )
    assert answer.text == TRANSCRIPT
    text = client.audio.translations.create(
        model=SPEECH_MODEL_NAME, file=("speech.wav", wav16(), "audio/wav"), response_format="text"
    )
    assert text == TRANSCRIPT + "\n"


def test_a_garbage_file_is_a_400_naming_file(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(
            model=SPEECH_MODEL_NAME, file=("speech.wav", b"this is no audio " * 100, "audio/wav")
        )
    body: Any = info.value.body
    assert body["param"] == "file" and body["type"] == "invalid_request_error"
    assert "could not be decoded" in body["message"]


def test_bad_form_fields_are_400s(client: openai.OpenAI) -> None:
    audio = ("speech.wav", wav16(), "audio/wav")
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(
            model=SPEECH_MODEL_NAME,
            file=audio,
            response_format="xml",  # type: ignore[arg-type]
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model=SPEECH_MODEL_NAME, file=audio, temperature=1.5)
    assert info.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model=SPEECH_MODEL_NAME, file=audio, language="xx")
    assert info.value.body["param"] == "language"  # type: ignore[index]


def test_oversized_files_are_413s(speech_stack: Stack, speech_key: tuple[str, str]) -> None:
    """Over 25 MB: the replica refuses the file (the body is under the edge's 26 MiB) and a
    body over 26 MiB is refused by the edge before anything buffers it; both in OpenAI's
    error shape."""
    client = openai.OpenAI(
        base_url=speech_stack.config.base_url, api_key=speech_key[0], max_retries=0, timeout=300
    )
    for size in (25 * MiB + 1, 27 * MiB):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            client.audio.transcriptions.create(
                model=SPEECH_MODEL_NAME, file=("big.wav", bytes(size), "audio/wav")
            )
        print(f"oversized_{size}_bytes_refused_seconds: {time.monotonic() - started:.2f}")
        assert info.value.status_code == 413, info.value.body
        body: Any = info.value.body
        assert body["type"] == "invalid_request_error" and body["code"] == "request_too_large"


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.audio.transcriptions.create(
            model="no-such-model", file=("speech.wav", wav16(), "audio/wav")
        )
    body: Any = info.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"


def test_usage_is_recorded_in_the_ledger(
    speech_stack: Stack, speech_key: tuple[str, str], client: openai.OpenAI
) -> None:
    """A transcription is one ledger row of its key: the model, the deployment and the
    replica, with the tokens the replica counted (decoder prompt and generated)."""
    body = {"tenant": "speech-ledger", "scopes": ["inference"]}
    created = httpx.post(
        f"{speech_stack.config.base_url}/admin/api-keys",
        json=body,
        headers=_admin(speech_stack),
        timeout=30,
    ).json()
    secret, key_id = created["secret"], created["api_key"]["name"].removeprefix("api-keys/")
    own = openai.OpenAI(base_url=speech_stack.config.base_url, api_key=secret, max_retries=0)
    own.audio.transcriptions.create(model=SPEECH_MODEL_NAME, file=("a.wav", wav16(), "audio/wav"))
    deadline = time.monotonic() + 30
    while True:
        answer = httpx.get(
            f"{speech_stack.config.base_url}/admin/usage",
            params={"key_id": key_id},
            headers=_admin(speech_stack),
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        rows = answer.json().get("rows", [])
        if rows:
            break
        assert time.monotonic() < deadline, "no ledger row arrived"
        time.sleep(0.2)
    (row,) = rows
    assert row["model"] == SPEECH_MODEL_NAME and row["deployment"] == SPEECH_MODEL_NAME
    assert row["replica"].startswith(f"{SPEECH_MODEL_NAME}-") and row["status"] == "completed"
    assert int(row["prompt_tokens"]) > 0 and int(row["completion_tokens"]) >= 2
    print("speech_ledger_row:", json.dumps(row))
