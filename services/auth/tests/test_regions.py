"""Auth across regions (issue 31, docs/regions.md): two auth services on loopback, eu1 and us1,
each the other's peer through a TCP link the tests can cut (`Link`), real gRPC and SQLite.

A key created in eu1 is in us1's key table (what us1's routers authenticate against), pinned
keys are not; a revocation in eu1 reaches us1's table within `KEY_REPLICATION_SECONDS`; us1
restarted while eu1 is down keeps eu1's keys, and a key deleted in eu1 meanwhile is gone once
they reconnect; a budgeted key used in both regions is exhausted in both once the sum reaches
the budget, and during a cut each side decides by its own usage plus the other's last totals
(the overspend bound). The settings, secrets and admin fields of regions are checked first."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from inferplane import regions
from inferplane.api.auth.v1 import (
    auth_pb2,
    key_table_pb2,
    key_table_pb2_grpc,
    usage_pb2,
    usage_pb2_grpc,
)
from inferplane.auth import schema
from inferplane.auth.cli import app as keys_cli
from inferplane.auth.domain import KeySpec, Limits
from inferplane.auth.migrations import MIGRATIONS
from inferplane.auth.peer_store import SqlPeerKeyStore
from inferplane.auth.settings import load_auth_settings, resolve_pepper
from inferplane.runtime import ConfigError, InvalidArgumentError
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.security.api_keys import SecretHasher
from inferplane.runtime.security.pki import LocalCA
from inferplane.testing.databases import drop_schema
from inferplane.testing.links import Link

from .conftest import eventually

BUDGET = 1000


@pytest.fixture
def region_settings(tmp_path: Path, make_settings: Any, links: dict[str, Link]) -> Any:
    def settings(region: str, **overrides: Any) -> Any:
        other = "us1" if region == "eu1" else "eu1"
        return make_settings(
            tmp_path / region,
            region=region,
            peers={other: f"127.0.0.1:{links[other].port}"},
            pepper="one-pepper-shared-by-every-region",
            budget_sync_seconds=0.2,
            key_table_budget_seconds=0.2,
            **overrides,
        )

    return settings


@contextlib.contextmanager
def region(
    name: str, region_settings: Any, start_auth: Any, links: dict[str, Link]
) -> Iterator[Any]:
    with start_auth(region_settings(name)) as auth:
        links[name].target = auth.server.port
        yield auth


def _hasher(auth: Any) -> SecretHasher:
    return SecretHasher(resolve_pepper(auth.settings))


class Table:
    """A router's view of one auth's key table: a WatchKeyTable stream read on the auth's loop
    into a queue, applied as the router applies it (snapshot, changes, removals)."""

    def __init__(self, auth: Any) -> None:
        self.auth = auth
        self.entries: dict[str, key_table_pb2.KeyEntry] = {}
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        auth.run(self._open())

    async def _open(self) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.auth.server.port}")
        self.call = key_table_pb2_grpc.KeyTableServiceStub(self.channel).WatchKeyTable(
            key_table_pb2.WatchKeyTableRequest(router_id="test", heartbeat_seconds=0.2)
        )
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for message in self.call:
                self.queue.put_nowait(message)

    def read(self, timeout: float = 0.3) -> dict[str, key_table_pb2.KeyEntry]:
        """Applies what arrived within `timeout`; returns the table."""

        async def _drain() -> list[Any]:
            got: list[Any] = []
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while True:
                        got.append(await self.queue.get())
            return got

        for message in self.auth.run(_drain()):
            if message.snapshot:
                self.entries = {}
            for secret_hash in message.removed:
                self.entries.pop(secret_hash, None)
            self.entries.update((e.secret_hash, e) for e in message.entries)
        return self.entries

    def close(self) -> None:
        async def _close() -> None:
            self.call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
            await self.channel.close(None)

        self.auth.run(_close())


@contextlib.contextmanager
def table(auth: Any) -> Iterator[Table]:
    t = Table(auth)
    try:
        yield t
    finally:
        t.close()


def create(auth: Any, **spec: Any) -> tuple[str, str]:
    key, secret = auth.run(
        auth.components.manager.create(KeySpec(tenant="acme", **spec), "test-admin")
    )
    return key.key_id, secret


def report(auth: Any, key_id: str, request_id: str, tokens: int) -> None:
    usage_pb2_grpc.UsageServiceStub(auth.channel).ReportUsage(
        usage_pb2.ReportUsageRequest(
            usage=[
                usage_pb2.RequestUsage(key_id=key_id, request_id=request_id, prompt_tokens=tokens)
            ]
        ),
        timeout=5,
    )


def own_limits(entry: key_table_pb2.KeyEntry) -> auth_pb2.Limits:
    """The key's own limits in a key table entry (`key_limits` when it carries a share)."""
    return entry.key_limits if entry.HasField("key_limits") else entry.limits


