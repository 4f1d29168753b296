"""Placement policies by name. The composition root builds the registry and picks one."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from inferplane.orchestrator.placement.best_fit import BestFitSpreadPolicy
from inferplane.orchestrator.placement.model import PlacementPolicy
from inferplane.runtime import ConfigError

PolicyFactory = Callable[[], PlacementPolicy]


def default_policies() -> dict[str, PolicyFactory]:
    """The policies inferplane ships, by name (one file each under `placement/`)."""
    return {BestFitSpreadPolicy.name: BestFitSpreadPolicy}


def build_policy(name: str, policies: Mapping[str, PolicyFactory]) -> PlacementPolicy:
    """The policy called `name`.

    Raises:
        ConfigError: unknown name; the message lists the known ones.
    """
    factory = policies.get(name)
    if factory is None:
        known = ", ".join(sorted(policies))
        raise ConfigError(f"unknown placement policy {name!r}; known: {known}")
    return factory()
