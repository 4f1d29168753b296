"""The canary split of live traffic between profile revisions (issue 30, "weighted canary").

During a canary the orchestrator publishes, on the deployment's routes, each serving revision's
percent of the sessions (`ModelRoute.revision_shares`, summing to 100). Per request the picker
first chooses a revision here, then its routing policy chooses among that revision's endpoints
(the others are excluded from the pick, `CanarySplit.choose`):

- **sticky**: the revision is a stable hash of the request's session — `x-session-id`, else
  the request's `user` (a Responses request's `prompt_cache_key`, an Anthropic request's
  `metadata.user_id`: `RequestFeatures.session`, as `session_affinity` uses), else the
  conversation's root (tools, system turns and the first user turn: `RequestFeatures.root`,
  the same for every turn of one conversation, as `prefix_affinity` uses); a request with
  none of these (an embedding without `user`) is split per request. The hash is salted with
  the deployment, so where a session falls is independent of the replica it hashes to;
- **weighted**: the 64-bit point is mapped onto the cumulative percents in the order the
  orchestrator lists them: a session stays on its revision while the shares are unchanged;
  with two revisions (stable and canary) each holds one end of the range, so when either's
  percent grows its interval only widens and the sessions it had keep it;
- **percents**: normalized by their sum (100 from the orchestrator); a revision listed at 0 %
  takes no session but is live (a fallback); shares summing to 0 are no split;
- **dark revisions**: an endpoint whose revision has no share takes no live traffic (a
  candidate under qualification: only operator requests pinned to it, `revision_pin`); it is
  also left out of the fallbacks Envoy may retry on;
- **fallback**: when the chosen revision has no endpoint that can take a request now (none,
  all draining, their breakers open, or all at their caps), the request goes to the other
  shared revision that can, rather than waiting or being refused
  (`inferplane_router_canary_fallbacks_total{deployment,revision}`, the revision that could
  not). When no live endpoint can take it, it waits in the deployment's queue for the first
  slot of any shared revision: a waiter restricted to one revision would hold the fair queue's
  head (and every request behind it) until that revision freed a slot. So the split is exact
  below saturation; at saturation each revision serves what its capacity frees (the
  orchestrator sizes the canary's replicas by its percent).

A route without shares is served as before: every non-draining endpoint, whatever its revision.
Cost: O(1) per request when the route has no shares; with shares, O(endpoints of the chosen
revision) to find one that can take a request (the exclusion sets are built once per routing table).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from inferplane.router.features import RequestFeatures, hash64
from inferplane.router.replicas import ReplicaKey, ReplicaSet
from inferplane.router.routes import Endpoint, ModelRoute

_POINTS = float(1 << 64)
# Plans kept per model name; past this many (names that left the table) they are rebuilt.
_MAX_PLANS = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class CanaryChoice:
    """One request's revision.

    Attributes:
        revision: the revision chosen for it; "" when every live endpoint was full or
            blocked (it takes the first slot of any shared revision).
        exclude: the endpoints its pick may not use (those of every other revision, and
            of revisions without a share).
        dark: the endpoints of revisions without a share (never a fallback either).
        fell_back: the hash chose `wanted`, which could take no request, and another shared
            revision could.
        wanted: the revision the session's hash chose.
    """

    revision: str
    exclude: frozenset[ReplicaKey]
    dark: frozenset[ReplicaKey]
    fell_back: bool = False
    wanted: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """A route's split, built once per route object (routing tables are immutable)."""

    revisions: tuple[str, ...]  # shared revisions, the orchestrator's order
    bounds: tuple[float, ...]  # cumulative upper bounds in [0, total]
    total: float
    members: dict[str, tuple[ReplicaKey, ...]]  # shared revision → its endpoints
    exclude: dict[str, frozenset[ReplicaKey]]  # shared revision → every endpoint but its own
    dark: frozenset[ReplicaKey]

    def share(self, revision: str) -> float:
        """The revision's percent of the sessions."""
        i = self.revisions.index(revision)
        return self.bounds[i] - (self.bounds[i - 1] if i else 0.0)


def _plan(route: ModelRoute) -> _Plan | None:
    # A revision listed at 0 % takes no session but is live (a fallback), not dark.
    revisions: list[str] = []
    bounds: list[float] = []
    total = 0.0
    for revision, _ in route.revision_shares:
        if revision in revisions:  # a repeated revision adds to its first place
            continue
        total += sum(p for r, p in route.revision_shares if r == revision)
        revisions.append(revision)
        bounds.append(total)
    if total <= 0:
        return None
    every = frozenset(e.key for e in route.endpoints)
    members = {r: tuple(e.key for e in route.endpoints if e.revision == r) for r in revisions}
    return _Plan(
        revisions=tuple(revisions),
        bounds=tuple(bounds),
        total=total,
        members=members,
        exclude={r: every.difference(keys) for r, keys in members.items()},
        dark=frozenset(e.key for e in route.endpoints if e.revision not in members),
    )


