"""docs/sdk.md's examples run, as written, against real in-process servers under mutual TLS."""

from __future__ import annotations

import doctest
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from inferplane.auth.ledger import LedgerRow, SqlUsageLedger

DOC = Path(__file__).parents[3] / "docs" / "sdk.md"


def _ledger_rows(database: Path) -> None:
    """The usage rows the Usage section reads (as the routers would have reported them)."""
    ledger = SqlUsageLedger(f"sqlite:///{database}")
    end = datetime(2026, 11, 26, 9, 30, tzinfo=UTC)
    ledger.record(
        [
            LedgerRow(f"req-{n}", "k1", "ledger-demo", model, end + timedelta(minutes=n),
                      prompt_tokens=prompt, completion_tokens=completion)
            for n, model, prompt, completion in (
                (1, "kimi-tiny", 10, 5), (2, "kimi-tiny", 10, 5), (3, "embed-tiny", 8, 0)
            )
        ]
    )  # fmt: skip
    ledger.close()


def test_the_examples_run(pki: Any, auth: str, orchestrator: str, fx: Any, tmp_path: Path) -> None:
    fx.register_node(pki, orchestrator, name="gpu-a", gpus=2)
    _ledger_rows(tmp_path / "auth" / "auth.db")
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
