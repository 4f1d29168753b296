"""Log and secret files readable by their owner only, whatever the umask (issue 18)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferplane.runtime.security.private_files import open_private_log, write_private_file


@pytest.fixture
def open_umask() -> Iterator[None]:
    previous = os.umask(0o000)  # the worst case: files would be created 0666
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_log_is_0600_and_a_child_appends_to_it(tmp_path: Path, open_umask: None) -> None:
    """Invariant: a child's output lands in a log file only its owner can read, after what the
    file held already."""
    path = tmp_path / "logs" / "service.log"
    with open_private_log(path) as log:
        log.write(b"first\n")
    with open_private_log(path) as log:
        subprocess.run([sys.executable, "-c", "print('child')"], stdout=log, check=True)
    assert mode(path) == 0o600
    assert path.read_text() == "first\nchild\n"


def test_an_existing_world_readable_log_is_tightened(tmp_path: Path) -> None:
    """Invariant: a log file left 0644 by an older run becomes 0600 when it is next opened."""
    path = tmp_path / "replica.log"
    path.write_text("old\n")
    path.chmod(0o644)
    with open_private_log(path) as log:
        log.write(b"new\n")
    assert mode(path) == 0o600
    assert path.read_text() == "old\nnew\n"


def test_a_private_file_is_replaced_whole_and_0600(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "auth" / "bootstrap-admin-key"
    write_private_file(path, "a-long-first-secret\n")
    path.chmod(0o644)
    write_private_file(path, "second\n")
    assert mode(path) == 0o600
    assert path.read_text() == "second\n"
