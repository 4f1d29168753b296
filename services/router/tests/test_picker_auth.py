"""The endpoint picker authenticates in its first exchange: a `KeyTable` fed by hand (as auth's
watch feeds it), the picker over real gRPC driven like Envoy drives it (`ExtProcStream`).

A refusal answers the request headers (no body is read); an accepted key's headers answer
carries auth's verdict, removes the key and forged trusted headers, and marks the request
authenticated for the edge's picker guard."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from google.protobuf import timestamp_pb2

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.router.keys import KeyTable
from inferplane.runtime.security.api_keys import SecretHasher
from inferplane.testing.clock import FakeClock
from inferplane.wire import headers

from .test_picker import CHAT, _chat_body, _endpoint_list, picker_rig

pytestmark = pytest.mark.timeout(30)

PEPPER = b"p" * 32
GOOD = "ip-good-secret-0123456789"
REVOKED = "ip-revoked-secret-0123456789"
EXPIRED = "ip-expired-secret-0123456789"
CONSOLE_ONLY = "ip-console-secret-0123456789"
ONLY_OTHER = "ip-other-model-secret-0123456789"


def _entry(secret: str, key_id: str, **fields: Any) -> kpb.KeyEntry:
    return kpb.KeyEntry(
        secret_hash=SecretHasher(PEPPER).hash(secret),
        key_id=key_id,
        tenant="t1",
        scopes=fields.pop("scopes", ["inference"]),
        tier="premium",
        **fields,
    )


def _table(*, received: bool = True) -> KeyTable:
    clock = FakeClock()
    table = KeyTable(SecretHasher(PEPPER), clock)
    if received:
        past = timestamp_pb2.Timestamp()
        past.FromDatetime(clock.now() - dt.timedelta(days=1))
        table.apply(
            kpb.WatchKeyTableResponse(
                snapshot=True,
                entries=[
                    _entry(GOOD, "k-good"),
                    _entry(REVOKED, "k-revoked", revoked=True),
                    _entry(EXPIRED, "k-expired", valid_until=past),
                    _entry(CONSOLE_ONLY, "k-console", scopes=["console"]),
                    _entry(ONLY_OTHER, "k-other", allowed_models=["other"]),
                ],
            )
        )
    return table


def _error(answer: ext_pb.ProcessingResponse) -> dict[str, Any]:
    assert answer.HasField("immediate_response"), answer
    return dict(json.loads(answer.immediate_response.body))


def _set(mutation: ext_pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def _picker_metadata(answer: ext_pb.ProcessingResponse) -> dict[str, Any]:
    namespace = answer.dynamic_metadata.fields.get(headers.PICKER_NAMESPACE)
    if namespace is None:
        return {}
    return {k: v.bool_value or v.string_value for k, v in namespace.struct_value.fields.items()}


@pytest.mark.parametrize(
    ("key", "status", "code"),
    [
        ("ip-unknown-secret-0123456789", 401, "invalid_api_key"),
        (REVOKED, 401, "invalid_api_key"),
        (EXPIRED, 401, "invalid_api_key"),
        ("short", 401, "invalid_api_key"),
        (CONSOLE_ONLY, 403, "insufficient_scope"),
    ],
    ids=["unknown", "revoked", "expired", "malformed", "scope"],
)
def test_a_bad_key_is_refused_at_the_headers_in_openais_shape(
    key: str, status: int, code: str
) -> None:
    """An unknown, revoked, expired or malformed key is 401, a key without the path's scope
    403, answered to the request headers (the body is never asked for), no slot taken, no
    usage report; the record keeps the refusal."""

    async def scenario() -> None:
        async with picker_rig(keys=_table()) as rig:
            stream = rig.stream()
            answer = await stream.headers(CHAT, {"authorization": f"Bearer {key}"})
            assert answer.immediate_response.status.code == status
            error = _error(answer)["error"]
            assert error["code"] == code and key not in error["message"]
            assert rig.in_flight() == 0
            await asyncio.sleep(0.05)
            assert rig.usage.reports == []
            assert [r.error_code for r in rig.records] == [code]

    asyncio.run(scenario())


def test_no_table_yet_is_a_retryable_503() -> None:
    """Before auth's first update every request is refused: 503 auth_unavailable (fail
    closed, retryable)."""

    async def scenario() -> None:
        async with picker_rig(keys=_table(received=False)) as rig:
            answer = await rig.stream().headers(CHAT, {"authorization": f"Bearer {GOOD}"})
            assert answer.immediate_response.status.code == 503
            assert _error(answer)["error"]["code"] == "auth_unavailable"

    asyncio.run(scenario())


def test_a_bad_key_on_anthropics_path_is_anthropics_authentication_error() -> None:
    """`x-api-key` (Anthropic's convention) on `/v1/messages`: Anthropic's error body."""

    async def scenario() -> None:
        async with picker_rig(keys=_table()) as rig:
            answer = await rig.stream().headers("/v1/messages", {"x-api-key": REVOKED})
            assert answer.immediate_response.status.code == 401
            body = _error(answer)
            assert body["type"] == "error"
            assert body["error"]["type"] == "authentication_error"

    asyncio.run(scenario())


def test_an_accepted_key_gets_the_verdict_the_mark_and_the_key_removed() -> None:
    """The headers answer sets auth's verdict (what ext_authz used to set), removes the key
    headers and a forged trusted header, and marks the request authenticated; the decision
    reads the verdict (the usage report's key, the record's tenant); the pick names the
    routed model."""

    async def scenario() -> None:
        async with picker_rig(keys=_table()) as rig:
            stream = rig.stream()
            sent = {
                "authorization": f"Bearer {GOOD}",
                "x-api-key": "other",
                "x-inferplane-forged": "1",
                "x-request-id": "req-9",
            }
            answer = await stream.headers(CHAT + "?beta=true", sent)
            assert answer.HasField("request_headers")
            mutation = answer.request_headers.response.header_mutation
            assert _set(mutation) == {
                headers.TENANT: "t1",
                headers.KEY_ID: "k-good",
                headers.SCOPES: "inference",
                headers.ALLOWED_MODELS: "",
                headers.TIER: "premium",
            }
            assert set(mutation.remove_headers) == {
                "authorization",
                "x-api-key",
                "x-inferplane-forged",
            }
            assert all(h.keep_empty_value for h in mutation.set_headers)
            assert _picker_metadata(answer) == {headers.PICKER_AUTHENTICATED: True}
            picked = await stream.body(_chat_body(model="m-alias"))
            assert len(_endpoint_list(picked)) == 3
            assert _picker_metadata(picked) == {headers.PICKER_MODEL: "m-alias"}
            await stream.response_headers({":status": "200"})
            await stream.response_trailers({"grpc-status": "0"})
            await stream.close()
            assert [(r.key_id, r.request_id) for r in rig.usage.reports] == [("k-good", "req-9")]
            assert [(r.tenant, r.key_id) for r in rig.records] == [("t1", "k-good")]

    asyncio.run(scenario())


def test_the_verdict_is_what_the_director_reads() -> None:
    """A key allowed only another model gets 403 model_not_allowed from the decision (its
    allow-list came from the table, not from a header); a model no route serves is labelled
    as the unknown model, never by the client's text."""

    async def scenario() -> None:
        async with picker_rig(keys=_table()) as rig:
            stream = rig.stream()
            await stream.headers(CHAT, {"authorization": f"Bearer {ONLY_OTHER}"})
            answer = await stream.body(_chat_body())
            assert answer.immediate_response.status.code == 403
            assert _error(answer)["error"]["code"] == "model_not_allowed"
            stream = rig.stream()
            await stream.headers(CHAT, {"authorization": f"Bearer {GOOD}"})
            answer = await stream.body(_chat_body(model="../../etc/passwd"))
            assert answer.immediate_response.status.code == 404
            assert _picker_metadata(answer) == {headers.PICKER_MODEL: headers.UNKNOWN_MODEL}

    asyncio.run(scenario())


def test_without_a_table_only_ext_authzs_verdict_marks_a_request() -> None:
    """`keys=None`: the picker checks no key; a request carrying ext_authz's verdict
    (`x-inferplane-key-id`, which the edge strips from clients) is marked authenticated, one
    without it is not (the edge's picker guard refuses it)."""

    async def scenario() -> None:
        async with picker_rig() as rig:
            answer = await rig.stream().headers(CHAT, {headers.KEY_ID: "k1"})
            assert _picker_metadata(answer) == {headers.PICKER_AUTHENTICATED: True}
            assert not answer.request_headers.response.header_mutation.remove_headers
            answer = await rig.stream().headers(CHAT, {"authorization": "Bearer x" * 3})
            assert answer.HasField("request_headers")
            assert _picker_metadata(answer) == {}

    asyncio.run(scenario())


def test_the_pickers_rest_table_is_the_edges() -> None:
    """The picker's one path table (`codec.ROUTES`, from the protos' HTTP bindings) agrees
    with what the edge does after it: every path is under the edge's generation route
    (`/v1/`), and a path's streamed method is the one the stream router moves `"stream":
    true` to (its internal path is that method's binding)."""
    from google.api import annotations_pb2

    from inferplane.api.inference.v1 import inference_pb2 as pb
    from inferplane.edge._base import lua_source
    from inferplane.router.picker import codec

    bindings = {
        codec.METHODS[f"/inferplane.inference.v1.InferenceService/{m.name}"]: rule.post
        for m in pb.DESCRIPTOR.services_by_name["InferenceService"].methods
        if (rule := m.GetOptions().Extensions[annotations_pb2.http]).post
        and f"/inferplane.inference.v1.InferenceService/{m.name}" in codec.METHODS
    }
    stream_router = lua_source("stream_router")
    moved = dict(re.findall(r'\["(/v1/[^"]+)"\] = "([^"]+)"', stream_router))
    assert moved  # the stream router's table was read
    for path, (unary, streamed) in codec.ROUTES.items():
        assert path.startswith("/v1/") and bindings[unary] == path
        if streamed is not unary:
            assert moved[path] == bindings[streamed], path
        else:
            assert path not in moved, path
    assert set(moved) <= set(codec.ROUTES)
