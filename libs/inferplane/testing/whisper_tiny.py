"""Constants for the speech-to-text fixture model ``whisper-tiny``: where it lives, how vLLM
serves it, what it transcribes, and WAV files to send it.

``models/build_whisper_tiny.py`` builds the folder: a random-initialised
``WhisperForConditionalGeneration`` (d_model 64, 2 encoder and 2 decoder layers, 80 mel bins, the
real 30 s / 1500-frame audio window, 448 decoder positions) with a locally built byte-level
``WhisperProcessor`` that has Whisper's special tokens (100 languages, tasks, ``<|0.00|>`` ..
``<|30.00|>``). The last decoder layer's MLP is *programmed* so that greedy decoding follows a
fixed path whatever the audio (the encoder runs, its output only nudges the logits):

- after ``<|startoftranscript|>`` alone (language detection): ``<|en|>``
  (:data:`DETECTED_LANGUAGE`);
- after ``...<|notimestamps|>`` (plain transcription or translation): :data:`TRANSCRIPT`,
  then ``<|endoftext|>``;
- after ``...<|0.00|>`` (timestamps, vLLM's ``verbose_json``): :data:`TIMESTAMPED_TRANSCRIPT`,
  ``<|1.00|>``, ``<|endoftext|>``: one segment from 0.0 to :data:`SEGMENT_END_SECONDS`.

The build checks those paths with transformers on several audios and records the smallest
top-1/top-2 logit margin in ``MANIFEST.json``.

Pure data and the standard library: importing this module loads no ML library.
"""

from __future__ import annotations

import io
import math
import struct
import wave
from pathlib import Path

from inferplane.testing._fixtures import fixture_model_path

ENV_VAR = "INFERPLANE_WHISPER_TINY"
"""Environment variable that overrides the model directory."""

SERVED_MODEL_NAME = "whisper-tiny"

SAMPLE_RATE = 16000
"""Hz: what the feature extractor expects; vLLM resamples other rates (with PyAV) first."""

MAX_MODEL_LEN = 448
"""Decoder tokens (the model's ``max_target_positions``)."""

ENGINE_ARGS: tuple[str, ...] = (
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--enforce-eager",
)
"""`vllm serve MODEL` arguments that serve the fixture on CPU; see :func:`serve_args`. The
server also needs `soundfile` (decoding) and `av` (resampling; decoding when soundfile is
missing) installed for `/v1/audio/transcriptions`."""

TRANSCRIPT = " tiny whisper"
"""The text greedy decoding produces after ``<|notimestamps|>`` (leading space included, as
Whisper writes it): two tokens, then ``<|endoftext|>``."""

TIMESTAMPED_TRANSCRIPT = " tick tock"
"""The text between ``<|0.00|>`` and ``<|1.00|>`` when timestamps are asked for."""

SEGMENT_END_SECONDS = 1.0
"""End of the one segment of a timestamped transcription (its start is 0.0)."""

DETECTED_LANGUAGE = "en"
"""The language the model detects in any audio."""

LANGUAGE_PROBE_TOKENS = ("<|en|>", "<|fr|>", "<|de|>")
"""A few language tokens tests may look up; the vocabulary has all 100 of transformers'
``whisper.tokenization_whisper.LANGUAGES``."""


def model_path() -> Path:
    """The fixture model directory: ``$INFERPLANE_WHISPER_TINY`` if set, else the repo's copy.

    Raises:
        FileNotFoundError: the directory has no ``config.json``; the message names the
            variable to set.
    """
    return fixture_model_path(SERVED_MODEL_NAME, ENV_VAR)


def serve_args(path: Path | None = None) -> list[str]:
    """``serve MODEL --served-model-name whisper-tiny`` plus :data:`ENGINE_ARGS` (the arguments
    of the `vllm` CLI; add ``--host``/``--port``)."""
    return [
        "serve",
        str(path or model_path()),
        "--served-model-name",
        SERVED_MODEL_NAME,
        *ENGINE_ARGS,
    ]


def tone_samples(
    *,
    sample_rate: int = SAMPLE_RATE,
    seconds: float = 1.0,
    frequency: float = 440.0,
    amplitude: float = 0.3,
) -> list[float]:
    """A sine tone: ``round(seconds * sample_rate)`` samples in [-amplitude, amplitude]."""
    n = round(seconds * sample_rate)
    step = 2 * math.pi * frequency / sample_rate
    return [amplitude * math.sin(step * i) for i in range(n)]


def tone_wav_bytes(
    *,
    sample_rate: int = SAMPLE_RATE,
    seconds: float = 1.0,
    frequency: float = 440.0,
    amplitude: float = 0.3,
) -> bytes:
    """A mono 16-bit PCM WAV file (RIFF) of :func:`tone_samples`, as bytes.

    Use ``sample_rate=44100`` to exercise the server's resampling (vLLM resamples to
    :data:`SAMPLE_RATE` with PyAV).
    """
    samples = tone_samples(
        sample_rate=sample_rate, seconds=seconds, frequency=frequency, amplitude=amplitude
    )
    frames = struct.pack(f"<{len(samples)}h", *(round(s * 32767) for s in samples))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(frames)
    return buf.getvalue()


def write_tone_wav(
    path: Path,
    *,
    sample_rate: int = SAMPLE_RATE,
    seconds: float = 1.0,
    frequency: float = 440.0,
    amplitude: float = 0.3,
) -> Path:
    """Writes :func:`tone_wav_bytes` to `path` (parents must exist) and returns `path`."""
    path.write_bytes(
        tone_wav_bytes(
            sample_rate=sample_rate, seconds=seconds, frequency=frequency, amplitude=amplitude
        )
    )
    return path
