"""The first admin key: from the environment, or generated once and handed to the operator."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

from inferplane.api.auth.v1 import auth_pb2
from inferplane.auth.app import build_components
from inferplane.auth.settings import AuthSettings, load_auth_settings
from inferplane.runtime import ConfigError

ENV_KEY = "operator-chosen-admin-key-" + "7" * 20


def admin_keys(auth: Any, secret: str) -> list[auth_pb2.ApiKey]:
    resp = auth.keys.ListApiKeys(
        auth_pb2.ListApiKeysRequest(tenant="system", show_inactive=True),
        metadata=(("authorization", f"Bearer {secret}"),),
        timeout=5,
    )
    return list(resp.api_keys)


def test_settings_read_the_bootstrap_env_variable(tmp_path: Path) -> None:
    settings = load_auth_settings(
        ["--data-dir", str(tmp_path), "--plaintext"],
        environ={"INFERPLANE_BOOTSTRAP_ADMIN_KEY": ENV_KEY},
    )
    assert settings.bootstrap_admin_key == ENV_KEY
    assert ENV_KEY not in repr(settings)
    explicit = load_auth_settings(
        ["--plaintext"],
        environ={"INFERPLANE_BOOTSTRAP_ADMIN_KEY": ENV_KEY, "INFERPLANE_AUTH_PORT": "6000"},
    )
    assert explicit.port == 6000


def test_env_key_is_stored_once_across_restarts(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    settings = make_settings(tmp_path, bootstrap_admin_key=ENV_KEY)
    for _restart in range(2):
        with start_auth(settings) as auth:
            [key] = admin_keys(auth, ENV_KEY)
            assert list(key.scopes) == ["admin"] and key.display_name == "bootstrap admin"
            assert auth.check(ENV_KEY, path="/v1/admin/api-keys").status.code == 0
    assert not (tmp_path / "bootstrap-admin-key").exists()


def test_generated_key_is_written_0600_and_only_its_path_is_logged(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    """Invariant (issue 18): the generated admin secret reaches the operator through a file
    only they can read; the log says where it is and never holds the secret itself."""
    settings = make_settings(tmp_path, bootstrap_admin_key="")
    with structlog.testing.capture_logs() as logs, start_auth(settings) as auth:
        path = tmp_path / "bootstrap-admin-key"
        secret = path.read_text().strip()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        [key] = admin_keys(auth, secret)
        assert key.key_prefix == secret[:8]
    lines = [e for e in logs if e["event"] == "bootstrap_admin_key_generated"]
    assert len(lines) == 1 and lines[0]["file"] == str(path)
    assert secret not in repr(logs)

    with structlog.testing.capture_logs() as logs, start_auth(settings) as auth:
        assert path.read_text().strip() == secret  # an admin exists: nothing new
        assert len(admin_keys(auth, secret)) == 1
    assert not [e for e in logs if e["event"] == "bootstrap_admin_key_generated"]


def test_revoking_every_admin_lets_a_restart_generate_a_new_one(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    settings = make_settings(tmp_path, bootstrap_admin_key="")
    with start_auth(settings) as auth:
        first = (tmp_path / "bootstrap-admin-key").read_text().strip()
        [key] = admin_keys(auth, first)
        auth.keys.RevokeApiKey(
            auth_pb2.RevokeApiKeyRequest(name=key.name),
            metadata=(("authorization", f"Bearer {first}"),),
        )
        with pytest.raises(grpc.RpcError):
            admin_keys(auth, first)
    with start_auth(settings) as auth:
        second = (tmp_path / "bootstrap-admin-key").read_text().strip()
        assert second != first
        assert len(admin_keys(auth, second)) == 2


def test_a_weak_env_key_is_refused_at_start(tmp_path: Path, make_settings: Any) -> None:
    components = build_components(make_settings(tmp_path, bootstrap_admin_key="too-short"))
    with pytest.raises(ConfigError, match="32-512 characters"):
        asyncio.run(components.start())
    asyncio.run(components.stop())


def test_pepper_is_generated_once_0600_and_required_to_verify(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    settings: AuthSettings = make_settings(tmp_path)
    with start_auth(settings) as auth:
        secret = auth.keys.CreateApiKey(
            auth_pb2.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(tenant="t")),
            metadata=auth.admin_md(),
        ).secret
    pepper_file = tmp_path / "auth-pepper"
    assert stat.S_IMODE(pepper_file.stat().st_mode) == 0o600
    with start_auth(settings) as auth:
        assert auth.check(secret).status.code == 0  # same pepper after a restart
    pepper_file.write_text("another-pepper-of-enough-length\n")
    with start_auth(settings) as auth:
        assert auth.check(secret).denied_response.status.code == 401
