"""A record's source: the `record_source` enum wins, the deprecated string is read otherwise."""

from __future__ import annotations

from inferplane.api.telemetry.v1 import telemetry_pb2 as pb
from inferplane.telemetry.ingest import record_source


def test_the_enum_wins_over_the_string() -> None:
    both = pb.RequestRecord(source="router", record_source=pb.RECORD_SOURCE_REPLICA)
    assert record_source(both) == "replica"
    assert record_source(pb.RequestRecord(record_source=pb.RECORD_SOURCE_ROUTER)) == "router"


def test_older_senders_are_read_by_their_string() -> None:
    """Unset enum: the string; an older replica's "node-agent" is the replica."""
    assert record_source(pb.RequestRecord(source="router")) == "router"
    assert record_source(pb.RequestRecord(source="node-agent")) == "replica"
    assert record_source(pb.RequestRecord(source="replica")) == "replica"
    assert record_source(pb.RequestRecord(source="batch-job")) == "batch-job"
    assert record_source(pb.RequestRecord()) == ""
