"""docs/sdk.md's examples run, as written, against real in-process servers under mutual TLS."""

from __future__ import annotations

import doctest
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

DOC = Path(__file__).parents[3] / "docs" / "sdk.md"


def test_the_examples_run(pki: Any, auth: str, orchestrator: str, fx: Any) -> None:
    fx.register_node(pki, orchestrator, name="gpu-a", gpus=2)
    with fx.running_replica(pki) as replica:
        globs = {
            "auth_address": auth,
            "orchestrator_address": orchestrator,
            "replica_address": replica.address,
            "security": pki.security(),
            "admin_key": fx.admin_key,
        }
        with capture_logs():  # the servers' log lines would land in the examples' output
            result = doctest.testfile(
                str(DOC),
                module_relative=False,
                globs=globs,
                optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                raise_on_error=False,
                verbose=False,
            )
    assert result.attempted > 40
    assert result.failed == 0, f"{result.failed} of {DOC.name}'s examples failed (output above)"
