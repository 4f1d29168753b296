"""`inferplane.wire.read_form`: OpenAI's multipart/form-data audio bodies, as the openai client
(httpx) and curl write them, read in one bounded pass."""

from __future__ import annotations

import httpx
import pytest

from inferplane.wire import FormError, read_form


def _form(data: dict[str, object], files: dict[str, tuple[str, bytes, str]]) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://x", data=data, files=files)
    return request.headers["content-type"], request.read()


AUDIO = ("a.wav", b"RIFF" + bytes(range(256)) * 40, "audio/wav")


def test_fields_repeated_fields_and_the_file() -> None:
    content_type, body = _form(
        {
            "model": "whisper-tiny",
            "prompt": "Grüße",
            "timestamp_granularities[]": ["segment", "word"],
        },
        {"file": AUDIO},
    )
    form = read_form(content_type, body)
    assert form.get("model") == "whisper-tiny" and form.get("prompt") == "Grüße"
    assert form.fields["timestamp_granularities[]"] == ("segment", "word")
    upload = form.files["file"]
    assert (upload.filename, upload.content_type) == ("a.wav", "audio/wav")
    assert upload.data == AUDIO[1] and upload.size == len(AUDIO[1])
    assert form.get("language") is None and form.get("language", "en") == "en"


def test_measuring_without_copying_keeps_only_the_named_fields() -> None:
    """The picker's use: the model only, file parts measured but not kept."""
    content_type, body = _form({"model": "m", "prompt": "p"}, {"file": AUDIO})
    form = read_form(content_type, body, keep_files=False, only=frozenset({"model"}))
    assert form.fields == {"model": ("m",)}
    assert form.files["file"].data == b"" and form.files["file"].size == len(AUDIO[1])


def test_a_file_or_field_over_its_limit_is_too_large() -> None:
    content_type, body = _form({"model": "m"}, {"file": AUDIO})
    with pytest.raises(FormError) as info:
        read_form(content_type, body, max_file_bytes=len(AUDIO[1]) - 1)
    assert info.value.too_large and info.value.param == "file"
    read_form(content_type, body, max_file_bytes=len(AUDIO[1]))
    content_type, body = _form({"prompt": "x" * 100}, {"file": AUDIO})
    with pytest.raises(FormError) as info:
        read_form(content_type, body, max_field_bytes=99)
    assert info.value.too_large and info.value.param == "prompt"


@pytest.mark.parametrize(
    ("content_type", "body", "message"),
    [
        ("application/json", b"{}", "must be multipart/form-data"),
        ("multipart/form-data", b"--x--\r\n", "no boundary"),
        ("multipart/form-data; boundary=x", b"garbage", "malformed"),
        ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data", "truncated"),
        (
            "multipart/form-data; boundary=x",
            b"--x\r\nContent-Type: text/plain\r\n\r\nv\r\n--x--\r\n",
            "no form-data name",
        ),
        (
            "multipart/form-data; boundary=x",
            b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\n\xff\xfe\r\n--x--\r\n',
            "not UTF-8",
        ),
    ],
)
def test_unreadable_bodies_are_form_errors(content_type: str, body: bytes, message: str) -> None:
    with pytest.raises(FormError, match=message) as info:
        read_form(content_type, body)
    assert not info.value.too_large
