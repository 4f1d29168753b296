"""The one pepper of a local stack: made once in auth's data directory before auth starts (as
auth would make it), kept across restarts, and given to every router by path."""

from __future__ import annotations

import stat
from pathlib import Path

from inferplane.localstack._launch import ensure_auth_pepper


def test_the_pepper_is_made_once_private_and_kept(tmp_path: Path) -> None:
    auth_dir = tmp_path / "state" / "auth"
    path = ensure_auth_pepper(auth_dir)
    assert path == auth_dir / "auth-pepper"
    pepper = path.read_text()
    assert len(pepper.strip()) == 64 and pepper.endswith("\n")  # 32 random bytes in hex
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(auth_dir.stat().st_mode) == 0o700
    assert ensure_auth_pepper(auth_dir).read_text() == pepper  # a restarted stack keeps it
