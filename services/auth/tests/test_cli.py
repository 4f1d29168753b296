"""`inferplane keys` (the typer app in inferplane.auth.cli) against a running auth service."""

from __future__ import annotations

import re
from typing import Any

from typer.testing import CliRunner

from inferplane.auth.cli import app

runner = CliRunner()


def keys(auth: Any, *args: str, admin_key: str | None = None) -> Any:
    env = {
        "INFERPLANE_ADMIN_KEY": auth.admin_key if admin_key is None else admin_key,
        "COLUMNS": "200",  # a wide terminal: rich folds cells at the default 80
        "INFERPLANE_PLAINTEXT": "1",  # the test service runs plaintext
    }
    return runner.invoke(
        app, [*args, "--address", f"127.0.0.1:{auth.server.port}"], env=env, catch_exceptions=False
    )


def test_create_list_rotate_revoke(auth: Any) -> None:
    created = keys(
        auth, "create", "--name", "ci", "--tenant", "acme", "--model", "kimi-tiny", "--rpm", "5"
    )
    assert created.exit_code == 0, created.output
    [secret] = re.findall(r"^(ip-[A-Za-z0-9_-]{43})$", created.output, re.M)
    [key_id] = re.findall(r"of api-keys/([0-9a-f]{16}) \(shown once", created.output)
    assert "shown once" in created.output
    assert auth.check(secret).status.code == 0

    listed = keys(auth, "list", "--tenant", "acme")
    assert listed.exit_code == 0 and key_id in listed.output and "kimi-tiny" in listed.output
    assert secret not in listed.output

    rotated = keys(auth, "rotate", key_id, "--grace-seconds", "60")
    assert rotated.exit_code == 0, rotated.output
    [new_secret] = re.findall(r"^(ip-[A-Za-z0-9_-]{43})$", rotated.output, re.M)
    assert new_secret != secret and auth.check(new_secret).status.code == 0

    revoked = keys(auth, "revoke", f"api-keys/{key_id}")
    assert revoked.exit_code == 0 and "revoked" in revoked.output
    assert auth.check(new_secret).denied_response.status.code == 401
    assert key_id not in keys(auth, "list").output
    assert key_id in keys(auth, "list", "--all").output


def test_errors_are_one_line_and_exit_non_zero(auth: Any) -> None:
    missing = keys(auth, "list", admin_key="")
    assert missing.exit_code == 2 and "INFERPLANE_ADMIN_KEY" in missing.output
    denied = keys(auth, "list", admin_key="ip-" + "n" * 43)
    assert denied.exit_code == 1 and "UNAUTHENTICATED" in denied.output
    unknown = keys(auth, "revoke", "0123456789abcdef")
    assert unknown.exit_code == 1 and "NOT_FOUND" in unknown.output
