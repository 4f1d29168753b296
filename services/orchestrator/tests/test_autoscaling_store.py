"""The autoscaler's decisions in the SQL store: written with the replicas change in one
transaction, listed newest first (one deployment or all), at most `DECISIONS_KEPT` kept per
deployment, deleted with their deployment."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from inferplane.orchestrator.autoscale.model import (
    DECISIONS_KEPT,
    SCALE_DOWN,
    SCALE_UP,
    ScaleDecision,
    Signals,
)
from inferplane.orchestrator.store.base import StateChange
from inferplane.orchestrator.store.sql import SqlStateStore

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def decision(deployment_id: str, n: int) -> ScaleDecision:
    return ScaleDecision(
        deployment_id=deployment_id,
        time=T0 + timedelta(seconds=n),
        decision=SCALE_UP if n % 2 else SCALE_DOWN,
        from_replicas=n,
        to_replicas=n + 1,
        reason=f"decision {n}",
        signals=Signals(queued_requests=n, kv_usage=0.5, idle_seconds=1.25, ready_replicas=n),
    )


def test_decisions_newest_first_bounded_per_deployment(tmp_path: Path) -> None:
    store = SqlStateStore(f"sqlite:///{tmp_path / 'o.db'}")
    store.create_schema()
    total = DECISIONS_KEPT + 5
    for n in range(total):
        store.commit(StateChange(add_decisions=(decision("a", n),)))
    store.commit(StateChange(add_decisions=(decision("b", 0), decision("b", 1))))
    kept = store.list_decisions("a", 1000)
    assert len(kept) == DECISIONS_KEPT
    assert [d.from_replicas for d in kept[:3]] == [total - 1, total - 2, total - 3]
    assert kept[0] == decision("a", total - 1)  # every field, signals included, round trips
    assert [d.deployment_id for d in store.list_decisions("", 3)] == ["b", "b", "a"]
    assert len(store.list_decisions("b", 50)) == 2
    store.commit(StateChange(delete_deployments=("a",)))
    assert store.list_decisions("a", 10) == ()
    store.close()
