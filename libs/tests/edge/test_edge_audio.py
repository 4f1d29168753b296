"""The audio routes through a real Envoy (issue 19 item 2): a multipart upload reaches the
replica whole as the HttpBody of CreateTranscription / CreateTranslation (boundary and bytes
untouched) and its answer's media type comes back; audio bodies have their own 26 MiB limit
(chat keeps 8 MiB), over which the edge answers OpenAI's 413 before buffering; a replica
refusing the file (code request_too_large) is a 413 too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferplane.edge import MiB

from .conftest import Edge, running_edge

AUTH = {"authorization": "Bearer good"}


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    with running_edge(Path(tmp_path_factory.mktemp("edge-audio"))) as running:
        yield running


def _upload(edge: Edge, path: str, size: int, model: str = "whisper") -> httpx.Response:
    return httpx.post(
        f"{edge.url}/v1/audio/{path}",
        headers=AUTH,
        data={"model": model, "response_format": "text"},
        files={"file": ("a.wav", b"\x01" * size, "audio/wav")},
        timeout=60,
    )


@pytest.mark.parametrize("path", ["transcriptions", "translations"])
def test_an_upload_reaches_the_replica_whole(edge: Edge, path: str) -> None:
    """20 MiB (over chat's 8 MiB limit): the replica gets the client's multipart bytes with
    their boundary, and the client gets the replica's text/plain."""
    request = httpx.Request(
        "POST",
        f"{edge.url}/v1/audio/{path}",
        headers=AUTH,
        data={"model": "whisper", "response_format": "text"},
        files={"file": ("a.wav", b"\x01" * (20 * MiB), "audio/wav")},
    )
    sent = len(request.read())
    with httpx.Client(timeout=60) as client:
        answer = client.send(request)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    assert answer.text == f"{sent} bytes of {request.headers['content-type']}\n"
    assert edge.inference.calls[-1].model == "whisper"


def test_a_body_over_the_audio_limit_is_the_edges_413(edge: Edge) -> None:
    answer = _upload(edge, "transcriptions", 27 * MiB)
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert str(edge.config.max_audio_request_bytes) in error["message"]


def test_the_replica_refusing_the_file_is_a_413(edge: Edge) -> None:
    answer = _upload(edge, "transcriptions", 1024, model="too-large")
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("request_too_large", "file")


def test_replica_errors_keep_openais_shape(edge: Edge) -> None:
    answer = _upload(edge, "transcriptions", 1024, model="missing")
    assert answer.status_code == 404
    assert answer.json()["error"]["param"] == "model"


def test_chat_keeps_its_own_limit(edge: Edge) -> None:
    """A 9 MiB chat body is still refused (the audio limit raised Envoy's buffers only)."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (9 * MiB)
    answer = httpx.post(
        f"{edge.url}/v1/chat/completions",
        headers={**AUTH, "content-type": "application/json"},
        content=body + b'"}]}',
        timeout=60,
    )
    assert answer.status_code == 413
    assert str(edge.config.max_request_bytes) in answer.json()["error"]["message"]


@pytest.mark.parametrize(("size", "status"), [(20 * MiB, 200), (27 * MiB, 413)])
def test_a_chunked_upload_has_the_audio_limit(edge: Edge, size: int, status: int) -> None:
    """Without Content-Length (chunked), the chat body's limit filter is off on the audio
    route, and Envoy's buffer limit (the audio limit) refuses a larger upload with the 413."""
    request = httpx.Request(
        "POST",
        f"{edge.url}/v1/audio/transcriptions",
        headers=AUTH,
        data={"model": "whisper", "response_format": "text"},
        files={"file": ("a.wav", b"\x01" * size, "audio/wav")},
    )
    whole = request.read()
    pieces = (whole[i : i + MiB] for i in range(0, len(whole), MiB))
    chunked = httpx.Request(
        "POST",
        request.url,
        headers={**AUTH, "content-type": request.headers["content-type"]},
        content=pieces,
    )
    with httpx.Client(timeout=60) as client:
        answer = client.send(chunked)
    assert "content-length" not in chunked.headers
    assert answer.status_code == status, answer.text
    if status == 413:
        assert str(edge.config.max_audio_request_bytes) in answer.json()["error"]["message"]