class CanarySplit:
    """Chooses each request's revision on routes with `revision_shares` (module docstring).

    `replicas(deployment)` returns admission's current `ReplicaSet` of a deployment (which
    endpoints can take a request now); `fallbacks`, a counter labelled (deployment, revision),
    counts the requests whose revision could take none (`RouterMetrics.canary_fallbacks`);
    `rng` draws the point of a request without a session.
    """

    def __init__(
        self,
        replicas: Callable[[str], ReplicaSet | None],
        *,
        fallbacks: Counter | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._replicas = replicas
        self._fallbacks = fallbacks
        self._rng = rng or random.Random()
        self._plans: dict[str, _Plan | None] = {}
        self._plan_routes: dict[str, ModelRoute] = {}

    def choose(self, route: ModelRoute, features: RequestFeatures) -> CanaryChoice | None:
        """The request's revision and the endpoints its pick may not use; None when `route`
        has no split (every endpoint serves, as without a canary)."""
        if not route.revision_shares:
            return None
        plan = self._plan(route)
        if plan is None:
            return None
        wanted = self.revision_of(plan, route.deployment_key, features)
        replicas = self._replicas(route.deployment_key)
        if replicas is None or _free(replicas, plan.members[wanted]):
            return self._choice(plan, wanted, wanted)
        others = sorted((r for r in plan.revisions if r != wanted), key=plan.share, reverse=True)
        spare = next((r for r in others if _free(replicas, plan.members[r])), None)
        if spare is not None:
            if self._fallbacks is not None:
                self._fallbacks.labels(route.deployment_key, wanted).inc()
            return self._choice(plan, spare, wanted)
        # Every live endpoint is full or blocked: the request waits for the first live slot
        # (waiting for its own revision's would stall the deployment's queue behind it).
        return CanaryChoice(revision="", exclude=plan.dark, dark=plan.dark, wanted=wanted)

    @staticmethod
    def _choice(plan: _Plan, revision: str, wanted: str) -> CanaryChoice:
        return CanaryChoice(
            revision=revision,
            exclude=plan.exclude[revision],
            dark=plan.dark,
            fell_back=revision != wanted,
            wanted=wanted,
        )

    def revision_of(self, plan: _Plan, deployment: str, features: RequestFeatures) -> str:
        """The revision the request's session hashes to (no usability check)."""
        point = _point(deployment, features)
        x = (self._rng.random() if point is None else point / _POINTS) * plan.total
        for revision, bound in zip(plan.revisions, plan.bounds, strict=True):
            if x < bound:
                return revision
        return plan.revisions[plan.bounds.index(plan.total)]  # x == total (rounding)

    def _plan(self, route: ModelRoute) -> _Plan | None:
        # One plan per route object: a new table brings new route objects (identity check).
        if self._plan_routes.get(route.model) is not route:
            if len(self._plan_routes) >= _MAX_PLANS:
                self._plan_routes.clear()
                self._plans.clear()
            self._plan_routes[route.model] = route
            self._plans[route.model] = _plan(route)
        return self._plans[route.model]


def _point(deployment: str, features: RequestFeatures) -> int | None:
    """The request's 64-bit point on the split, None without a session signal."""
    key = features.session if features.session is not None else features.root
    if key is None:
        return None
    return hash64(b"canary\x1f" + deployment.encode() + b"\x1f" + key.to_bytes(8, "big"))


def _free(replicas: ReplicaSet, keys: Sequence[ReplicaKey]) -> bool:
    """Whether one of `keys` can take a request now (usable and under its cap)."""
    index, can_take = replicas.index, replicas.can_take
    return any((i := index.get(k)) is not None and can_take(i) for k in keys)


def order_fallbacks(
    fallbacks: Sequence[Endpoint], choice: CanaryChoice, n: int
) -> tuple[Endpoint, ...]:
    """Envoy's fallbacks during a canary: never a dark revision's endpoint; the chosen
    revision's first (the policy's order kept within each group), then the other shared
    revision's; at most `n`."""
    live = [e for e in fallbacks if e.key not in choice.dark]
    live.sort(key=lambda e: e.revision != choice.revision)  # stable: policy order kept
    return tuple(live[:n])
