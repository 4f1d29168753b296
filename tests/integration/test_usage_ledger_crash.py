"""The usage ledger survives its writer and its reporter being killed: a real auth process
(SQLite) receives the router's real usage outbox (`AuthUsageSink`, batches of 256, a spool
file) and is SIGKILLed twice while it writes; after each restart the outbox re-sends what was
not acknowledged. A process holding the outbox is SIGKILLed once its reports are durable and
before it delivered them; the next one on the same file delivers them. Every reported request
is in the ledger exactly once and the monthly token total counts each once: no row lost, none
doubled, no half-written batch."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.auth.v1 import auth_pb2, auth_pb2_grpc
from inferplane.router.records import ConcludedRequest
from inferplane.router.usage import AuthUsageSink, UsageSinkSettings
from inferplane.runtime.processes.ports import free_port

ADMIN_KEY = "ledger-crash-test-admin-key-0123456789"
REQUESTS = 3000


class AuthProcess:
    """`python -m inferplane.auth` on a fixed port and data dir, restartable."""

    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir, self.port = data_dir, port
        self.proc: subprocess.Popen[bytes] | None = None
        data_dir.mkdir(parents=True)
        self.log = (data_dir.parent / "auth.log").open("ab")

    def start(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "inferplane.auth",
            "--plaintext",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
        ]
        env = {**os.environ, "INFERPLANE_BOOTSTRAP_ADMIN_KEY": ADMIN_KEY}
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                assert self.proc.poll() is None, "auth exited at start-up (see auth.log)"
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    return
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "auth did not start"
                    time.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


@pytest.fixture
def auth(tmp_path: Path) -> Iterator[AuthProcess]:
    process = AuthProcess(tmp_path / "auth", free_port())
    process.start()
    try:
        yield process
    finally:
        process.stop()


def _concluded(key_id: str, request_id: str, i: int) -> ConcludedRequest:
    return ConcludedRequest(
        request_id=request_id,
        key_id=key_id,
        model="kimi-tiny",
        api="chat",
        prompt_tokens=7,
        completion_tokens=i % 11,
        end_time=1.8e9,
    )


def _create_key(auth: AuthProcess) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{auth.port}") as channel:
        created = auth_pb2_grpc.ApiKeyServiceStub(channel).CreateApiKey(
            auth_pb2.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(tenant="acme")),
            metadata=(("authorization", f"Bearer {ADMIN_KEY}"),),
            timeout=10,
        )
    return str(created.api_key.name.removeprefix("api-keys/"))


def _ledger(auth: AuthProcess, sql: str) -> int:
    with sqlite3.connect(auth.data_dir / "auth.db", timeout=5) as db:
        return int(db.execute(sql).fetchone()[0] or 0)


def test_killing_the_writer_mid_batch_loses_and_doubles_nothing(
    auth: AuthProcess, tmp_path: Path
) -> None:
    key_id = _create_key(auth)
    assert (auth.data_dir / "auth.db").exists()

    async def scenario() -> tuple[int, int]:
        registry = CollectorRegistry()
        sink = AuthUsageSink(
            UsageSinkSettings(
                target=f"127.0.0.1:{auth.port}",
                batch_size=256,
                backoff_initial_seconds=0.05,
                backoff_max_seconds=0.5,
            ),
            registry,
            spool_path=tmp_path / "router" / "usage-spool.db",
        )
        await sink.start()
        kills = 0
        try:
            for i in range(REQUESTS):
                assert sink.record(_concluded(key_id, f"req-{i:05d}", i))
            deadline = time.monotonic() + 120
            while sink.pending or sink.spooled:
                assert time.monotonic() < deadline, "the reports were not all delivered"
                written = await asyncio.to_thread(
                    _ledger, auth, "SELECT count(*) FROM usage_ledger"
                )
                # Kill the writer twice while it writes batches (some rows in, not all).
                if kills < 2 and written >= (kills + 1) * 700:
                    auth.kill()
                    kills += 1
                    await asyncio.sleep(0.3)  # a few sends fail meanwhile: they wait
                    await asyncio.to_thread(auth.start)
                await asyncio.sleep(0.005)
        finally:
            await sink.close()
        dropped = registry.get_sample_value(
            "inferplane_router_usage_reports_dropped_total", {"reason": "buffer_full"}
        )
        return kills, int(dropped or 0)

    kills, dropped = asyncio.run(scenario())
    assert kills == 2, "the writer was not killed mid-way (the ledger filled too fast)"
    assert dropped == 0
    assert _ledger(auth, "SELECT count(*) FROM usage_ledger") == REQUESTS
    assert _ledger(auth, "SELECT count(DISTINCT request_id) FROM usage_ledger") == REQUESTS
    expected = sum(7 + i % 11 for i in range(REQUESTS))
    assert _ledger(auth, "SELECT sum(prompt_tokens + completion_tokens) FROM usage_ledger") == (
        expected
    )
    assert _ledger(auth, "SELECT sum(tokens) FROM usage_monthly") == expected


# A router-side process: its outbox makes N reports durable while auth is unreachable (a port
# nobody listens on), prints "durable", then waits to be killed.
_REPORTER = """
import asyncio, sys
from pathlib import Path
from prometheus_client import CollectorRegistry
from inferplane.router.records import ConcludedRequest
from inferplane.router.usage import AuthUsageSink, UsageSinkSettings

async def main() -> None:
    key_id, path, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    sink = AuthUsageSink(
        UsageSinkSettings(target="127.0.0.1:9", backoff_max_seconds=0.5),
        CollectorRegistry(),
        spool_path=path,
    )
    await sink.start()
    last = 0
    for i in range(n):
        last = sink.record(
            ConcludedRequest(request_id=f"killed-{i:04d}", key_id=key_id, model="kimi-tiny",
                             api="chat", prompt_tokens=5, completion_tokens=1, end_time=1.8e9)
        )
    await sink.durable(last)
    print("durable", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_reporter_killed_after_concluding_delivers_from_its_outbox_after_restart(
    auth: AuthProcess, tmp_path: Path
) -> None:
    key_id = _create_key(auth)
    path = tmp_path / "router" / "usage-outbox.db"
    n = 500
    child = subprocess.Popen(
        [sys.executable, "-c", _REPORTER, key_id, str(path), str(n)], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"durable"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()

    async def restarted() -> int:
        sink = AuthUsageSink(
            UsageSinkSettings(target=f"127.0.0.1:{auth.port}", backoff_max_seconds=0.2),
            CollectorRegistry(),
            spool_path=path,
        )
        left = sink.spooled
        await sink.start()
        deadline = time.monotonic() + 30
        while sink.spooled:
            assert time.monotonic() < deadline, "the outbox was not delivered"
            await asyncio.sleep(0.02)
        await sink.close()
        return left

    assert asyncio.run(restarted()) == n  # everything the killed process concluded
    assert _ledger(auth, "SELECT count(*) FROM usage_ledger WHERE request_id LIKE 'killed-%'") == n
    assert _ledger(auth, "SELECT count(DISTINCT api) FROM usage_ledger") == 1
