"""Routing policies, one per file behind `RoutingPolicy`; `default_registry` names them."""

from __future__ import annotations

from inferplane.router.engine_state import EngineStates
from inferplane.router.kvindex import KvIndex
from inferplane.router.policies.base import PolicyFactory, PolicyRegistry, RoutingPolicy
from inferplane.router.policies.least_load import LeastLoad
from inferplane.router.policies.power_of_two import PowerOfTwo
from inferplane.router.policies.precise_prefix import PrecisePrefix
from inferplane.router.policies.prefix_affinity import PrefixAffinity
from inferplane.router.policies.round_robin import RoundRobin
from inferplane.router.policies.session_affinity import SessionAffinity


def default_registry(
    default: str = "least_load",
    load_factor: float = 1.25,
    *,
    engine_states: EngineStates | None = None,
    kv_index: KvIndex | None = None,
) -> PolicyRegistry:
    """The registry of the built-in policies (what the composition root uses).

    `engine_states` / `kv_index`: what `precise_prefix` reads (the replica state watch fills
    them); without them it always falls back to the approximate table.

    Raises:
        ConfigError: `default` is not one of them.
    """
    return PolicyRegistry(
        {
            "round_robin": RoundRobin,
            "least_load": LeastLoad,
            "power_of_two": PowerOfTwo,
            "prefix_affinity": lambda: PrefixAffinity(load_factor),
            "precise_prefix": lambda: PrecisePrefix(engine_states, kv_index, load_factor),
            "session_affinity": lambda: SessionAffinity(load_factor),
        },
        default,
    )


__all__ = [
    "LeastLoad",
    "PolicyFactory",
    "PolicyRegistry",
    "PowerOfTwo",
    "PrecisePrefix",
    "PrefixAffinity",
    "RoundRobin",
    "RoutingPolicy",
    "SessionAffinity",
    "default_registry",
]
