"""The routing table: which replicas serve which model (domain, no gRPC)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from inferplane.routing_client import DEFAULT_COLD_START_BUDGET_SECONDS
from inferplane.runtime import ConfigError, NotFoundError, PermissionDeniedError
from inferplane.wire import headers


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """One replica: the node-agent address serving it (host:port) and its replica id.

    `max_concurrency` caps the requests all routers send it at once (0: the router's
    `default_max_concurrency` setting); `share`, when the table is the orchestrator's view for
    this router (`RouteTable.lease_epoch`), is this router's part of that cap (the parts of all
    routers sum to at most the cap; issue 20), None otherwise; `node` names its host, for logs;
    `revision` is the profile revision its replica runs ("" when unknown: a static table, or
    an older orchestrator), which the canary split and revision pinning choose by (issue 30).
    """

    address: str
    replica_id: str = ""
    draining: bool = False
    weight: float = 1.0
    max_concurrency: int = 0
    node: str = ""
    share: int | None = None
    revision: str = ""

    def cap(self, default: int) -> int:
        """The requests this router may have in flight to it at once: its share when the
        caps are shared, else `max_concurrency`, else `default` (0: unbounded)."""
        if self.share is not None:
            return self.share
        return self.max_concurrency or default or 1 << 30

    @property
    def key(self) -> tuple[str, str]:
        """The replica's identity: (address, replica_id); stable across table versions."""
        return (self.address, self.replica_id)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRoute:
    """The replicas serving one model name (a deployment id or alias).

    `routing_policy` names the policy in the router's registry ("" = the router's default).
    `tokenizer`: the deployment's tokenizer folder (its `model_source`), which the router
    tokenizes prompts with for `precise_prefix` (`router.tokenize`); "" = never tokenized.
    `scale_to_zero`: the deployment may have no replica; a request then waits in its queue up
    to `cold_start_budget` seconds while one starts (`Admission`), instead of an immediate 503.
    `adapter` / `adapter_source`: set on a LoRA adapter's route (`{deployment}:{adapter}` or an
    alias; issue 29): the adapter's catalogue name and source folder, which the picker sends
    the replica (`inferplane.wire.headers.ADAPTER`, `ADAPTER_SOURCE`); `deployment` is the
    base deployment, whose replicas, queue and policy the adapter shares.
    `revision_shares`: during a canary, each serving profile revision and its percent of the
    sessions (summing to 100; `router.canary`); () = no split, every endpoint takes traffic.
    """

    model: str
    endpoints: tuple[Endpoint, ...]
    deployment: str = ""
    owned_by: str = "inferplane"
    created: int = 0
    max_model_len: int = 0
    routing_policy: str = ""
    tokenizer: str = ""
    scale_to_zero: bool = False
    cold_start_budget_seconds: float = 0.0
    adapter: str = ""
    adapter_source: str = ""
    revision_shares: tuple[tuple[str, int], ...] = ()

    @property
    def deployment_key(self) -> str:
        """The deployment (aliases of one deployment share replicas, counters and queue)."""
        return self.deployment or self.model

    @property
    def cold_start_budget(self) -> float:
        """How long a request for this deployment at zero is held, seconds
        (`cold_start_budget_seconds`, else `DEFAULT_COLD_START_BUDGET_SECONDS`)."""
        return self.cold_start_budget_seconds or DEFAULT_COLD_START_BUDGET_SECONDS


@dataclasses.dataclass(frozen=True, slots=True)
class RouteTable:
    """An immutable snapshot; the router swaps whole tables, never edits one in place.

    `lease_epoch` is set when the endpoints carry this router's shares of the caps: the router
    admits on them only while it holds a lease of that epoch (`leases.CapLease`).
    `router_count` / `router_rank`: how many routers split each API key's limits and this
    one's rank (`keylimits.KeyLimiter.set_routers`); 0 / 0 when not shared (the whole limit).
    """

    routes: Mapping[str, ModelRoute]
    version: str = ""
    lease_epoch: str = ""
    router_count: int = 0
    router_rank: int = 0

    @classmethod
    def of(
        cls,
        routes: Iterable[ModelRoute],
        version: str = "",
        lease_epoch: str = "",
        *,
        router_count: int = 0,
        router_rank: int = 0,
    ) -> RouteTable:
        return cls({r.model: r for r in routes}, version, lease_epoch, router_count, router_rank)

    def shares(self) -> dict[tuple[str, str], int] | None:
        """This router's share per replica key (a replica without a cap has none), None when
        the caps are not shared."""
        if not self.lease_epoch:
            return None
        routes = self.routes.values()
        return {e.key: e.share for r in routes for e in r.endpoints if e.share is not None}

    def get(self, model: str) -> ModelRoute | None:
        return self.routes.get(model)

    def models(self) -> Sequence[ModelRoute]:
        return sorted(self.routes.values(), key=lambda r: r.model)


