"""Files only their owner may read (mode 0600), whatever the umask: every log file the platform
writes and every secret it hands to the operator (issue 18: a log line can carry a token, a
prompt or a key prefix, and a world-readable file gives them to every local user).

`os.open(..., 0o600)` alone is not enough: the mode applies only when the file is created, so a
log file left 0644 by an older run (or another tool) keeps its mode; `fchmod` tightens it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

PRIVATE_MODE = 0o600


def open_private_log(path: Path) -> BinaryIO:
    """`path` opened for appending bytes (created if missing, parent folders too), mode 0600.

    Hand it to `subprocess.Popen(stdout=...)` and close it after the child started.

    Raises:
        OSError: the file cannot be opened, or its mode cannot be changed (another owner).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def write_private_file(path: Path, text: str) -> None:
    """Replaces the contents of `path` with `text` (UTF-8), mode 0600; parent folders created.

    Raises:
        OSError: as `open_private_log`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
