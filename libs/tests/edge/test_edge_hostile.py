"""Hostile HTTP/1.1 against a real Envoy (raw sockets): unroutable methods get an immediate,
shaped 4xx; what Envoy 1.40's HTTP/1 codec (Balsa) refuses in a header leaves as a shaped
400 instead of no bytes at all; what it normalizes instead of refusing (a bare CR, an
obs-fold, a bare-LF line end) is pinned here, so an Envoy upgrade that changes it shows; a
chunked body over the limit is a 413 before anything buffers it. The settings each case pins:
libs/inferplane/edge/README.md, "Hardening".
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import h2.config
import h2.connection
import hpack
import hyperframe.frame
import pytest

from inferplane.edge import MiB

from .conftest import Edge

#: A well-formed request needs far less; a hang (the old CONNECT) took 30 s.
PROMPT_S = 2.0
BODY = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}]}'


def exchange(edge: Edge, data: bytes, *, timeout_s: float = 10.0) -> tuple[float, bytes]:
    """Sends `data` on a fresh connection; (seconds until the reply was whole, its bytes)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", edge.config.listen_port), timeout=timeout_s) as s:
        s.sendall(data)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply) < _length(reply):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    return time.monotonic() - started, reply


def _length(reply: bytes) -> int:
    """The whole reply's length once its head is in (head + content-length)."""
    head, _, _ = reply.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(reply) + 1


def parse(reply: bytes) -> tuple[int, dict[str, str], Any]:
    """(status, headers lower-cased, JSON body) of a raw HTTP/1.1 reply."""
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, json.loads(body)


def post(extra_headers: bytes, body: bytes = BODY, path: bytes = b"/v1/chat/completions") -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer good\r\n"
        b"content-type: application/json\r\n"
        + extra_headers
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def assert_refused(reply: bytes, status: int, code: str) -> dict[str, str]:
    """`reply` is `status` with OpenAI's error body of `code`; returns its headers."""
    got, headers, body = parse(reply)
    assert got == status, reply
    assert headers["content-type"].startswith("application/json")
    assert body["error"]["code"] == code, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    return headers


@pytest.mark.parametrize(
    "request_line",
    [b"CONNECT api.openai.com:443 HTTP/1.1", b"TRACE /v1/chat/completions HTTP/1.1"],
)
def test_unroutable_methods_get_an_immediate_405(edge: Edge, request_line: bytes) -> None:
    """CONNECT (matched by `connect_matcher`, refused as an upgrade no config allows) and TRACE
    (outside `ALLOWED_METHODS`) are answered by the edge itself, with `Allow`, no key asked."""
    picks = len(edge.picker.picks)
    seconds, reply = exchange(edge, request_line + b"\r\nhost: api.openai.com\r\n\r\n")
    assert seconds < PROMPT_S
    headers = assert_refused(reply, 405, "method_not_allowed")
    assert "POST" in headers["allow"] and "CONNECT" not in headers["allow"]
    assert len(edge.picker.picks) == picks  # the picker never saw it