def resolve(table: RouteTable, model: str, metadata: Mapping[str, str]) -> ModelRoute:
    """The route of `model` for a request whose ext_authz metadata is `metadata`.

    `x-inferplane-allowed-models` (comma-separated; absent or empty = any model) is the API
    key's allow-list, checked so that a key never learns which models exist (a name it may
    not use is a 403 whether it exists or not). A grant names what is served, not a
    spelling: listing any name of a deployment (its id or an alias) allows all of them, and
    listing any name of a LoRA adapter (`{deployment}:{adapter}` or an alias) allows all of
    the adapter's. A deployment and its adapters are distinct: allowing `kimi-tiny` does not
    allow `kimi-tiny:pirate`, nor the reverse (issue 29).

    Raises:
        PermissionDeniedError: the key may not use `model` (HTTP 403, code model_not_allowed).
        NotFoundError: no route serves `model` (HTTP 404, code model_not_found).
    """
    allowed = metadata.get(headers.ALLOWED_MODELS, "")
    if allowed and not _granted(table, model, allowed):
        raise PermissionDeniedError(
            f"this API key may not use the model '{model}'",
            code="model_not_allowed",
            param="model",
        )
    route = table.get(model)
    if route is None:
        raise NotFoundError(
            f"The model '{model}' does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )
    return route


def _granted(table: RouteTable, model: str, allowed: str) -> bool:
    """Whether the allow-list `allowed` grants `model`: listed as sent, or it routes to the
    same deployment and adapter as a listed name (`resolve`). O(names listed)."""
    names = [m.strip() for m in allowed.split(",")]
    if model in names:
        return True
    route = table.get(model)
    if route is None:
        return False
    served = (route.deployment_key, route.adapter)
    for name in names:
        other = table.get(name)
        if other is not None and (other.deployment_key, other.adapter) == served:
            return True
    return False


def load_routes_file(path: str | Path) -> RouteTable:
    """Reads the static routing table (format in `RouterSettings`).

    Raises:
        ConfigError: the file is missing or malformed.
    """
    try:
        data: Any = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read routes file {path}: {exc}") from exc
    routes = []
    for entry in data.get("models", []):
        if "model" not in entry or not (entry.get("endpoints") or entry.get("scale_to_zero")):
            raise ConfigError(
                f"{path}: every model needs `model` and `endpoints` (none only with "
                f"`scale_to_zero`): {entry!r}"
            )
        endpoints = tuple(
            Endpoint(
                address=e["address"],
                replica_id=str(e.get("replica_id", "")),
                draining=bool(e.get("draining", False)),
                weight=float(e.get("weight", 1.0)),
                max_concurrency=int(e.get("max_concurrency", 0)),
                node=str(e.get("node", "")),
                revision=str(e.get("revision", "")),
            )
            for e in entry.get("endpoints") or ()
        )
        routes.append(
            ModelRoute(
                model=entry["model"],
                endpoints=endpoints,
                deployment=entry.get("deployment", entry["model"]),
                owned_by=entry.get("owned_by", "inferplane"),
                created=int(entry.get("created", 0)),
                max_model_len=int(entry.get("max_model_len", 0)),
                routing_policy=str(entry.get("routing_policy", "")),
                tokenizer=str(entry.get("tokenizer", "")),
                scale_to_zero=bool(entry.get("scale_to_zero", False)),
                cold_start_budget_seconds=float(entry.get("cold_start_budget_seconds", 0)),
                adapter=str(entry.get("adapter", "")),
                adapter_source=str(entry.get("adapter_source", "")),
                revision_shares=tuple(
                    (str(r), int(p)) for r, p in (entry.get("revision_shares") or {}).items()
                ),
            )
        )
    return RouteTable.of(routes)
