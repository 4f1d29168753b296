"""The edge over TLS with a certificate from the local CA (issue 18, "Edge TLS"): the official
`openai` client trusting the CA streams an answer; a client that does not trust it, and plain
HTTP to the TLS port, get nothing."""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inferplane.runtime.security.pki import LocalCA

from ._fakes import STREAM_PIECES
from .conftest import Edge, running_edge

MESSAGES: list[Any] = [{"role": "user", "content": "What's the weather in Tokyo?"}]


@pytest.fixture(scope="module")
def ca_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_edge(tmp_path_factory: pytest.TempPathFactory, ca_dir: Path) -> Iterator[Edge]:
    ca = LocalCA.ensure(ca_dir)
    leaf = ca.issue("edge", dns_names=("localhost",), ip_addresses=("127.0.0.1",), days=1)
    with running_edge(
        Path(tmp_path_factory.mktemp("edge-tls")),
        tls_cert_path=str(leaf.cert_path),
        tls_key_path=str(leaf.key_path),
    ) as running:
        yield running


def test_openai_client_trusting_the_ca_streams_over_https(tls_edge: Edge, ca_dir: Path) -> None:
    ca = LocalCA(ca_dir)
    assert tls_edge.url.startswith("https://")
    with (
        httpx.Client(verify=ssl.create_default_context(cafile=str(ca.cert_path))) as http,
        openai.OpenAI(
            base_url=tls_edge.url + "/v1", api_key="good", max_retries=0, http_client=http
        ) as client,
    ):
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(STREAM_PIECES)
    assert tls_edge.inference.calls[-1].method == "StreamChatCompletionEvents"


@pytest.mark.parametrize(
    ("offered", "chosen"), [(["h2", "http/1.1"], "h2"), (["http/1.1"], "http/1.1")]
)
def test_alpn_selects_h2_or_http11(
    tls_edge: Edge, ca_dir: Path, offered: list[str], chosen: str
) -> None:
    """TLS 1.2 at least, and ALPN picks h2 when offered, else HTTP/1.1."""
    context = ssl.create_default_context(cafile=str(LocalCA(ca_dir).cert_path))
    context.set_alpn_protocols(offered)
    port = tls_edge.config.listen_port
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        assert tls.selected_alpn_protocol() == chosen
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


def test_a_client_that_does_not_trust_the_ca_is_refused(tls_edge: Edge) -> None:
    """Invariant: the edge's certificate only verifies against the local CA (not the system
    store), so a client without it fails the handshake and sends no key."""
    with (
        httpx.Client() as http,
        openai.OpenAI(
            base_url=tls_edge.url + "/v1", api_key="good", max_retries=0, http_client=http
        ) as client,
        pytest.raises(openai.APIConnectionError) as caught,
    ):
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert isinstance(caught.value.__cause__, httpx.ConnectError)
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value.__cause__)


def test_plain_http_to_the_tls_port_gets_no_answer(tls_edge: Edge) -> None:
    """Invariant: the TLS listener serves no plain-text HTTP (nothing readable comes back)."""
    connection = http.client.HTTPConnection("127.0.0.1", tls_edge.config.listen_port, timeout=5)
    try:
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            connection.request("GET", "/v1/models", headers={"authorization": "Bearer good"})
            connection.getresponse()
    finally:
        connection.close()