def h2_exchange(edge: Edge, headers: list[tuple[str, str]]) -> tuple[float, dict[str, str], Any]:
    """One HTTP/2 request (h2c, prior knowledge) of `headers` and no body on a fresh
    connection: (seconds until the reply's stream ended, its headers, its JSON body).

    The reply's frames are read one by one (hyperframe, hpack), not through `h2`'s state
    machine: Envoy sends a GOAWAY ahead of its answer to a refused CONNECT, after which `h2`
    refuses every frame of the connection."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    stream = connection.get_next_available_stream_id()
    connection.send_headers(stream, headers, end_stream=True)
    decoder = hpack.Decoder()
    got: dict[str, str] = {}
    body = b""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", edge.config.listen_port), timeout=10) as s:
        s.sendall(connection.data_to_send())
        pending = b""
        while True:
            data = s.recv(65536)
            assert data, f"the edge closed the connection first (headers {got})"
            pending += data
            while len(pending) >= 9:
                frame, length = hyperframe.frame.Frame.parse_frame_header(memoryview(pending[:9]))
                if len(pending) < 9 + length:
                    break
                frame.parse_body(memoryview(pending[9 : 9 + length]))
                pending = pending[9 + length :]
                if frame.stream_id != stream:
                    continue
                if isinstance(frame, hyperframe.frame.HeadersFrame):
                    got |= {str(k): str(v) for k, v in decoder.decode(frame.data)}
                elif isinstance(frame, hyperframe.frame.DataFrame):
                    body += frame.data
                if "END_STREAM" in frame.flags or isinstance(
                    frame, hyperframe.frame.RstStreamFrame
                ):
                    return time.monotonic() - started, got, json.loads(body or b"null")


def test_connect_over_http2_gets_an_immediate_405(edge: Edge) -> None:
    """HTTP/2's CONNECT (RFC 9113 §8.5: `:method` and `:authority` only) is refused as on
    HTTP/1.1: an immediate shaped 405, no key asked, the picker never sees it."""
    picks = len(edge.picker.picks)
    seconds, headers, body = h2_exchange(
        edge, [(":method", "CONNECT"), (":authority", "api.openai.com:443")]
    )
    assert seconds < PROMPT_S
    assert headers[":status"] == "405", (headers, body)
    assert body["error"]["code"] == "method_not_allowed", body
    assert len(edge.picker.picks) == picks


def test_trace_on_anthropic_path_is_anthropic_shaped(edge: Edge) -> None:
    _, reply = exchange(edge, b"TRACE /v1/messages HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _, body = parse(reply)
    assert status == 405
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("unknown method", b"FOO /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n"),
        ("PRI over HTTP/1.1", b"PRI * HTTP/1.1\r\nhost: x\r\n\r\n"),
        ("CONNECT with a path", b"CONNECT /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n"),
        ("NUL in a header value", post(b"x-probe: a\x00b\r\n")),
        ("bare LF inside a header", post(b"x-probe: a\nb\r\n")),
        ("space before the colon", post(b"x-probe : a\r\n")),
    ],
)
def test_codec_refusals_are_shaped_400s(edge: Edge, name: str, data: bytes) -> None:
    """The codec's 400 reaches the client, shaped, at once: ext_proc is off by default, so no
    picker stream for the reply's headers outlives the connection the codec closes (before,
    the client got no bytes, after Envoy's 1 s delayed close)."""
    seconds, reply = exchange(edge, data)
    assert seconds < PROMPT_S, name
    assert_refused(reply, 400, "invalid_http_request")


@pytest.mark.parametrize(
    ("header", "arrives_as"),
    [
        (b"x-probe: a\rb\r\n", "ab"),  # bare CR: removed
        (b"x-probe: a\r\n b\r\n", "a b"),  # obs-fold: unfolded
        (b"x-probe: a\n", "a"),  # bare LF as the line end (RFC 9112 §2.2 allows it)
    ],
)
def test_what_the_codec_normalizes_instead_of_refusing(
    edge: Edge, header: bytes, arrives_as: str
) -> None:
    """Envoy 1.40's Balsa codec has no setting (HCM field or runtime flag) to refuse these:
    it strips a lone CR and unfolds an obs-fold, so no filter after it can tell them from a
    plain value. Pinned: they arrive normalized, never with a CR or LF inside a value."""
    _, reply = exchange(edge, post(header))
    assert parse(reply)[0] == 200, reply
    assert edge.picker.picks[-1].headers["x-probe"] == arrives_as


def test_chunked_body_over_the_limit_is_413_before_it_is_buffered(edge: Edge) -> None:
    """No Content-Length: error_shaper.lua counts the chunks and answers 413 once the count
    passes `max_request_bytes` (8 MiB), before the picker or the replica sees a byte."""
    picks, calls = len(edge.picker.picks), len(edge.inference.calls)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer good\r\n"
        b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    pieces = [b'{"model":"tiny","messages":[{"role":"user","content":"'] + [b"x" * MiB] * 10
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    seconds, reply = exchange(edge, head + chunks, timeout_s=30)
    assert_refused(reply, 413, "request_too_large")
    assert seconds < 10
    assert len(edge.inference.calls) == calls
    assert all(p.body_bytes <= 8 * MiB for p in edge.picker.picks[picks:])
