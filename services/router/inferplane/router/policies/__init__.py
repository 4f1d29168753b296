"""Routing policies, one per file behind `RoutingPolicy`; `default_registry` names them."""

from __future__ import annotations

from inferplane.router.policies.base import PolicyFactory, PolicyRegistry, RoutingPolicy
from inferplane.router.policies.least_load import LeastLoad
from inferplane.router.policies.prefix_affinity import PrefixAffinity
from inferplane.router.policies.round_robin import RoundRobin
from inferplane.router.policies.session_affinity import SessionAffinity


def default_registry(default: str = "least_load", load_factor: float = 1.25) -> PolicyRegistry:
    """The registry of the built-in policies (what the composition root uses).

    Raises:
        ConfigError: `default` is not one of them.
    """
    return PolicyRegistry(
        {
            "round_robin": RoundRobin,
            "least_load": LeastLoad,
            "prefix_affinity": lambda: PrefixAffinity(load_factor),
            "session_affinity": lambda: SessionAffinity(load_factor),
        },
        default,
    )


__all__ = [
    "LeastLoad",
    "PolicyFactory",
    "PolicyRegistry",
    "PrefixAffinity",
    "RoundRobin",
    "RoutingPolicy",
    "SessionAffinity",
    "default_registry",
]
