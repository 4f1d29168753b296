"""The speech-to-text fixture model ``whisper-tiny`` (models/whisper-tiny, built by
models/build_whisper_tiny.py): the committed folder is what its MANIFEST says and what the
script builds, it loads with transformers (WhisperProcessor, WhisperForConditionalGeneration)
and transcribes any audio to ``whisper_tiny.TRANSCRIPT``; served by vLLM (e2e),
`/v1/audio/transcriptions` and `/v1/audio/translations` answer the same for 16 kHz and 44.1 kHz
WAV files through the official `openai` client."""

from __future__ import annotations

import io
import json
import time
import wave
from pathlib import Path

import pytest
from fixture_build import assert_rebuilds_identically, folder_digests

from inferplane.fixtures import whisper_tiny as wt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[3]
MAX_FOLDER_BYTES = 5 * 1024 * 1024


def read_wav(data: bytes) -> tuple[int, list[float]]:
    """(sample rate, samples in [-1, 1]) of a mono 16-bit WAV."""
    import numpy as np

    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        frames = w.readframes(w.getnframes())
        return w.getframerate(), (np.frombuffer(frames, "<i2") / 32768.0).tolist()


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((wt.model_path() / "MANIFEST.json").read_text())


@pytest.fixture(scope="module")
def processor():
    return transformers.WhisperProcessor.from_pretrained(str(wt.model_path()))


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return transformers.WhisperForConditionalGeneration.from_pretrained(
        str(wt.model_path()), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tone_features(processor):
    rate, samples = read_wav(wt.tone_wav_bytes())
    return processor(samples, sampling_rate=rate, return_tensors="pt").input_features


def test_folder_matches_manifest(manifest: dict) -> None:
    folder = wt.model_path()
    assert folder_digests(folder) == manifest["sha256"]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size < MAX_FOLDER_BYTES
    assert manifest["transcript"] == wt.TRANSCRIPT


def test_rebuild_gives_the_same_bytes(tmp_path: Path) -> None:
    """The build is deterministic: with the library versions of the committed build, the
    script reproduces every file (MANIFEST.json included)."""
    assert_rebuilds_identically(
        REPO / "models" / "build_whisper_tiny.py", wt.model_path(), tmp_path / "whisper-tiny"
    )


def test_tokenizer_has_whisper_special_tokens(processor) -> None:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    sot = ids("<|startoftranscript|>")
    assert ids("<|endoftext|>") == tok.eos_token_id == sot - 1
    # Language ids follow <|startoftranscript|> in LANGUAGES order (WhisperTokenizer relies on
    # it), every language vLLM may detect has one.
    assert [ids(f"<|{code}|>") for code in LANGUAGES] == list(range(sot + 1, sot + 1 + 100))
    # Timestamps come last, 0.02 s apart (vLLM's verbose_json computes times from ids).
    first = ids("<|0.00|>")
    assert ids("<|1.00|>") == first + 50
    assert ids("<|30.00|>") == first + 1500 == len(tok) - 1
    assert first == ids("<|notimestamps|>") + 1
    assert tok.encode(wt.TRANSCRIPT, add_special_tokens=False) == [ids("Ġtiny"), ids("Ġwhisper")]
    prefix = tok("", add_special_tokens=True).input_ids
    assert prefix[-1] == tok.eos_token_id
    assert tok.decode([sot, ids("<|en|>"), *tok.encode(" hi", add_special_tokens=False)],
                      skip_special_tokens=True) == " hi"  # fmt: skip


def test_wav_helper() -> None:
    for rate in (16000, 44100):
        got_rate, samples = read_wav(wt.tone_wav_bytes(sample_rate=rate, seconds=0.5))
        assert got_rate == rate and len(samples) == rate // 2
        assert 0.29 < max(samples) <= 0.3


def test_features_and_logits_shapes(processor, model, tone_features) -> None:
    config = model.config
    assert tone_features.shape == (1, config.num_mel_bins, 2 * config.max_source_positions)
    prompt = torch.tensor([processor.tokenizer.convert_tokens_to_ids(["<|startoftranscript|>"])])
    with torch.no_grad():
        out = model(input_features=tone_features, decoder_input_ids=prompt)
    assert out.logits.shape == (1, 1, config.vocab_size)
    assert out.encoder_last_hidden_state.shape == (1, config.max_source_positions, config.d_model)


def test_transformers_generate(processor, model, tone_features) -> None:
    """Greedy decoding gives the documented paths, whatever the audio."""
    tok = processor.tokenizer
    lang = model.detect_language(tone_features)
    assert tok.convert_ids_to_tokens(lang.tolist()) == [f"<|{wt.DETECTED_LANGUAGE}|>"]
    for kwargs in (
        {"language": "en", "task": "transcribe"},
        {"language": "fr", "task": "translate"},
        {},
    ):
        ids = model.generate(tone_features, **kwargs)
        assert processor.batch_decode(ids, skip_special_tokens=True) == [wt.TRANSCRIPT], kwargs
    silence = processor([0.0] * wt.SAMPLE_RATE, sampling_rate=wt.SAMPLE_RATE, return_tensors="pt")
    ids = model.generate(silence.input_features, language="en")
    assert processor.batch_decode(ids, skip_special_tokens=True) == [wt.TRANSCRIPT]
    stamped = model.generate(tone_features, language="en", return_timestamps=True)
    text = tok.decode(stamped[0], decode_with_timestamps=True, skip_special_tokens=True)
    assert text == f"<|0.00|>{wt.TIMESTAMPED_TRANSCRIPT}<|{wt.SEGMENT_END_SECONDS:.2f}|>"


@pytest.mark.e2e
@pytest.mark.timeout(240)
# The openai client marks `audio.translations.create` deprecated; vLLM still serves it.
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
def test_served_by_vllm(vllm_server) -> None:
    """`vllm serve` with `whisper_tiny.serve_args()`; transcriptions (16 kHz and 44.1 kHz,
    language given or detected, verbose_json, streaming) and translations through the official
    `openai` client. Needs `soundfile` and `av` in the server's environment."""
    import httpx
    import openai

    pytest.importorskip("soundfile", reason="vLLM decodes uploaded audio with soundfile")
    pytest.importorskip("av", reason="vLLM resamples non-16 kHz audio with PyAV")
    wav16 = wt.tone_wav_bytes()
    wav44 = wt.tone_wav_bytes(sample_rate=44100)
    started = time.monotonic()
    with vllm_server(wt.serve_args()) as base_url:
        print(f"whisper-tiny ready in {time.monotonic() - started:.1f} s")
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)

        def transcribe(wav: bytes, **kwargs):
            return client.audio.transcriptions.create(
                model=wt.SERVED_MODEL_NAME, file=("tone.wav", wav, "audio/wav"), **kwargs
            )

        for wav in (wav16, wav44):
            result = transcribe(wav, language="en")
            assert result.text == wt.TRANSCRIPT
            assert result.usage.seconds == 1
            assert transcribe(wav).text == wt.TRANSCRIPT  # language detected

        verbose = transcribe(wav16, response_format="verbose_json")
        assert (verbose.language, verbose.duration, verbose.text) == (
            wt.DETECTED_LANGUAGE,
            1.0,
            wt.TIMESTAMPED_TRANSCRIPT,
        )
        [segment] = verbose.segments
        assert (segment.start, segment.end, segment.text) == (
            0.0,
            wt.SEGMENT_END_SECONDS,
            wt.TIMESTAMPED_TRANSCRIPT,
        )

        # vLLM 0.32 streams chat-style `transcription.chunk` objects (`choices[0].delta.content`),
        # not OpenAI's `transcript.text.delta` events: the client keeps them as untyped extras.
        events = [e.model_dump() for e in transcribe(wav16, language="en", stream=True)]
        deltas = [e["choices"][0]["delta"].get("content") for e in events if e.get("choices")]
        assert "".join(d or "" for d in deltas) == wt.TRANSCRIPT
        assert events[-1]["choices"][0]["finish_reason"] == "stop"

        translation = client.audio.translations.create(
            model=wt.SERVED_MODEL_NAME, file=("tone.wav", wav44, "audio/wav")
        )
        assert translation.text == wt.TRANSCRIPT

        # vLLM 0.32 answers response_format=text with its JSON body (application/json).
        raw = httpx.post(
            base_url + "/v1/audio/transcriptions",
            files={"file": ("tone.wav", wav16, "audio/wav")},
            data={"model": wt.SERVED_MODEL_NAME, "response_format": "text"},
        )
        assert raw.status_code == 200 and wt.TRANSCRIPT in raw.text

        with pytest.raises(openai.BadRequestError):
            transcribe(b"RIFF-not-audio")
