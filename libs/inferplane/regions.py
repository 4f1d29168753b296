"""Regions: the names and rules that auth, the endpoint picker, the global tier's Envoy and the
tools share (issue 31; design and bounds in docs/regions.md).

A region is a cell: its own orchestrator leadership, routers, auth (with its copy of the key
table), telemetry, edge tier and nodes. A global tier of Envoy proxies sends each request to
the key's home region first, then down a configured fallback order.

The global tier has no database: it reads a key's home region from the key's secret. A secret
minted by a region's auth starts with `ip-<region>.` (the key may be served by any region)
or, for a key pinned to its region for data residency, `ip-<region>~` (never served
elsewhere: when that region is gone, the global tier answers 503 `region_unavailable`).
Neither `.` nor `~` occurs in the base64url part of a secret, and region names hold neither,
so a plain string prefix names the region. Secrets from before regions (`ip-` + base64url)
and operator-chosen bootstrap keys carry no region: the global tier treats them as homed in
its default region.
"""

from __future__ import annotations

import re
from typing import Final

#: A region's name: a lowercase letter, then up to 15 lowercase letters or digits
#: (`eu1`, `useast`). No `-`, `.` or `~`, so it can sit in a secret's prefix unambiguously.
REGION_NAME_RE: Final = re.compile(r"[a-z][a-z0-9]{0,15}")

SECRET_PREFIX: Final = "ip-"
"""Every secret auth mints starts with this (`inferplane.auth.domain` uses this constant)."""
HOME_SEPARATOR: Final = "."
"""After `ip-<region>`: the key is homed there and may fail over to other regions."""
PINNED_SEPARATOR: Final = "~"
"""After `ip-<region>`: the key is pinned to that region (data residency); never fails over."""

REGION_UNAVAILABLE: Final = "region_unavailable"
"""Error code of the global tier's 503 for a pinned key whose region has no healthy edge."""

REGION_READY_PATH: Final = "/inferplane/region/ready"
"""A region edge's health route for the global tier: 200 while the edge's picker cluster has
a healthy host, 503 otherwise (Envoy's health_check filter, never forwarded upstream)."""

KEY_REPLICATION_SECONDS: Final = 5.0
"""Bound on a key write (create, revoke, rotate, limit change) reaching every connected
region's routers; measured figures in docs/regions.md."""
BUDGET_SYNC_SECONDS: Final = 10.0
"""How often each region's auth reads the other regions' month totals for budgeted keys."""


def validate_region(name: str) -> str:
    """Returns `name` if it is a valid region name.

    Raises:
        ValueError: naming the rule (`REGION_NAME_RE`).
    """
    if REGION_NAME_RE.fullmatch(name) is None:
        raise ValueError(
            f"invalid region name {name!r}: a lowercase letter, then up to 15 lowercase "
            "letters or digits"
        )
    return name


def secret_prefix(region: str, *, pinned: bool) -> str:
    """The prefix of every secret minted in `region`: `ip-<region>.` or, pinned, `ip-<region>~`.

    Raises:
        ValueError: `region` is not a valid region name.
    """
    validate_region(region)
    return f"{SECRET_PREFIX}{region}{PINNED_SEPARATOR if pinned else HOME_SEPARATOR}"


def region_of_secret(secret: str) -> tuple[str, bool] | None:
    """`(home region, pinned)` read from a secret's prefix, or None for a secret with none."""
    if not secret.startswith(SECRET_PREFIX):
        return None
    rest = secret[len(SECRET_PREFIX) : len(SECRET_PREFIX) + 17]
    for index, char in enumerate(rest):
        if char in (HOME_SEPARATOR, PINNED_SEPARATOR):
            name = rest[:index]
            if REGION_NAME_RE.fullmatch(name) is None:
                return None
            return name, char == PINNED_SEPARATOR
    return None