def connected(auth: Any, peer: str) -> bool:
    registry = auth.components.registry
    value = registry.get_sample_value("inferplane_auth_peer_connected", {"region": peer})
    return value == 1.0


# -- settings, secrets, the admin API ----------------------------------------------------------


def test_region_flags_and_their_errors(tmp_path: Path) -> None:
    base = ["--data-dir", str(tmp_path), "--plaintext"]
    settings = load_auth_settings(
        [*base, "--region", "eu1", "--peer", "us1=10.0.0.2:50051", "--peer=ap1=h:1"], {}
    )
    assert settings.region == "eu1"
    assert dict(settings.peers) == {"us1": "10.0.0.2:50051", "ap1": "h:1"}
    assert load_auth_settings(base, {}).peers == {}
    for argv, message in (
        (["--region", "EU-1"], "invalid region name"),
        (["--peer", "us1=h:1"], "needs 'region'"),
        (["--region", "eu1", "--peer", "eu1=h:1"], "own region"),
        (["--region", "eu1", "--peer", "us1"], "REGION=HOST:PORT"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_auth_settings([*base, *argv], {})


def test_secrets_carry_the_home_region_and_the_pin(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    with start_auth(make_settings(tmp_path, region="eu1")) as auth:
        created = auth.keys.CreateApiKey(
            auth_pb2.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(tenant="acme")),
            metadata=auth.admin_md(),
            timeout=5,
        )
        assert created.secret.startswith("ip-eu1.")
        assert regions.region_of_secret(created.secret) == ("eu1", False)
        assert (created.api_key.home_region, created.api_key.region_pinned) == ("eu1", False)
        assert created.api_key.key_prefix == created.secret[:12]  # "ip-eu1." + 5 characters
        pinned = auth.keys.CreateApiKey(
            auth_pb2.CreateApiKeyRequest(
                api_key=auth_pb2.ApiKey(tenant="acme", region_pinned=True)
            ),
            metadata=auth.admin_md(),
            timeout=5,
        )
        assert regions.region_of_secret(pinned.secret) == ("eu1", True)
        assert pinned.api_key.region_pinned
        key_id = pinned.api_key.name.removeprefix("api-keys/")
        _, rotated = auth.run(auth.components.manager.rotate(key_id, timedelta(0), "admin"))
        assert rotated.startswith("ip-eu1~")  # the pin outlives rotations
        with pytest.raises(grpc.RpcError) as err:
            auth.keys.UpdateApiKey(
                auth_pb2.UpdateApiKeyRequest(
                    api_key=auth_pb2.ApiKey(name=pinned.api_key.name, region_pinned=False),
                    update_mask={"paths": ["region_pinned"]},
                ),
                metadata=auth.admin_md(),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "create only" in (err.value.details() or "")
    with start_auth(make_settings(tmp_path / "single")) as auth:
        _, secret = create(auth)
        assert regions.region_of_secret(secret) is None and secret.startswith("ip-")
        with pytest.raises(InvalidArgumentError, match="--region"):
            create(auth, region_pinned=True)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_the_peer_store_replaces_and_applies(tmp_path: Path, database: str) -> None:
    url = f"sqlite:///{tmp_path / 'auth.db'}"
    if database == "postgresql":
        url = os.environ.get("INFERPLANE_TEST_POSTGRES_URL", "")
        if not url:
            pytest.skip("set INFERPLANE_TEST_POSTGRES_URL to run the store tests on PostgreSQL")
        drop_schema(url, MIGRATIONS, schema.METADATA)
    store = SqlPeerKeyStore(url)
    store.create_schema()
    entry = key_table_pb2.KeyEntry
    now = datetime.now(UTC)
    store.replace("eu1", [entry(secret_hash="a", key_id="k1"), entry(secret_hash="b")], now)
    store.replace("us1", [entry(secret_hash="a", key_id="other")], now)
    store.apply("eu1", [entry(secret_hash="c", key_id="k3")], {"b"}, now)
    loaded = store.load(["eu1", "us1", "ap1"])
    assert sorted(loaded["eu1"]) == ["a", "c"] and loaded["us1"]["a"].key_id == "other"
    assert loaded["ap1"] == {}
    # Another auth instance of the region, following the same peer, writes the same rows
    # (upserts: no conflict), and a change replaces an entry in place.
    twin = SqlPeerKeyStore(url)
    twin.replace("eu1", [entry(secret_hash="a", key_id="k1"), entry(secret_hash="c")], now)
    twin.apply("eu1", [entry(secret_hash="a", key_id="k1", revoked=True)], (), now)
    twin.close()
    assert store.load(["eu1"])["eu1"]["a"].revoked
    store.replace("eu1", [], now)
    assert store.load(["eu1"]) == {"eu1": {}}
    store.close()


def test_the_cli_creates_a_pinned_key(tmp_path: Path, make_settings: Any, start_auth: Any) -> None:
    env = {"INFERPLANE_ADMIN_KEY": "", "COLUMNS": "200", "INFERPLANE_PLAINTEXT": "1"}
    with start_auth(make_settings(tmp_path, region="eu1")) as auth:
        env["INFERPLANE_ADMIN_KEY"] = auth.admin_key
        address = ["--address", f"127.0.0.1:{auth.server.port}"]
        created = CliRunner().invoke(
            keys_cli, ["create", "--tenant", "acme", "--region-pinned", *address], env=env
        )
        assert created.exit_code == 0, created.output
        assert re.search(r"^ip-eu1~[A-Za-z0-9_-]{43}$", created.output, re.M)
        assert "eu1 (pinned)" in created.output


# -- replication -------------------------------------------------------------------------------


def test_keys_replicate_revocation_within_the_bound_and_pins_stay_home(
    region_settings: Any, start_auth: Any, links: dict[str, Link]
) -> None:
    with (
        region("eu1", region_settings, start_auth, links) as eu1,
        region("us1", region_settings, start_auth, links) as us1,
        table(us1) as us1_table,
        table(eu1) as eu1_table,
    ):
        h = _hasher(eu1)
        eventually(lambda: connected(us1, "eu1") and connected(eu1, "us1"), what="connected")
        key_id, secret = create(eu1, limits=Limits(requests_per_minute=5))
        _, pinned = create(eu1, region_pinned=True)
        us1_key, us1_secret = create(us1)
        _, admin_secret = create(eu1, scopes=("admin",))
        entry = eventually(
            lambda: us1_table.read().get(h.hash(secret)), what="eu1's key in us1's table"
        )
        # us1's ext_authz (the routes the picker does not serve) knows it too, as an
        # inference key only: administration stays at home.
        assert us1.check(secret, "/v1/models").status.code == 0
        assert us1.check(pinned, "/v1/models").denied_response.status.code == 401
        eventually(lambda: h.hash(admin_secret) in us1.components.peers.entries("eu1"))
        assert us1.check(admin_secret, "/v1/admin/api-keys").denied_response.status.code == 403
        assert (entry.key_id, entry.tenant, entry.home_region) == (key_id, "acme", "eu1")
        # The key's own limit (us1's entry carries us1's share of it: inferplane.auth.shares).
        assert own_limits(entry).requests_per_minute == 5 and not entry.revoked
        assert eventually(lambda: eu1_table.read().get(h.hash(us1_secret))).key_id == us1_key
        us1_table.read(0.5)
        assert h.hash(pinned) not in us1_table.entries  # never replicated
        assert h.hash(pinned) in eu1_table.read()  # served at home
        # A limit change and a rotation (with grace) in eu1 reach us1's table too.
        manager = eu1.components.manager
        eu1.run(
            manager.update(
                key_id,
                KeySpec(limits=Limits(requests_per_minute=9)),
                frozenset({"limits"}),
                "test-admin",
            )
        )
        eventually(
            lambda: own_limits(us1_table.read(0.02)[h.hash(secret)]).requests_per_minute == 9,
            what="the limit change in us1",
        )
        _, rotated = eu1.run(manager.rotate(key_id, timedelta(hours=1), "test-admin"))
        eventually(lambda: h.hash(rotated) in us1_table.read(0.02), what="the rotation in us1")
        assert us1_table.entries[h.hash(secret)].previous_secret
        # Revocation in eu1 -> us1's routers' table, timed.
        started = time.monotonic()
        eu1.run(eu1.components.manager.revoke(key_id, "test-admin"))
        eventually(lambda: us1_table.read(0.02)[h.hash(secret)].revoked, what="revoked in us1")
        took = time.monotonic() - started
        assert took < regions.KEY_REPLICATION_SECONDS, took
        refused = us1.check(secret, "/v1/models").denied_response
        assert refused.status.code == 401 and "revoked" in refused.body
        print(f"\nrevocation eu1 -> us1's key table: {took * 1000:.0f} ms")
        held = us1.components.peers.entries("eu1")
        assert h.hash(secret) in held and h.hash(pinned) not in held
        gauge = us1.components.registry.get_sample_value(
            "inferplane_auth_peer_key_entries", {"region": "eu1"}
        )
        assert gauge == len(held)


def test_a_region_keeps_its_copy_through_a_cut_and_a_restart(
    region_settings: Any, start_auth: Any, links: dict[str, Link]
) -> None:
    with region("eu1", region_settings, start_auth, links) as eu1:
        h = _hasher(eu1)
        kept, kept_secret = create(eu1)
        deleted, deleted_secret = create(eu1)
        with region("us1", region_settings, start_auth, links) as us1, table(us1) as t:
            eventually(
                lambda: {h.hash(kept_secret), h.hash(deleted_secret)} <= set(t.read()),
                what="both keys in us1",
            )
        # us1 is down; the key is deleted in eu1, then eu1 goes down too.
        eu1.run(eu1.components.manager.delete(deleted, "test-admin"))
    # us1 restarts during the cut: its copy comes from its database.
    with region("us1", region_settings, start_auth, links) as us1, table(us1) as t:
        entries = t.read(0.5)
        assert {h.hash(kept_secret), h.hash(deleted_secret)} <= set(entries)
        assert not connected(us1, "eu1")
        age = us1.components.registry.get_sample_value(
            "inferplane_auth_peer_update_age_seconds", {"region": "eu1"}
        )
        assert age == float("inf")
        # eu1 returns: its snapshot replaces the copy, the deleted key disappears.
        with region("eu1", region_settings, start_auth, links):
            eventually(lambda: h.hash(deleted_secret) not in t.read(0.05), what="deletion")
            assert t.entries[h.hash(kept_secret)].key_id == kept
            assert connected(us1, "eu1")


def test_auths_follow_each_other_under_mutual_tls_with_the_internal_token(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    """The `auth` identity's certificate and the internal token: a peer presenting the
    right token is followed; one whose token differs is refused (and says why)."""
    pki = tmp_path / "pki"
    ca = LocalCA.ensure(pki)
    ca.issue("auth", dns_names=("auth",), ip_addresses=("127.0.0.1",))
    ports = {"eu1": free_port(), "us1": free_port()}

    def settings(name: str, other: str, token: str) -> Any:
        return make_settings(
            tmp_path / name,
            port=ports[name],
            tls_dir=pki,
            internal_token=token,
            region=name,
            peers={other: f"127.0.0.1:{ports[other]}"},
            pepper="one-pepper-shared-by-every-region",
            budget_sync_seconds=0.2,
        )

    with (
        start_auth(settings("eu1", "us1", "token-of-every-region")) as eu1,
        start_auth(settings("us1", "eu1", "another-token")) as us1,
    ):
        _, secret = create(eu1, limits=Limits(monthly_token_budget=BUDGET))
        hashed = _hasher(eu1).hash(secret)
        # us1 presents "another-token" to eu1: refused; eu1 presents its own to us1: refused.
        time.sleep(1.0)
        assert not connected(us1, "eu1") and not connected(eu1, "us1")
        assert hashed not in us1.components.peers.entries("eu1")
    with (
        start_auth(settings("eu1", "us1", "token-of-every-region")) as eu1,
        start_auth(settings("us1", "eu1", "token-of-every-region")) as us1,
    ):
        eventually(lambda: hashed in us1.components.peers.entries("eu1"), what="replicated")
        eventually(lambda: connected(us1, "eu1") and connected(eu1, "us1"), what="both ways")
        ok = {"region": "eu1", "outcome": "ok"}
        eventually(
            lambda: us1.components.registry.get_sample_value(
                "inferplane_auth_peer_budget_syncs_total", ok
            ),
            what="a month-totals read under mutual TLS",
        )


# -- budgets -----------------------------------------------------------------------------------


def test_a_budget_is_spent_over_every_region_and_the_cut_bound_holds(
    region_settings: Any, start_auth: Any, links: dict[str, Link]
) -> None:
    with (
        region("eu1", region_settings, start_auth, links) as eu1,
        region("us1", region_settings, start_auth, links) as us1,
        table(eu1) as eu1_table,
        table(us1) as us1_table,
    ):
        h = _hasher(eu1)
        key_id, secret = create(eu1, limits=Limits(monthly_token_budget=BUDGET))
        hashed = h.hash(secret)
        eventually(lambda: hashed in us1_table.read(), what="the key in us1")

        def months() -> tuple[int, int]:
            return (
                eu1_table.read(0.05)[hashed].month_tokens,
                us1_table.read(0.05)[hashed].month_tokens,
            )

        # Both regions serve the key (us1 records a row of a key homed in eu1).
        report(eu1, key_id, "eu1-1", 300)
        report(us1, key_id, "us1-1", 300)
        eventually(lambda: months() == (600, 600), what="600 in both")
        assert us1.components.peers.tenant_of(key_id) == "acme"

        # The cut: each side serves 300 more and knows only its own part of that.
        links["eu1"].cut()
        links["us1"].cut()
        eventually(lambda: not connected(us1, "eu1") and not connected(eu1, "us1"))
        report(eu1, key_id, "eu1-2", 300)
        report(us1, key_id, "us1-2", 300)
        eventually(lambda: months() == (900, 900), what="own usage + the other's last totals")
        assert not eu1_table.entries[hashed].budget_exhausted
        assert not us1_table.entries[hashed].budget_exhausted
        # eu1 spends 200 more: its sum (its 800 + us1's last 300) reaches the budget. The
        # real total is then 1,400: the overspend (400) is exactly what us1 served during the
        # cut (300) plus eu1's last request over the line (100), the stated bound.
        report(eu1, key_id, "eu1-3", 200)
        eventually(lambda: eu1_table.read(0.05)[hashed].budget_exhausted, what="eu1 refuses")
        assert eu1_table.entries[hashed].month_tokens == 800 + 300
        assert not us1_table.read(0.3)[hashed].budget_exhausted  # us1 cannot know yet
        # The cut heals: both see every region's usage, both refuse.
        links["eu1"].restore()
        links["us1"].restore()
        eventually(lambda: months() == (1400, 1400), what="1,400 in both after the cut")
        assert eu1_table.entries[hashed].budget_exhausted
        assert us1_table.entries[hashed].budget_exhausted
