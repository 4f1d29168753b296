"""Stored responses in the auth database (SQLite): save / get / delete scoped to a tenant,
expiry and the purge job, the public and internal services' answers, and migration 0004 on an
empty database and on one at the previous head (0003) with data in it."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect, text

from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.auth.migrations import MIGRATIONS
from inferplane.auth.responses_service import ResponsesService, ResponseStoreService
from inferplane.auth.responses_store import SqlResponseStore, StoredResponse, pack_ids, unpack_ids
from inferplane.runtime import InvalidArgumentError, NotFoundError
from inferplane.testing.clock import FakeClock
from inferplane.testing.databases import version_rows
from inferplane.wire.headers import TENANT

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _row(response_id: str = "resp_1", tenant: str = "t1", **fields: Any) -> StoredResponse:
    values: dict[str, Any] = {
        "response_id": response_id,
        "tenant": tenant,
        "model": "kimi-tiny",
        "previous_response_id": "",
        "response_json": json.dumps({"id": response_id, "output": []}),
        "input_items_json": json.dumps(
            [
                {"id": f"msg_{i}", "type": "message", "role": "user", "content": str(i)}
                for i in range(5)
            ]
        ),
        "prompt_token_ids": [1, 2, 163586, 2**31 + 5],
        "output_token_ids": [7, 8],
        "render_key": "k",
        "created_at": T0,
        "expires_at": T0 + timedelta(days=30),
        **fields,
    }
    return StoredResponse(**values)


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = SqlResponseStore(f"sqlite:///{tmp_path / 'auth.db'}")
    s.create_schema()
    yield s
    s.close()


def test_ids_pack_as_uint32() -> None:
    ids = [0, 1, 163_586, 2**32 - 1]
    assert len(pack_ids(ids)) == 16
    assert unpack_ids(pack_ids(ids)) == ids


def test_save_get_delete_scoped_to_the_tenant(store: SqlResponseStore) -> None:
    store.save(_row())
    store.save(_row(model="again"))  # a retried save keeps the first
    got = store.get("t1", "resp_1", T0)
    assert got is not None and got.model == "kimi-tiny"
    assert got.prompt_token_ids == [1, 2, 163586, 2**31 + 5] and got.output_token_ids == [7, 8]
    assert store.get("t2", "resp_1", T0) is None
    assert store.delete("t2", "resp_1") is False
    assert store.delete("t1", "resp_1") is True
    assert store.get("t1", "resp_1", T0) is None


def test_expired_rows_read_as_absent_and_are_purged(store: SqlResponseStore) -> None:
    store.save(_row("resp_old", expires_at=T0 + timedelta(days=1)))
    store.save(_row("resp_new"))
    later = T0 + timedelta(days=2)
    assert store.get("t1", "resp_old", later) is None
    assert store.purge(later) == 1
    assert store.get("t1", "resp_new", later) is not None
    assert store.purge(later) == 0


class _Context:
    def __init__(self, metadata: dict[str, str]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return list(self._metadata.items())

    def auth_context(self) -> dict[str, Any]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


def test_services_save_load_list_and_refuse_other_tenants(store: SqlResponseStore) -> None:
    clock = FakeClock(start=T0)
    internal = ResponseStoreService(store, clock, timedelta(days=30))
    public = ResponsesService(store, verifier=None, clock=clock)  # type: ignore[arg-type]
    items = [{"id": f"msg_{i}", "type": "message"} for i in range(5)]

    async def scenario() -> None:
        saved = await internal.SaveResponse(
            rpb.SaveResponseRequest(
                tenant="t1",
                response_id="resp_9",
                model="m",
                response_json=b'{"id": "resp_9"}',
                input_items_json=json.dumps(items).encode(),
                prompt_token_ids=[1, 2],
                output_token_ids=[3],
                created_at=int(T0.timestamp()),
            ),
            None,
        )
        assert saved.expires_at == int((T0 + timedelta(days=30)).timestamp())
        loaded = await internal.LoadResponse(
            rpb.LoadResponseRequest(tenant="t1", response_id="resp_9"), None
        )
        assert list(loaded.prompt_token_ids) == [1, 2] and list(loaded.output_token_ids) == [3]
        with pytest.raises(NotFoundError) as caught:
            await internal.LoadResponse(
                rpb.LoadResponseRequest(tenant="t2", response_id="resp_9"), None
            )
        assert caught.value.param == "previous_response_id" and caught.value.code == "not_found"

        mine, theirs = _Context({TENANT: "t1"}), _Context({TENANT: "t2"})
        body = await public.GetResponse(rpb.GetResponseRequest(response_id="resp_9"), mine)
        assert json.loads(body.data) == {"id": "resp_9"}
        with pytest.raises(NotFoundError):
            await public.GetResponse(rpb.GetResponseRequest(response_id="resp_9"), theirs)
        page = json.loads(
            (
                await public.ListInputItems(
                    rpb.ListInputItemsRequest(response_id="resp_9", limit=2), mine
                )
            ).data
        )
        assert [i["id"] for i in page["data"]] == ["msg_4", "msg_3"] and page["has_more"]
        page = json.loads(
            (
                await public.ListInputItems(
                    rpb.ListInputItemsRequest(response_id="resp_9", order="asc", after="msg_2"),
                    mine,
                )
            ).data
        )
        assert [i["id"] for i in page["data"]] == ["msg_3", "msg_4"] and not page["has_more"]
        assert page["first_id"] == "msg_3" and page["last_id"] == "msg_4"
        with pytest.raises(InvalidArgumentError):
            await public.ListInputItems(
                rpb.ListInputItemsRequest(response_id="resp_9", limit=101), mine
            )
        with pytest.raises(NotFoundError):
            await public.DeleteResponse(rpb.DeleteResponseRequest(response_id="resp_9"), theirs)
        deleted = await public.DeleteResponse(rpb.DeleteResponseRequest(response_id="resp_9"), mine)
        assert json.loads(deleted.data)["deleted"] is True
        with pytest.raises(NotFoundError):
            await public.GetResponse(rpb.GetResponseRequest(response_id="resp_9"), mine)

    asyncio.run(scenario())


def test_migration_applies_on_an_empty_database_and_at_the_previous_head(tmp_path: Path) -> None:
    # Empty: straight to head.
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    fresh = SqlResponseStore(empty)
    fresh.create_schema()
    fresh.close()
    assert version_rows(empty, MIGRATIONS) == [("0008",)]  # head (0008: regions)

    # At 0003, with a ledger row: upgraded in place, the row kept.
    url = f"sqlite:///{tmp_path / 'previous.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:
        command.upgrade(MIGRATIONS.config(conn), "0003")
        conn.execute(
            text(
                "INSERT INTO usage_ledger (request_id, key_id, tenant, model, deployment, replica,"
                " status, prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens,"
                " ttft_seconds, duration_seconds, gpu_seconds, end_time, api) VALUES ('r1', 'k',"
                " 't', 'm', 'd', 'r', 'completed', 1, 0, 1, 0, 0, 0, 0, '2026-11-01 00:00:00',"
                " 'chat')"
            )
        )
    assert "stored_responses" not in inspect(engine).get_table_names()
    engine.dispose()
    store = SqlResponseStore(url)
    store.create_schema()
    store.save(_row())
    assert store.get("t1", "resp_1", T0) is not None
    store.close()
    assert version_rows(url, MIGRATIONS) == [("0008",)]
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM usage_ledger")).scalar() == 1
    engine.dispose()
