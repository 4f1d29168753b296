"""Failed calls raise the platform's error classes with what the edge would tell an HTTP client
(status, OpenAI type and code), from real servers under mutual TLS."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferplane.api.auth.v1 import auth_pb2
from inferplane.runtime import DEFAULT_OPENAI_CODE, HTTP_STATUS
from inferplane.runtime.security.identity import ROUTER
from inferplane.sdk import (
    AlreadyExistsError,
    Client,
    InferplaneError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnimplementedError,
)

LUA = Path(__file__).parents[2] / "inferplane" / "edge" / "lua" / "error_shaper.lua"


def _lua_table(name: str) -> dict[int, str]:
    body = re.search(rf"local {name} = \{{(.*?)\n\}}", LUA.read_text(), re.S)
    assert body is not None, f"{name} not found in {LUA}"
    return {int(k): v.strip('"') for k, v in re.findall(r"\[(\d+)\] = (\"?[\w]+\"?)", body[1])}


def test_the_tables_are_the_edges() -> None:
    """The SDK's `http_status` and default `code` are the edge's (error_shaper.lua): one table
    in Python, pinned to the Lua copy the edge runs."""
    http = {code.value[0]: str(status) for code, status in HTTP_STATUS.items() if code.value[0]}
    assert _lua_table("HTTP_STATUS") == http
    codes = {code.value[0]: text for code, text in DEFAULT_OPENAI_CODE.items()}
    assert _lua_table("DEFAULT_CODE") == codes


def _raised(call: Any, *args: Any, **kwargs: Any) -> InferplaneError:
    with pytest.raises(InferplaneError) as info:
        call(*args, **kwargs)
    return info.value


def test_not_found_invalid_argument_already_exists(
    client: Client, pki: Any, orchestrator: str, fx: Any
) -> None:
    missing = _raised(client.keys.get, "0123456789abcdef")
    assert isinstance(missing, NotFoundError)
    assert (missing.grpc_code, missing.http_status) == (grpc.StatusCode.NOT_FOUND, 404)
    assert (missing.openai_type, missing.code) == ("invalid_request_error", "api_key_not_found")
    assert missing.reason == "API_KEY_NOT_FOUND"
    assert missing.message == "api-keys/0123456789abcdef not found"

    key = client.keys.create(auth_pb2.ApiKey(tenant="t", scopes=["inference"])).api_key
    bad = _raised(client.keys.update, key, ["tenant"])
    assert isinstance(bad, InvalidArgumentError)
    assert (bad.http_status, bad.param) == (400, "update_mask")
    assert "'tenant' cannot be changed" in bad.message

    fx.register_node(pki, orchestrator)
    client.deployments.create("llama", fx.llama8b())
    taken = _raised(client.deployments.create, "llama", fx.llama8b())
    assert isinstance(taken, AlreadyExistsError) and taken.http_status == 409
    gone = _raised(client.deployments.explain, "nope")
    assert isinstance(gone, NotFoundError) and gone.param == "name"


def test_identity_policy_and_credentials(pki: Any, auth: str, orchestrator: str) -> None:
    """Another service's identity is refused by the server's peer policy (403); an operator
    without an admin key is unauthenticated on auth (401)."""
    with Client(auth=auth, orchestrator=orchestrator, security=pki.security(ROUTER)) as router:
        for call in (router.keys.get, router.deployments.get):
            denied = _raised(call, "x")
            assert isinstance(denied, PermissionDeniedError)
            assert (denied.http_status, denied.code) == (403, "identity_not_allowed")
            assert "identity 'router' may not call" in denied.message

    with Client(auth=auth, security=pki.security()) as keyless:
        anonymous = _raised(lambda: list(keyless.keys.list()))
        assert isinstance(anonymous, UnauthenticatedError)
        assert (anonymous.http_status, anonymous.code) == (401, "invalid_api_key")


def test_a_method_the_address_does_not_serve(pki: Any, auth: str) -> None:
    """Inference pointed at auth: UNIMPLEMENTED (501) with gRPC's message, not a generic one."""
    with Client(inference=auth, security=pki.security()) as wrong:
        error = _raised(wrong.inference.models)
    assert isinstance(error, UnimplementedError)
    assert (error.http_status, error.code) == (501, "unimplemented")
    assert error.message  # gRPC's own text, kept


def test_a_missing_address_is_a_config_error(pki: Any) -> None:
    with Client(security=pki.security()) as nowhere:
        error = _raised(nowhere.deployments.get, "x")
    assert "no orchestrator address" in error.message
