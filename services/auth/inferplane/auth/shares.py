"""Per-key rate limits global across regions (issue 31; docs/regions.md): `RegionShares`, this
region's share of every key's requests per minute, tokens per minute and concurrent requests.

Each region's routers enforce what their region's key table entries carry (and split it among
themselves: `inferplane.router.keylimits`). With peers, an entry of a key with a rate limit
carries this region's share of it in `KeyEntry.limits` and the key's own limits in
`KeyEntry.key_limits` (`key_entries.key_entries`), so the regions together admit the limit
rather than regions × limit. Shares follow each region's recent demand:

- **Demand**: the requests, and their tokens, of each key whose ledger rows ended in the last
  `DEMAND_WINDOW_SECONDS` (60 s, one rate window; `SqlUsageLedger.recent_demand`), this region's
  own read every `budget_sync_seconds` and each peer's from its `RegionMonthTokens` answer on
  the same cadence. Requests per minute and concurrency are split by requests, tokens per
  minute by tokens. Demand is what was served: a request a router refused is not in a ledger.
- **Split** (`split`, every reachable region computes the same function of the same figures):
  the regions with demand share the limit: each gets the floor `max(1, limit × 5 %)`
  (`FLOOR_PERCENT`), the rest goes in proportion to demand, rounded by largest remainder (ties
  by region name), so their shares sum to the limit. A region without demand gets the floor,
  outside the limit, so a client that moves there is admitted at once (its demand shows at the
  next sync and the limit is re-split). With no demand anywhere the key's home region (the
  first reachable region by name when the home is out of reach) gets the whole limit. A limit
  below the number of regions with demand gives each of them 1.
- **Cuts**: a peer from which nothing arrived (its key table watch heartbeats every second)
  for `cut_seconds` (2 × `budget_sync_seconds`) is left out of the split: the reachable
  regions take its share back, and a region that sees no peer enforces the whole limit (the
  entries carry the key's own limits, as without regions).

Bounds (per window, or in flight for concurrency): connected, the regions admit at most the
limit plus the floor of each region without demand; while shares move (a sync), each region
admits under its share of the moment, so a window may see up to the sum of each region's
largest share in it. Cut off from each other, each side admits its own split: at most
regions × limit in the worst case (each region alone), only while the regions cannot see each
other and each still serves the key's clients.

Reads (`limits_for`) are safe off the event loop: the state is replaced whole, never changed in
place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from inferplane.api.auth.v1 import auth_pb2

#: The window of recent demand the shares follow (seconds: one rate window).
DEMAND_WINDOW_SECONDS: Final = 60.0
#: A region's share is at least this percent of the limit (and at least 1).
FLOOR_PERCENT: Final = 5

#: One region's (requests per minute, tokens per minute, concurrent requests) share.
Limits3 = tuple[int, int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class Demand:
    """One key's recent demand in one region: requests and their prompt + completion tokens."""

    requests: int = 0
    tokens: int = 0


