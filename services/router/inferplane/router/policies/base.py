"""The one interface every routing policy implements, and the registry that names them.

A policy picks ONE replica index from a `ReplicaSet` (per deployment, per table version) for
a request's `RequestFeatures`, or None when no replica can take it now (the request then waits
in the deployment's admission queue). Policies never block and never do I/O, and never scan
every replica: a decision must stay under 50 µs (p99) at 10,000 replicas
(bench/router_decision.py); use the set's indexes (`least_loaded`, `next_free`, the ring).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from inferplane.router.features import RequestFeatures
from inferplane.router.replicas import ReplicaSet
from inferplane.runtime import ConfigError


class RoutingPolicy(Protocol):
    """Chooses a replica. One instance per deployment (state such as a round-robin cursor or
    a prefix table lives as long as the deployment, across routing-table versions)."""

    def choose(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        """Index into `replicas` of a replica that can take the request now, or None.

        Only indices with `replicas.can_take(i)` may be returned.
        """
        ...

    def fallbacks(
        self, replicas: ReplicaSet, request: RequestFeatures, chosen: int | None, n: int
    ) -> list[int]:
        """Up to `n` other replica indices, best first, for Envoy to try when `chosen` fails
        before answering (the endpoint picker's list). Must not change the policy's state:
        the request goes to `chosen`. Use `ReplicaSet.fallbacks` to filter."""
        ...


PolicyFactory = Callable[[], RoutingPolicy]


class PolicyRegistry:
    """Routing policies by name; built once in the composition root.

    Raises (from `create`):
        ConfigError: an unknown name, listing the known ones.
    """

    def __init__(self, factories: Mapping[str, PolicyFactory], default: str) -> None:
        self._factories = dict(factories)
        self.default = default
        self.create(default)  # fail at start-up, not on the first request

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._factories))

    def create(self, name: str) -> RoutingPolicy:
        """A new instance of the policy `name` ("" = the default)."""
        factory = self._factories.get(name or self.default)
        if factory is None:
            raise ConfigError(
                f"unknown routing policy {name!r}; known policies: {', '.join(self.names)}"
            )
        return factory()
