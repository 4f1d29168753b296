"""`KeyTableService.WatchKeyTable` over real gRPC: the snapshot (current, in-grace previous,
revoked and expired secrets; deleted keys absent; budget state), changes pushed at once for
this instance's writes and within the poll for another instance's, heartbeats, budgets
refreshed by reported usage, the caller guard, and the audit log's holes (PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import text as sql_text

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.api.auth.v1 import key_table_pb2_grpc, usage_pb2, usage_pb2_grpc
from inferplane.auth import schema
from inferplane.auth.domain import KeySpec, Limits
from inferplane.auth.key_table import KeyTableFeed, KeyTableMetrics, KeyTableSettings
from inferplane.auth.ledger import month_end
from inferplane.auth.migrations import MIGRATIONS
from inferplane.auth.settings import resolve_pepper
from inferplane.runtime import UnavailableError
from inferplane.runtime.security.api_keys import SecretHasher
from inferplane.runtime.security.identity import ADMIN, EDGE, ROUTER, PeerSecurity
from inferplane.runtime.security.pki import LocalCA
from inferplane.testing.databases import drop_schema
from inferplane.wire.headers import INTERNAL_TOKEN


class Watch:
    """One WatchKeyTable stream, opened and read on the auth's own loop by a task that
    queues what arrives (a read is never cancelled: that would cancel the call)."""

    def __init__(self, auth: Any, heartbeat: float = 5.0, metadata: Any = ()) -> None:
        self.auth = auth
        self.heartbeat = heartbeat
        self.metadata = metadata
        self.channel: grpc.aio.Channel | None = None
        self.call: Any = None
        self.queue: asyncio.Queue[Any] | None = None
        self.reader: asyncio.Task[None] | None = None
        self.seen: list[kpb.WatchKeyTableResponse] = []

    def open(self) -> Watch:
        async def _open() -> None:
            self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.auth.server.port}")
            stub = key_table_pb2_grpc.KeyTableServiceStub(self.channel)
            self.call = stub.WatchKeyTable(
                kpb.WatchKeyTableRequest(router_id="test", heartbeat_seconds=self.heartbeat),
                metadata=self.metadata,
            )
            self.queue = asyncio.Queue()
            self.reader = asyncio.create_task(self._read())

        self.auth.run(_open())
        return self

    async def _read(self) -> None:
        assert self.queue is not None
        try:
            async for message in self.call:
                self.queue.put_nowait(message)
            self.queue.put_nowait(EOFError("the stream ended"))
        except grpc.aio.AioRpcError as exc:
            self.queue.put_nowait(exc)

    def next(self, timeout: float = 3.0) -> kpb.WatchKeyTableResponse:
        async def _next() -> Any:
            assert self.queue is not None
            return await asyncio.wait_for(self.queue.get(), timeout)

        message = self.auth.loop.run(_next(), timeout + 1)
        if isinstance(message, BaseException):
            raise message
        self.seen.append(message)
        return message  # type: ignore[no-any-return]

    def change(self, timeout: float = 3.0) -> kpb.WatchKeyTableResponse:
        """The next message with entries or removals (heartbeats skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.next(max(0.01, deadline - time.monotonic()))
            if message.entries or message.removed or message.snapshot:
                return message

    def close(self) -> None:
        async def _close() -> None:
            if self.call is not None:
                self.call.cancel()
            if self.reader is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await self.reader
            if self.channel is not None:
                await self.channel.close(None)

        self.auth.run(_close())


@contextlib.contextmanager
def watching(auth: Any, **kwargs: Any) -> Iterator[Watch]:
    watch = Watch(auth, **kwargs).open()
    try:
        yield watch
    finally:
        watch.close()


def _hasher(auth: Any) -> SecretHasher:
    return SecretHasher(resolve_pepper(auth.settings))


def _create(auth: Any, **spec: Any) -> tuple[str, str]:
    key, secret = auth.run(
        auth.components.manager.create(KeySpec(tenant="acme", **spec), "test-admin")
    )
    return key.key_id, secret


def _by_hash(message: kpb.WatchKeyTableResponse) -> dict[str, kpb.KeyEntry]:
    return {e.secret_hash: e for e in message.entries}


def _time(ts: Any) -> datetime:
    return ts.ToDatetime(tzinfo=UTC)  # type: ignore[no-any-return]


def test_the_snapshot_holds_every_secret_auth_would_name(auth: Any) -> None:
    """Current secrets (expiry as valid_until), the rotated one in its grace period, revoked
    keys marked revoked; deleted keys absent; the admin key of the bootstrap is there too."""
    h = _hasher(auth)
    manager = auth.components.manager
    now = auth.clock.now()
    plain, plain_secret = _create(
        auth, scopes=("inference",), allowed_models=("kimi-tiny",), tier="priority"
    )
    _, expiring_secret = _create(auth, expire_time=now + timedelta(days=1))
    revoked, revoked_secret = _create(auth, limits=Limits(requests_per_minute=7))
    auth.run(manager.revoke(revoked, "test-admin"))
    deleted, deleted_secret = _create(auth)
    auth.run(manager.delete(deleted, "test-admin"))
    rotated, old_secret = _create(auth)
    _, new_secret = auth.run(manager.rotate(rotated, timedelta(hours=1), "test-admin"))

    with watching(auth) as watch:
        snapshot = watch.next()
    assert snapshot.snapshot and snapshot.revision == 1 and snapshot.HasField("as_of")
    entries = _by_hash(snapshot)
    assert h.hash(deleted_secret) not in entries
    assert h.hash(auth.admin_key) in entries  # the bootstrap admin key
    assert len(entries) == 6  # admin, plain, expiring, revoked, rotated's new and old secret

    e = entries[h.hash(plain_secret)]
    assert (e.key_id, e.tenant, list(e.scopes), list(e.allowed_models), e.tier) == (
        plain,
        "acme",
        ["inference"],
        ["kimi-tiny"],
        "priority",
    )
    assert not e.HasField("valid_until") and not e.revoked and not e.previous_secret
    assert _time(entries[h.hash(expiring_secret)].valid_until) == now + timedelta(days=1)
    assert entries[h.hash(revoked_secret)].revoked
    assert entries[h.hash(revoked_secret)].limits.requests_per_minute == 7
    old, new = entries[h.hash(old_secret)], entries[h.hash(new_secret)]
    assert old.key_id == new.key_id == rotated
    assert old.previous_secret and not new.previous_secret
    assert _time(old.valid_until) == now + timedelta(hours=1)
    assert auth.components.registry.get_sample_value("inferplane_auth_key_table_entries") == 6


def test_writes_through_this_instance_are_pushed_at_once(auth: Any) -> None:
    """Create, update, revoke, rotate and delete each reach the watch as a change: only the
    entries that changed, removed hashes for a deleted key and a secret rotated without
    grace; revisions count up by one."""
    h = _hasher(auth)
    manager = auth.components.manager
    with watching(auth) as watch:
        watch.next()
        key_id, secret = _create(auth)
        started = time.monotonic()
        created = watch.change()
        assert list(_by_hash(created)) == [h.hash(secret)] and not created.snapshot
        auth.run(
            manager.update(
                key_id, KeySpec(allowed_models=("kimi-tiny",)), frozenset({"allowed_models"}), "a"
            )
        )
        assert list(watch.change().entries[0].allowed_models) == ["kimi-tiny"]
        auth.run(manager.revoke(key_id, "a"))
        revoked = watch.change()
        assert [e.revoked for e in revoked.entries] == [True]
        pushed = time.monotonic() - started
        other_id, other = _create(auth)
        watch.change()
        _, rotated = auth.run(manager.rotate(other_id, timedelta(0), "a"))
        change = watch.change()
        assert list(_by_hash(change)) == [h.hash(rotated)] and list(change.removed) == [
            h.hash(other)
        ]
        auth.run(manager.delete(key_id, "a"))
        assert list(watch.change().removed) == [h.hash(secret)]
        revisions = [m.revision for m in watch.seen]
        assert revisions == list(range(1, len(revisions) + 1))
    assert pushed < 1.0  # three writes and their pushes, well within the poll interval each
    sent = auth.components.registry.get_sample_value(
        "inferplane_auth_key_table_updates_total", {"kind": "change"}
    )
    assert sent is not None and sent >= 6


def test_heartbeats_keep_coming_with_the_time_of_the_last_read(auth: Any) -> None:
    with watching(auth, heartbeat=0.1) as watch:
        watch.next()
        gaps = []
        last = time.monotonic()
        for _ in range(5):
            beat = watch.next(timeout=1.0)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            assert not beat.snapshot and not beat.entries and not beat.removed
            assert _time(beat.as_of) == auth.clock.now()
    assert max(gaps) < 0.5, gaps
    assert [m.revision for m in watch.seen] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_another_instances_writes_reach_the_watch_within_the_poll(
    tmp_path: Path, make_settings: Any, start_auth: Any, database: str
) -> None:
    """Two auth instances on one database: a revocation through A reaches a watch on B
    through B's poll of the audit log (0.25 s), and so do a new key and a deletion."""
    settings = make_settings(tmp_path)
    if database == "postgresql":
        url = os.environ.get("INFERPLANE_TEST_POSTGRES_URL", "")
        if not url:
            pytest.skip("set INFERPLANE_TEST_POSTGRES_URL to run it on PostgreSQL")
        drop_schema(url, MIGRATIONS, schema.METADATA)
        settings = make_settings(tmp_path, database_url=url)
    with start_auth(settings) as a, start_auth(settings) as b:
        h = _hasher(a)
        key_id, secret = _create(a)
        with watching(b) as watch:
            assert h.hash(secret) in _by_hash(watch.next())
            started = time.monotonic()
            a.run(a.components.manager.revoke(key_id, "a"))
            change = watch.change()
            took = time.monotonic() - started
            assert [(e.secret_hash, e.revoked) for e in change.entries] == [(h.hash(secret), True)]
            new_id, new_secret = _create(a)
            assert list(_by_hash(watch.change())) == [h.hash(new_secret)]
            a.run(a.components.manager.delete(new_id, "a"))
            assert list(watch.change().removed) == [h.hash(new_secret)]
            # Usage reported to A: B's budget poll (every second) reads the month's tokens.
            budget_id, budget_secret = _create(a, limits=Limits(monthly_token_budget=50))
            watch.change()
            usage_pb2_grpc.UsageServiceStub(a.channel).ReportUsage(
                usage_pb2.ReportUsageRequest(
                    usage=[
                        usage_pb2.RequestUsage(key_id=budget_id, request_id="r1", prompt_tokens=60)
                    ]
                ),
                timeout=5,
            )
            spent = watch.change(timeout=3.0).entries[0]
            assert (spent.secret_hash, spent.month_tokens, spent.budget_exhausted) == (
                h.hash(budget_secret),
                60,
                True,
            )
            # A change that left no audit event (written behind auth's back) comes with the
            # next full read of the table.
            with b.components.store.engine.begin() as conn:
                conn.execute(sql_text("UPDATE api_keys SET tier = 'priority'"))
            b.run(b.components.key_table.refresh(full=True))
            assert {e.tier for e in watch.change().entries} == {"priority"}
    print(f"{database}: a revocation on instance A reached B's watch in {took * 1000:.0f} ms")
    assert took < 1.0


def test_a_rotated_secret_leaves_the_table_when_its_grace_ends(auth: Any) -> None:
    h = _hasher(auth)
    key_id, old = _create(auth)
    with watching(auth) as watch:
        watch.next()
        auth.run(auth.components.manager.rotate(key_id, timedelta(seconds=60), "a"))
        change = watch.change()
        assert {e.previous_secret for e in change.entries} == {True, False}
        auth.clock.advance(61)
        assert list(watch.change().removed) == [h.hash(old)]


def test_budget_state_follows_reported_usage(auth: Any) -> None:
    """A key with a monthly budget carries this month's tokens; usage reported to this
    instance refreshes it (exhausted at the budget, resetting at the month's end); a key
    without a budget carries none."""
    h = _hasher(auth)
    key_id, secret = _create(auth, limits=Limits(monthly_token_budget=100))
    _, plain = _create(auth)
    stub = usage_pb2_grpc.UsageServiceStub(auth.channel)
    stub.ReportUsage(
        usage_pb2.ReportUsageRequest(
            usage=[
                usage_pb2.RequestUsage(
                    key_id=key_id, request_id="r1", prompt_tokens=30, completion_tokens=10
                )
            ]
        ),
        timeout=5,
    )
    with watching(auth) as watch:
        entries = _by_hash(watch.next())
        budgeted = entries[h.hash(secret)]
        assert (budgeted.month_tokens, budgeted.budget_exhausted) == (40, False)
        assert _time(budgeted.budget_resets) == month_end(auth.clock.now())
        assert not entries[h.hash(plain)].HasField("budget_resets")
        stub.ReportUsage(
            usage_pb2.ReportUsageRequest(
                usage=[
                    usage_pb2.RequestUsage(
                        key_id=key_id, request_id="r2", prompt_tokens=50, completion_tokens=20
                    )
                ]
            ),
            timeout=5,
        )
        spent = watch.change().entries[0]
        assert (spent.month_tokens, spent.budget_exhausted) == (110, True)


def test_the_caller_guard_is_usage_services(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    with start_auth(make_settings(tmp_path, internal_token="s3cret-internal")) as auth:
        for metadata, code in (
            ((), grpc.StatusCode.UNAUTHENTICATED),
            (((INTERNAL_TOKEN, "wrong"),), grpc.StatusCode.PERMISSION_DENIED),
        ):
            with (
                watching(auth, metadata=metadata) as watch,
                pytest.raises(grpc.aio.AioRpcError) as info,
            ):
                watch.next()
            assert info.value.code() == code
        with watching(auth, metadata=((INTERNAL_TOKEN, "s3cret-internal"),)) as watch:
            assert watch.next().snapshot


def test_a_database_that_cannot_be_read_stops_heartbeats_and_new_watches(auth: Any) -> None:
    """While the feed cannot read the database, its watches go quiet (the routers see their
    table age) and a new watch is refused; both come back once a read succeeds."""
    feed = auth.components.key_table
    store = auth.components.store
    with watching(auth, heartbeat=0.1) as watch:
        watch.next()
        watch.next(timeout=1.0)  # a heartbeat
        feed.settings = KeyTableSettings(**{**_fields(feed.settings), "fresh_seconds": 0.3})
        reads = ("audit_after", "last_audit_id", "all_keys", "get_many")
        real = {name: getattr(store, name) for name in reads}

        def broken(*args: Any) -> Any:
            raise UnavailableError("the API key database is unavailable")

        for name in reads:
            setattr(store, name, broken)
        try:
            time.sleep(0.5)
            drained = 0
            with contextlib.suppress(TimeoutError):
                while True:  # heartbeats sent before the reads failed for fresh_seconds
                    watch.next(timeout=0.4)
                    drained += 1
                    assert drained < 10
            with watching(auth) as refused, pytest.raises(grpc.aio.AioRpcError) as info:
                refused.next()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            for name, method in real.items():
                setattr(store, name, method)
        assert not watch.next(timeout=2.0).entries  # heartbeats again
    failures = auth.components.registry.get_sample_value(
        "inferplane_auth_key_table_poll_errors_total"
    )
    assert failures and failures >= 1


def _fields(settings: KeyTableSettings) -> dict[str, Any]:
    return {f: getattr(settings, f) for f in settings.__dataclass_fields__}


def test_holes_in_the_audit_log_are_waited_for() -> None:
    """PostgreSQL may commit event 11 before event 10: the low-water mark stays below 10 (so
    the next read sees it) until 10 comes or `gap_seconds` pass."""
    now = [0.0]
    feed = KeyTableFeed(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        KeyTableMetrics(CollectorRegistry()),
        KeyTableSettings(gap_seconds=10),
        timer=lambda: now[0],
    )
    feed._low = 8
    feed._follow([(9, "a"), (11, "b"), (12, "c")])
    assert feed._low == 9 and feed._seen == {11, 12}
    now[0] = 5
    feed._follow([(10, "d"), (11, "b"), (12, "c")])
    assert feed._low == 12 and not feed._seen and not feed._holes
    feed._follow([(14, "e")])
    assert feed._low == 12
    now[0] = 16
    feed._follow([(14, "e")])
    assert feed._low == 14 and not feed._holes


def test_under_mutual_tls_only_the_router_identity_may_watch(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    """The router's watch client (`inferplane.router.key_source` presents its identity the
    way this stub does) gets the table; the edge's and an operator's identities do not."""
    pki = tmp_path / "pki"
    ca = LocalCA.ensure(pki)
    for name in ("auth", EDGE, ROUTER, ADMIN):
        ca.issue(name, dns_names=(name,), ip_addresses=("127.0.0.1",))
    with start_auth(make_settings(tmp_path / "auth", tls_dir=pki)) as auth:
        address = f"127.0.0.1:{auth.server.port}"
        request = kpb.WatchKeyTableRequest(router_id="r")
        for identity, allowed in ((ROUTER, True), (EDGE, False), (ADMIN, False)):
            with PeerSecurity(pki, identity).channel(address) as channel:
                stream = key_table_pb2_grpc.KeyTableServiceStub(channel).WatchKeyTable(
                    request, timeout=5
                )
                try:
                    first = next(iter(stream))
                except grpc.RpcError as exc:
                    assert not allowed and exc.code() == grpc.StatusCode.PERMISSION_DENIED
                else:
                    assert allowed and first.snapshot
                finally:
                    stream.cancel()