def floor_of(limit: int) -> int:
    """The least share of `limit` a region gets: max(1, limit × FLOOR_PERCENT / 100)."""
    return max(1, limit * FLOOR_PERCENT // 100)


def split(limit: int, demand: Mapping[str, int], owner: str) -> dict[str, int]:
    """Every region's share of `limit` (module docstring).

    Args:
        limit: the key's limit (> 0).
        demand: every reachable region (this one included) -> its recent demand (>= 0).
        owner: the region that gets the whole limit when no region has demand (must be a key
            of `demand`).

    Returns:
        region -> share (>= 1): the regions with demand sum to `limit` (or 1 each when the
        limit is below their number); each other region has the floor.
    """
    floor = floor_of(limit)
    shares = dict.fromkeys(demand, floor)
    active = sorted(r for r, d in demand.items() if d > 0)
    weights = {r: demand[r] for r in active}
    if not active:
        active, weights = [owner], {owner: 1}
    if len(active) * floor > limit:
        base, extra = divmod(limit, len(active))
        for i, r in enumerate(active):
            shares[r] = max(1, base + (1 if i < extra else 0))
        return shares
    rest = limit - len(active) * floor
    total = sum(weights.values())
    parts = {r: rest * weights[r] // total for r in active}
    left = rest - sum(parts.values())
    # Largest remainder first; ties by region name.
    order = sorted(active, key=lambda r: (-(rest * weights[r] % total), r))
    for r in order[:left]:
        parts[r] += 1
    for r in active:
        shares[r] = floor + parts[r]
    return shares


class _RateLimits(Protocol):
    @property
    def requests_per_minute(self) -> int: ...
    @property
    def tokens_per_minute(self) -> int: ...
    @property
    def max_concurrent_requests(self) -> int: ...


def has_rate_limits(limits: _RateLimits | auth_pb2.Limits) -> bool:
    """Whether a key has a limit the regions split (requests, tokens, concurrency), in its
    stored limits (`domain.Limits`) or an entry's."""
    return bool(
        limits.requests_per_minute or limits.tokens_per_minute or limits.max_concurrent_requests
    )


class ShareMetrics:
    """`inferplane_auth_region_share_updates_total` (the split's inputs changed: demand or the
    peers counted) and `inferplane_auth_region_share_peers{state=counted|cut}` (peers in the
    split and left out of it). Per-key shares are not metrics (one series per key): a key's
    entry in the key table says it (`limits`, `key_limits`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.updates = Counter(
            "inferplane_auth_region_share_updates",
            "Times this region's shares of the keys' rate limits were computed again "
            "(demand or the reachable peers changed).",
            registry=registry,
        )
        self.peers = Gauge(
            "inferplane_auth_region_share_peers",
            "Peer regions counted in the split of the keys' rate limits (counted) or left out "
            "of it, unreachable for longer than the cut time (cut).",
            ["state"],
            registry=registry,
        )
        for state in ("counted", "cut"):
            self.peers.labels(state)


@dataclasses.dataclass(frozen=True, slots=True)
class _State:
    reachable: tuple[str, ...]  # this region first, then the reachable peers
    demand: Mapping[str, Mapping[str, Demand]]  # region -> key id -> demand


class RegionShares:
    """This region's share of each key's rate limits (module docstring).

    Args:
        region: this region's name.
        metrics: where `update` counts (None: not counted).
    """

    def __init__(self, region: str, metrics: ShareMetrics | None = None) -> None:
        self.region = region
        self._metrics = metrics
        self._state = _State((region,), {})
        self.version = 0

    @property
    def reachable(self) -> tuple[str, ...]:
        """The regions in the split: this one, then the peers counted (by name)."""
        return self._state.reachable

    def update(
        self,
        local: Mapping[str, Demand],
        remote: Mapping[str, Mapping[str, Demand]],
        reachable: Iterable[str],
        peers: Collection[str] = (),
    ) -> bool:
        """Replaces the split's inputs: this region's demand, each peer's last reported one,
        the peers counted (`reachable`; `peers`: all of them, for the cut gauge). True (and
        `version` increases) when they changed."""
        counted = tuple(sorted(set(reachable) - {self.region}))
        demand: dict[str, Mapping[str, Demand]] = {self.region: dict(local)}
        for name in counted:
            demand[name] = dict(remote.get(name, {}))
        state = _State((self.region, *counted), demand)
        if self._metrics is not None:
            self._metrics.peers.labels("counted").set(len(counted))
            self._metrics.peers.labels("cut").set(len(set(peers) - set(counted)))
        if state == self._state:
            return False
        self._state = state
        self.version += 1
        if self._metrics is not None:
            self._metrics.updates.inc()
        return True

    def shares_of(self, key_id: str, home: str, limits: auth_pb2.Limits) -> dict[str, Limits3]:
        """Every reachable region's share of `limits` (requests, tokens, concurrency; 0 where
        the key has no such limit)."""
        state = self._state
        owner = home if home in state.demand else min(state.reachable)
        demands = {r: d.get(key_id, Demand()) for r, d in state.demand.items()}
        by_requests = {r: d.requests for r, d in demands.items()}
        by_tokens = {r: d.tokens for r, d in demands.items()}
        zero = dict.fromkeys(demands, 0)
        rpm = limits.requests_per_minute
        tpm = limits.tokens_per_minute
        conc = limits.max_concurrent_requests
        rpm_s = split(rpm, by_requests, owner) if rpm else zero
        tpm_s = split(tpm, by_tokens, owner) if tpm else zero
        conc_s = split(conc, by_requests, owner) if conc else zero
        return {r: (rpm_s[r], tpm_s[r], conc_s[r]) for r in demands}

    def limits_for(self, key_id: str, home: str, limits: auth_pb2.Limits) -> auth_pb2.Limits | None:
        """This region's share of `limits` (the monthly budget unchanged), or None when the
        entry carries the key's own limits: no rate limit, no peer reachable, or a share equal
        to the whole limit."""
        state = self._state
        if len(state.reachable) < 2 or not has_rate_limits(limits):
            return None
        if not any(key_id in d for d in state.demand.values()):
            # No demand anywhere (most keys): the owner's whole limit, or the floor.
            owner = home if home in state.demand else min(state.reachable)
            if owner == self.region:
                return None
            rpm, tpm, conc = (
                floor_of(limit) if limit else 0
                for limit in (
                    limits.requests_per_minute,
                    limits.tokens_per_minute,
                    limits.max_concurrent_requests,
                )
            )
        else:
            rpm, tpm, conc = self.shares_of(key_id, home, limits)[self.region]
        own = (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent_requests)
        if (rpm, tpm, conc) == own:
            return None
        return auth_pb2.Limits(
            requests_per_minute=rpm,
            tokens_per_minute=tpm,
            max_concurrent_requests=conc,
            monthly_token_budget=limits.monthly_token_budget,
        )
