"""The picker's list of sibling replicas for mid-stream migration (`headers.SIBLINGS`).

The endpoint picker picks an ordered list of replicas from the routing table (primary first,
then the fallbacks Envoy may retry on). It also hands that list to the replica that serves
the request, so that a replica whose engine dies after the first byte can move the stream to
another replica of the same profile revision (`inferplane.replica.engines.migration`).

Wire format: comma-separated entries `replica_id|revision|host:port` (a replica id and a
revision never hold `|` or `,`: they are DNS-label-like names). Unreadable entries are skipped:
the header is a hint, never a reason to fail a request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

MAX_SIBLINGS = 8
"""Entries read at most (the picker lists a few fallbacks; a longer header is cut)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sibling:
    """A replica of the pick: its id, its profile revision ("" unknown) and its gRPC address
    (`host:port`, the address Envoy dials)."""

    replica_id: str
    revision: str
    address: str


def encode_siblings(siblings: Iterable[Sibling]) -> str:
    """The header value (entries with a field holding `|` or `,` are left out)."""
    entries = []
    for sibling in siblings:
        fields = (sibling.replica_id, sibling.revision, sibling.address)
        if sibling.address and not any("|" in f or "," in f for f in fields):
            entries.append("|".join(fields))
    return ",".join(entries)


def decode_siblings(value: str) -> tuple[Sibling, ...]:
    """The siblings a header value names, in order (at most `MAX_SIBLINGS`; unreadable
    entries skipped)."""
    found: list[Sibling] = []
    for entry in value.split(","):
        parts = entry.strip().split("|")
        if len(parts) != 3 or not parts[2]:
            continue
        found.append(Sibling(replica_id=parts[0], revision=parts[1], address=parts[2]))
        if len(found) == MAX_SIBLINGS:
            break
    return tuple(found)
