"""Deadlines and retries: UNAVAILABLE is retried, with backoff and within the call's deadline,
for the calls a repeat cannot change, and never for a create, rotate or delete."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from inferplane.api.auth.v1 import auth_pb2
from inferplane.runtime.processes.ports import free_port
from inferplane.sdk import (
    Client,
    DeadlineExceededError,
    RetryPolicy,
    UnavailableError,
)


class Sleeps:
    """The client's `sleep`: records each wait and runs `first` before the first one."""

    def __init__(self, first: Any = None) -> None:
        self.waits: list[float] = []
        self._first = first

    def __call__(self, seconds: float) -> None:
        if not self.waits and self._first is not None:
            self._first()
        self.waits.append(seconds)
        time.sleep(seconds)


def test_unavailable_is_retried_until_the_server_is_up(pki: Any, tmp_path: Path, fx: Any) -> None:
    """The first attempt finds nothing listening; the server starts during the first backoff
    and a later attempt lists the keys."""
    port = free_port()
    with contextlib.ExitStack() as stack:

        def start() -> None:
            stack.enter_context(fx.running_auth(pki, tmp_path / "auth", port=port))

        sleeps = Sleeps(first=start)
        with Client(
            auth=f"127.0.0.1:{port}",
            security=pki.security(),
            admin_key=fx.admin_key,
            retry=fx.fast_retry,
            sleep=sleeps,
            timeout=20,
        ) as client:
            keys = list(client.keys.list())
        assert len(keys) == 1  # the bootstrap admin key
        assert sleeps.waits and all(
            0 <= w <= fx.fast_retry.max_backoff_seconds for w in sleeps.waits
        )


def test_creates_rotations_and_deletes_are_not_retried(pki: Any, fx: Any) -> None:
    down = f"127.0.0.1:{free_port()}"
    sleeps = Sleeps()
    with Client(
        auth=down,
        orchestrator=down,
        security=pki.security(),
        admin_key=fx.admin_key,
        retry=RetryPolicy(max_attempts=3, initial_backoff_seconds=0.01, max_backoff_seconds=0.02),
        sleep=sleeps,
    ) as client:
        for call in (
            lambda: client.keys.create(auth_pb2.ApiKey(tenant="t")),
            lambda: client.keys.rotate("0123456789abcdef"),
            lambda: client.keys.delete("0123456789abcdef"),
            lambda: client.deployments.create("d", fx.llama8b()),
            lambda: client.deployments.delete("d"),
        ):
            with pytest.raises(UnavailableError) as info:
                call()
            assert info.value.http_status == 503
            assert sleeps.waits == []

        # A preview creates nothing: it is retried, as reads are (3 attempts, 2 waits).
        with pytest.raises(UnavailableError):
            client.deployments.create("d", fx.llama8b(), validate_only=True)
        assert len(sleeps.waits) == 2
        with pytest.raises(UnavailableError):
            client.keys.revoke("0123456789abcdef")
        assert len(sleeps.waits) == 4


def test_the_deadline_bounds_the_retries(pki: Any, fx: Any) -> None:
    patient = RetryPolicy(max_attempts=1000, initial_backoff_seconds=0.05, max_backoff_seconds=0.1)
    with Client(
        orchestrator=f"127.0.0.1:{free_port()}", security=pki.security(), retry=patient
    ) as client:
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            client.deployments.get("d", timeout=0.5)
    assert time.monotonic() - start < 2.5  # 0.5 s of attempts and waits, plus a loaded box


def test_a_slow_answer_exceeds_the_deadline(pki: Any, fx: Any) -> None:
    """An engine that never answers: the call ends at its deadline (504, `timeout`), and a
    deadline is not retried."""
    with fx.running_replica(pki, block_at=0) as replica:
        sleeps = Sleeps()
        with Client(inference=replica.address, security=pki.security(), sleep=sleeps) as client:
            start = time.monotonic()
            with pytest.raises(DeadlineExceededError) as info:
                client.inference.chat(
                    {"model": "kimi-tiny", "messages": [{"role": "user", "content": "hi"}]},
                    timeout=0.5,
                )
            assert time.monotonic() - start < 5
    assert (info.value.http_status, info.value.code) == (504, "timeout")
    assert sleeps.waits == []


def test_a_stream_is_retried_before_its_first_chunk(pki: Any, fx: Any) -> None:
    """A replica that is not ready answers UNAVAILABLE before generating anything: the stream
    is opened again once it is."""
    with fx.running_replica(pki) as replica:
        replica.chat.ready = False
        sleeps = Sleeps(first=lambda: setattr(replica.chat, "ready", True))
        with Client(
            inference=replica.address,
            security=pki.security(),
            retry=fx.fast_retry,
            sleep=sleeps,
        ) as client:
            chunks = client.inference.stream_chat(
                {"model": "kimi-tiny", "messages": [{"role": "user", "content": "hi"}]}
            )
            text = "".join(c.choices[0].delta.content for c in chunks if c.choices)
    assert text == fx.answer and len(sleeps.waits) >= 1


def test_calls_reach_the_leader_among_several_orchestrators(
    pki: Any, tmp_path: Path, fx: Any
) -> None:
    """Two orchestrators on one database, the standby named first: a create (never retried
    on UNAVAILABLE) is refused there with NOT_LEADER, which did nothing, so it is sent to the
    next one, the leader; the calls after it go to the leader first."""
    url = f"sqlite:///{tmp_path}/orchestrator.db"
    with (
        fx.running_orchestrator(pki, tmp_path / "a", database_url=url) as leader,
        fx.running_orchestrator(pki, tmp_path / "b", database_url=url) as standby,
    ):
        sleeps = Sleeps()
        with Client(
            orchestrator=f"{standby},{leader}",
            security=pki.security(),
            retry=fx.fast_retry,
            sleep=sleeps,
        ) as client:
            created = client.deployments.create("d", fx.llama8b())
            assert created.name == "deployments/d" and len(sleeps.waits) == 1
            assert [d.name for d in client.deployments.list()] == ["deployments/d"]
            assert len(sleeps.waits) == 1  # straight to the leader
        with Client(orchestrator=standby, security=pki.security(), sleep=sleeps) as alone:
            with pytest.raises(UnavailableError) as refused:
                alone.deployments.create("e", fx.llama8b())
            assert refused.value.reason == "NOT_LEADER"
