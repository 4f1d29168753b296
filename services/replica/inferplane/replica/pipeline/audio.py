"""Uploaded audio → 16 kHz mono float32 samples, for speech-to-text replicas.

Decoding uses libsndfile through `soundfile` (WAV, FLAC, OGG/Vorbis/Opus, MP3) and falls back
to FFmpeg through PyAV (`av`) for what libsndfile cannot read from memory (MP4/M4A, WebM,
MPEG containers), the formats OpenAI accepts (flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav, webm).
Resampling to `SAMPLE_RATE` is FFmpeg's resampler (`av.AudioResampler`, libswresample), the
same library vLLM resamples with. Decoding is CPU work of up to a second for a long file: call
`decode_audio` in a thread.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np

SAMPLE_RATE = 16_000
"""Hz: what Whisper's feature extractor (and every speech model vLLM serves) expects."""

MAX_AUDIO_SECONDS = 3 * 3600.0
"""The longest audio accepted: a 25 MB upload of compressed speech holds at most a few hours,
and decoded samples cost 64 KB per second; longer input is refused rather than decoded."""


class AudioError(ValueError):
    """An upload that is not decodable audio, holds no samples or is too long (HTTP 400)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Audio:
    """Decoded audio: mono float32 `samples` in [-1, 1] at `SAMPLE_RATE`, and the rate the
    file had (`source_rate`, Hz)."""

    samples: np.ndarray
    source_rate: int

    @property
    def seconds(self) -> float:
        """The duration, seconds."""
        return len(self.samples) / SAMPLE_RATE

    def wav_bytes(self) -> bytes:
        """The samples as a 32-bit float WAV file (what vLLM's audio loader reads back with no
        resampling: it is already at `SAMPLE_RATE`)."""
        import soundfile  # type: ignore[import-untyped]

        buf = io.BytesIO()
        soundfile.write(buf, self.samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")
        return buf.getvalue()


def decode_audio(data: bytes, *, max_seconds: float = MAX_AUDIO_SECONDS) -> Audio:
    """Decodes an uploaded audio file, mixes it down to mono and resamples it to `SAMPLE_RATE`.

    Raises:
        AudioError: neither libsndfile nor FFmpeg can decode `data`, it has no audio stream
            or no samples, or it is longer than `max_seconds`.
    """
    if not data:
        raise AudioError("The audio file is empty.")
    try:
        samples, rate = _decode_soundfile(data)
    except _Undecodable:
        samples, rate = _decode_av(data)
    if samples.size == 0:
        raise AudioError("The audio file holds no audio samples.")
    if samples.size / rate > max_seconds:
        raise AudioError(
            f"The audio is {samples.size / rate:.0f} s long; at most {max_seconds:.0f} s "
            "are accepted."
        )
    if rate != SAMPLE_RATE:
        samples = resample(samples, rate)
    return Audio(samples=np.ascontiguousarray(samples, dtype=np.float32), source_rate=rate)


class _Undecodable(Exception):
    pass


def _decode_soundfile(data: bytes) -> tuple[np.ndarray, int]:
    import soundfile  # type: ignore[import-untyped]

    try:
        frames, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise _Undecodable() from exc
    return frames.mean(axis=1, dtype=np.float32), int(rate)


def _decode_av(data: bytes) -> tuple[np.ndarray, int]:
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioError("The file has no audio stream.")
            stream = container.streams.audio[0]
            rate = int(stream.rate or stream.codec_context.sample_rate or 0)
            if rate <= 0:
                raise AudioError("The audio stream has no sample rate.")
            # Mono float at the source rate here; the resampling step is shared with the
            # soundfile path.
            mixer = av.AudioResampler(format="flt", layout="mono", rate=rate)
            parts = [
                out.to_ndarray().reshape(-1)
                for frame in container.decode(stream)
                for out in mixer.resample(frame)
            ]
            parts.extend(out.to_ndarray().reshape(-1) for out in mixer.resample(None))
    except AudioError:
        raise
    except (av.FFmpegError, ValueError, IndexError, EOFError) as exc:
        raise AudioError(
            "The audio file could not be decoded; supported formats: flac, mp3, mp4, mpeg, "
            "mpga, m4a, ogg, wav, webm."
        ) from exc
    if not parts:
        return np.zeros(0, dtype=np.float32), rate
    return np.concatenate(parts).astype(np.float32, copy=False), rate


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 `samples` at `rate` Hz resampled to `target` Hz with FFmpeg's
    libswresample (PyAV's `AudioResampler`), flushed so the tail is kept."""
    import av

    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(samples, dtype=np.float32).reshape(1, -1), format="flt", layout="mono"
    )
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    parts = [out.to_ndarray().reshape(-1) for out in resampler.resample(frame)]
    parts.extend(out.to_ndarray().reshape(-1) for out in resampler.resample(None))
    if not parts:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate(parts).astype(np.float32, copy=False)
