"""`inferplane up --tls` end to end (issue 18, "Edge TLS"): the whole stack with the edge's
certificate from the local CA in `<data_dir>/pki`; the official `openai` client trusting that CA
streams an answer from kimi-tiny over HTTPS, a client without it fails verification, and a
second start reuses the CA clients already trust.

Its own stack (module scope; listed in conftest's OWN_STACK_MODULES)."""

from __future__ import annotations

import json
import ssl
import stat
from collections.abc import Iterator

import httpx
import openai
import pytest

from inferplane.fixtures import kimi_tiny
from inferplane.localstack import Stack, running_stack
from inferplane.runtime.security.pki import LocalCA

from .conftest import local_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        local_config(tmp_path_factory.mktemp("tls-stack"), tls=True), print
    ) as stack:
        yield stack


def test_openai_client_streams_over_https_trusting_the_local_ca(tls_stack: Stack) -> None:
    config = tls_stack.config
    assert config.base_url.startswith("https://") and config.ca_path is not None
    assert json.loads((config.data_dir / "stack.json").read_text())["ca_path"] == str(
        config.ca_path
    )
    assert stat.S_IMODE(LocalCA(config.pki_dir).key_path.stat().st_mode) == 0o600
    request = kimi_tiny.NO_TOOL.request()
    verify = ssl.create_default_context(cafile=str(config.ca_path))
    with (
        httpx.Client(verify=verify, timeout=120) as http,
        openai.OpenAI(
            base_url=config.base_url,
            api_key=tls_stack.create_api_key("tls"),
            max_retries=0,
            http_client=http,
        ) as client,
    ):
        chunks = list(
            client.chat.completions.create(
                model=request["model"],
                messages=request["messages"],
                tools=request["tools"],
                temperature=0,
                stream=True,
                extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
            )
        )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == kimi_tiny.NO_TOOL.content


def test_a_client_without_the_ca_fails_verification(tls_stack: Stack) -> None:
    with (
        openai.OpenAI(
            base_url=tls_stack.config.base_url, api_key="sk-any", max_retries=0, timeout=10
        ) as client,
        pytest.raises(openai.APIConnectionError) as caught,
    ):
        client.models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value.__cause__)


def test_the_ca_is_reused_and_the_edge_certificate_kept(tls_stack: Stack) -> None:
    """Invariant: a later `up --tls` keeps the CA clients already trust (and a fresh leaf)."""
    ca = LocalCA(tls_stack.config.pki_dir)
    before = ca.cert_path.read_bytes(), (ca.directory / "edge.crt").read_bytes()
    tls_stack._edge_tls_args(lambda _m: None)
    assert (ca.cert_path.read_bytes(), (ca.directory / "edge.crt").read_bytes()) == before
