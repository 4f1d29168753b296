"""`python -m inferplane.console` as a process: serves its health page, serves HTTPS that
requires a client certificate of the CA under `--tls-dir`, and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.security.pki import LocalCA


def _start(*args: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferplane.console", "--port", str(port), "--no-json-logs", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, port


def _get(url: str, context: ssl.SSLContext | None = None, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as answer:
                return int(answer.status)
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=20)


def test_serves_health_and_stops_on_sigterm() -> None:
    proc, port = _start("--plaintext")
    try:
        assert _get(f"http://127.0.0.1:{port}/console/healthz") == 200
    finally:
        assert _stop(proc) == 0, proc.stdout.read().decode() if proc.stdout else ""


def test_under_mtls_only_holders_of_a_ca_certificate_connect(tmp_path: Path) -> None:
    ca = LocalCA.ensure(tmp_path)
    for name in ("admin", "edge"):
        ca.issue(name, dns_names=("localhost", name), ip_addresses=("127.0.0.1",), days=1)
    proc, port = _start("--tls-dir", str(tmp_path))
    url = f"https://127.0.0.1:{port}/console/healthz"
    try:
        edge = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        edge.load_cert_chain(str(tmp_path / "edge.crt"), str(tmp_path / "edge.key"))
        assert _get(url, edge) == 200
        anonymous = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            urllib.request.urlopen(url, timeout=5, context=anonymous)
    finally:
        assert _stop(proc) == 0
