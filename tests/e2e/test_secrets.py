"""Secrets never reach a log or a file others can read (issue 18), on the whole stack: API keys
are created, used, rotated and revoked through the edge, then every file the run wrote is
searched for every secret, and every log file's mode is checked."""

from __future__ import annotations

import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from inferplane.fixtures import kimi_tiny
from inferplane.localstack import Stack

pytestmark = pytest.mark.e2e

BOOTSTRAP_KEY_FILE = Path("auth") / "bootstrap-admin-key"
MAX_SCANNED_BYTES = 256 << 20  # per file: logs and databases are far smaller


def files_of(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            yield path


def chat(stack: Stack, key: str, *, stream: bool = False) -> None:
    client = openai.OpenAI(base_url=stack.config.base_url, api_key=key, max_retries=0, timeout=120)
    request = kimi_tiny.NO_TOOL.request()
    response = client.chat.completions.create(
        model=request["model"],
        messages=request["messages"],
        extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
        temperature=0,
        max_tokens=8,
        stream=stream,
    )
    if stream:
        assert list(response)  # type: ignore[arg-type]
    else:
        assert response.choices  # type: ignore[union-attr]


def message(stack: Stack, key: str) -> None:
    """An Anthropic Messages request with the key in `x-api-key` (Anthropic's convention)."""
    response = httpx.post(
        stack.config.base_url + "/messages",
        json={
            "model": kimi_tiny.SERVED_MODEL_NAME,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
        },
        headers={"x-api-key": key},
        timeout=120,
    )
    assert response.status_code == 200, response.text


def refused(stack: Stack, key: str) -> openai.AuthenticationError:
    client = openai.OpenAI(base_url=stack.config.base_url, api_key=key, max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        client.models.list()
    return info.value


def test_no_secret_reaches_any_file_and_every_log_is_private(stack: Stack, api_key: str) -> None:
    """Invariant: after keys are created, used (plain and streaming), rotated and revoked, and
    refused ones are tried, no file under the stack's data directory holds any secret in clear
    except the operator's bootstrap key file, and that file and every log file are mode 0600."""
    admin = stack.admin_key
    assert admin, "the stack read no bootstrap admin key"
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{stack.config.http_port}/v1/admin",
        headers={"authorization": f"Bearer {admin}"},
        timeout=60,
    )

    def create(display_name: str, scope: str) -> tuple[str, str]:
        body = {"display_name": display_name, "tenant": "secrets-e2e", "scopes": [scope]}
        response = http.post("/api-keys", json=body)
        assert response.status_code == 200, response.text
        return response.json()["api_key"]["name"], response.json()["secret"]

    name_a, key_a = create("a", "inference")
    name_b, key_b = create("b", "inference")
    _, admin_2 = create("second admin", "admin")
    listed = http.get("/api-keys", headers={"authorization": f"Bearer {admin_2}"})
    assert listed.status_code == 200, listed.text

    chat(stack, key_a)
    chat(stack, key_b, stream=True)
    chat(stack, api_key)
    message(stack, key_b)

    rotated = http.post(f"/{name_b}:rotate", json={})
    assert rotated.status_code == 200, rotated.text
    key_b_new = rotated.json()["secret"]
    chat(stack, key_b_new, stream=True)
    assert key_b not in str(refused(stack, key_b))  # the old secret, named redacted if at all

    revoked = http.post(f"/{name_a}:revoke", json={})
    assert revoked.status_code == 200, revoked.text
    assert key_a not in str(refused(stack, key_a))
    forbidden = http.get("/api-keys", headers={"authorization": f"Bearer {key_b_new}"})
    assert forbidden.status_code == 403 and key_b_new not in forbidden.text

    secrets = {
        "bootstrap admin": admin,
        "session key": api_key,
        "a (revoked)": key_a,
        "b (rotated out)": key_b,
        "b (rotated in)": key_b_new,
        "second admin": admin_2,
    }
    data_dir = stack.config.data_dir
    envoy_log = data_dir / "envoy" / "envoy.log"
    # Positive control: the requests above are in the logs being searched. Envoy flushes its
    # access log every few seconds.
    deadline = time.monotonic() + 30
    while f"/v1/admin/{name_a}:revoke" not in envoy_log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the revoke request never reached {envoy_log}"
        time.sleep(0.5)

    leaks: list[str] = []
    logs: list[Path] = []
    for path in files_of(data_dir):
        relative = path.relative_to(data_dir)
        if path.name.endswith(".log"):
            logs.append(relative)
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode != 0o600:
                leaks.append(f"{relative}: mode {mode:o}, not 600")
        if path.stat().st_size > MAX_SCANNED_BYTES:
            continue
        try:
            content = path.read_bytes()
        except FileNotFoundError:  # a temporary file gone meanwhile
            continue
        for what, secret in secrets.items():
            if secret.encode() in content:
                if relative == BOOTSTRAP_KEY_FILE and what == "bootstrap admin":
                    continue
                leaks.append(f"{relative}: holds the {what} secret")
    key_file = data_dir / BOOTSTRAP_KEY_FILE
    if stat.S_IMODE(key_file.stat().st_mode) != 0o600:
        leaks.append(f"{BOOTSTRAP_KEY_FILE}: mode {stat.S_IMODE(key_file.stat().st_mode):o}")
    print(f"searched {len(logs)} log files for {len(secrets)} secrets: {sorted(map(str, logs))}")
    expected = {Path("logs") / f"{n}.log" for n in ("auth", "router", "orchestrator")}
    assert expected | {Path("envoy") / "envoy.log"} <= set(logs)
    assert any(p.name == "replica.log" for p in logs)
    assert leaks == []
