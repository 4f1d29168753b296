"""LoRA adapters in the catalogue (issue 29): their validation and use cases.

An adapter is served by its base deployment's replicas: clients send `{base}:{adapter}` (or one
of its aliases) as the model, the routing table maps that name to the base's endpoints with the
adapter's name and source (`routing/table.py`), and the replica loads it from `source` on a miss
(vLLM's LoRA support, `ReplicaSpec.max_loras` / `max_lora_rank` / `lora_root`).

Rules (each refusal names the request field, `param`):

- `adapter_id`: 1-128 of [A-Za-z0-9._-] starting with a letter or digit (a deployment id's
  syntax: no ':', which separates base and adapter in the model name), INVALID_ARGUMENT.
- `adapter.base_deployment`: `deployments/{id-or-alias}` (or the bare id) of an existing
  deployment whose profile allows LoRA (`max_loras` > 0), INVALID_ARGUMENT.
- `adapter.source`: an absolute path without `..`, inside the orchestrator's adapter root
  (`--lora-root`) once symlinks are resolved (no escape through a link), INVALID_ARGUMENT.
  When the orchestrator's host sees the root, the source must be a folder there holding
  `adapter_config.json` (PEFT layout); otherwise (the root is a mount of the nodes only) the
  replica checks it when it loads the adapter. Stored resolved.
- `adapter.rank`: one of vLLM's ranks (`LORA_RANKS`) and at most the base profile's
  `max_lora_rank`, INVALID_ARGUMENT; 0 takes the smallest allowed rank that holds the
  adapter's own `r` (`adapter_config.json`), and a config whose `r` exceeds the rank given is
  refused.
- names: `{base}:{adapter}` and every alias are unique against deployment ids, deployment
  aliases and every adapter's names (a deleting one's too, until it is gone), ALREADY_EXISTS.

Deleting an adapter drains it: the adapter leaves the routing table at once (a new request
for it is a 404), its row stays in phase `Deleting` for the base deployment's rollout
`drain_grace_period_seconds` (requests already sent finish on the replicas), then
`sweep_adapters` (the leader's sweep loop) removes it. A deployment with a `Ready` adapter
cannot be deleted (FAILED_PRECONDITION); its `Deleting` ones go with it. A profile update that
turns LoRA off or lowers `max_lora_rank` below an adapter's rank is FAILED_PRECONDITION.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import structlog

from inferplane import lora
from inferplane.orchestrator.catalog.model import (
    ADAPTER_DELETING,
    ADAPTER_READY,
    LORA_RANKS,
    Deployment,
    LoraAdapter,
)
from inferplane.orchestrator.catalog.validation import ALIAS_RE, DEPLOYMENT_ID_RE
from inferplane.orchestrator.state import DesiredState
from inferplane.orchestrator.store.base import StateChange
from inferplane.runtime import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)

log = structlog.get_logger("inferplane.orchestrator")

#: `quiet(deployment_id, within_seconds)`: the routers' reports say nothing is in flight for
#: the deployment (`sweep_adapters`).
Quiet = Callable[[str, float], bool]

#: The adapter's configuration file in a PEFT folder (its `r` is the adapter's rank).
ADAPTER_CONFIG = lora.CONFIG_FILE


def _invalid(message: str, field: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, param=field)


def validate_adapter_id(adapter_id: str) -> None:
    """Raises InvalidArgumentError (`param` `adapter_id`) unless the id has a deployment id's
    syntax: 1-128 of [A-Za-z0-9._-], starting with a letter or digit (so no ':')."""
    if not DEPLOYMENT_ID_RE.fullmatch(adapter_id or ""):
        raise _invalid(
            f"adapter_id {adapter_id!r} must be 1-128 characters of letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (no ':': clients send {base}:{adapter})",
            "adapter_id",
        )


def resolve_source(source: str, lora_root: str) -> str:
    """The adapter folder `source`, resolved (symlinks followed where they exist), checked to
    lie inside `lora_root` (resolved the same way).

    Raises:
        InvalidArgumentError: `param` `adapter.source`: empty, relative, holding `..` or NUL,
            outside the root, or (when the root exists on this host) not a folder with
            `adapter_config.json`.
        FailedPreconditionError: no adapter root is configured.
    """
    field = "adapter.source"
    if not lora_root:
        raise FailedPreconditionError(
            "this orchestrator has no LoRA adapter root (--lora-root): adapters are off",
            reason="NO_LORA_ROOT",
            param=field,
        )
    if not source or "\x00" in source or not os.path.isabs(source):
        raise _invalid(f"adapter.source must be an absolute folder path, got {source!r}", field)
    if ".." in source.replace("\\", "/").split("/"):
        raise _invalid(f"adapter.source must not contain '..': {source!r}", field)
    root = os.path.realpath(os.path.expanduser(lora_root))
    real = os.path.realpath(source)
    if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
        raise _invalid(
            f"adapter.source {source!r} (resolved: {real}) is outside the adapter root {root}",
            field,
        )
    if real == root:
        raise _invalid("adapter.source must be a folder inside the adapter root, not it", field)
    if os.path.isdir(root) and not os.path.isfile(os.path.join(real, ADAPTER_CONFIG)):
        raise _invalid(
            f"adapter.source {source!r} is not an adapter folder (no {ADAPTER_CONFIG})", field
        )
    return real


def config_rank(source: str) -> int | None:
    """The adapter's own rank as vLLM checks it (`inferplane.lora.adapter_rank`: `r`, or the
    largest of `rank_pattern`), None when its `adapter_config.json` cannot be read here."""
    try:
        return lora.adapter_rank(Path(source))
    except lora.AdapterError:
        return None


def check_rank(rank: int, own_rank: int | None, base: Deployment) -> int:
    """The adapter's catalogue rank: `rank`, or (0) the smallest of `LORA_RANKS` that holds
    `own_rank` (the config's `r`).

    Raises:
        InvalidArgumentError: `param` `adapter.rank` (see the module docstring).
    """
    field = "adapter.rank"
    limit = base.profile.max_lora_rank
    if rank == 0:
        if own_rank is None:
            raise _invalid(
                f"adapter.rank is required (one of {', '.join(map(str, LORA_RANKS))}) when "
                f"the orchestrator cannot read the adapter's {ADAPTER_CONFIG}",
                field,
            )
        rank = next((r for r in LORA_RANKS if r >= own_rank), 0)
        if rank == 0:
            raise _invalid(f"the adapter's rank r={own_rank} exceeds vLLM's largest", field)
    if rank not in LORA_RANKS:
        raise _invalid(
            f"adapter.rank must be one of vLLM's ranks {', '.join(map(str, LORA_RANKS))}; "
            f"got {rank}",
            field,
        )
    if rank > limit:
        raise _invalid(
            f"adapter.rank {rank} exceeds deployments/{base.deployment_id}'s "
            f"profile.max_lora_rank {limit}",
            field,
        )
    if own_rank is not None and own_rank > rank:
        raise _invalid(
            f"the adapter's {ADAPTER_CONFIG} has r={own_rank}, above adapter.rank {rank}", field
        )
    return rank


def check_aliases(adapter: LoraAdapter) -> None:
    """Raises InvalidArgumentError (`param` `adapter.aliases`) for an alias of the wrong
    syntax, a repeated one, or one equal to `{base}:{adapter}`."""
    seen: set[str] = set()
    for alias in adapter.aliases:
        if not ALIAS_RE.fullmatch(alias):
            raise _invalid(
                f"alias {alias!r} must be 1-256 characters of letters, digits or ._:/@+-",
                "adapter.aliases",
            )
        if alias == adapter.model or alias in seen:
            raise _invalid(
                f"alias {alias!r} is repeated or equals the model name {adapter.model!r}",
                "adapter.aliases",
            )
        seen.add(alias)


class AdapterCatalogue(DesiredState):
    """The adapters' use cases on the desired state (a base of `Catalogue`, module docstring).

    Adapters change no placement: their writes go straight to the store (one transaction per
    change, fenced like every write), then the listeners run (the reconciler publishes the
    routing table).
    """

    _lora_root: str = ""

    def set_lora_root(self, lora_root: str) -> None:
        """The folder every adapter's source must lie in ("" = adapters off); also what each
        LoRA replica's spec carries (`ReplicaSpec.lora_root`), resolved."""
        self._lora_root = os.path.realpath(os.path.expanduser(lora_root)) if lora_root else ""

    @property
    def lora_root(self) -> str:
        """The resolved adapter root ("" = none)."""
        return self._lora_root

    # ---- read model (the reconciler's routing table; not guarded) ---------------------------

    def adapters(self) -> tuple[LoraAdapter, ...]:
        """Every adapter (both phases), by id."""
        with self._lock:
            return tuple(self._adapters[k] for k in sorted(self._adapters))

    # ---- use cases ---------------------------------------------------------------------------

    def create_adapter(self, adapter: LoraAdapter) -> LoraAdapter:
        """Validates and stores `adapter` (phase Ready); see the module docstring's rules.

        Raises:
            InvalidArgumentError, AlreadyExistsError, FailedPreconditionError (no root).
        """
        self._guard()
        validate_adapter_id(adapter.adapter_id)
        with self._lock:
            base = self._base(adapter.base_deployment)
            if base.profile.max_loras <= 0:
                raise _invalid(
                    f"deployments/{base.deployment_id} does not serve LoRA adapters: its "
                    "profile.max_loras is 0",
                    "adapter.base_deployment",
                )
            source = resolve_source(adapter.source, self._lora_root)
            rank = check_rank(adapter.rank, config_rank(source), base)
            candidate = dataclasses.replace(
                adapter,
                base_deployment=base.deployment_id,
                source=source,
                rank=rank,
                phase=ADAPTER_READY,
                create_time=self._clock.now(),
                delete_time=None,
            )
            check_aliases(candidate)
            if candidate.adapter_id in self._adapters:
                raise AlreadyExistsError(
                    f"{candidate.name} already exists", reason="ADAPTER_EXISTS", param="adapter_id"
                )
            self._check_adapter_names(candidate)
            adapters = {**self._adapters, candidate.adapter_id: candidate}
            self._commit_adapters(StateChange(put_adapters=(candidate,)), adapters)
            log.info(
                "adapter_created",
                adapter=candidate.adapter_id,
                base=base.deployment_id,
                rank=rank,
                source=source,
            )
            return candidate

    def get_adapter(self, name: str) -> LoraAdapter:
        """The adapter `adapters/{id}` (or the bare id). Raises NotFoundError."""
        self._guard()
        with self._lock:
            return self._adapter(name)

    def list_adapters(self, base_deployment: str = "") -> tuple[LoraAdapter, ...]:
        """Adapters by id; only those of `base_deployment` (`deployments/{id-or-alias}`) when
        given. Raises NotFoundError for an unknown base."""
        self._guard()
        with self._lock:
            if not base_deployment:
                return tuple(self._adapters[k] for k in sorted(self._adapters))
            base = self._base(base_deployment, found=False)
            return tuple(
                self._adapters[k]
                for k in sorted(self._adapters)
                if self._adapters[k].base_deployment == base.deployment_id
            )

    def delete_adapter(self, name: str) -> LoraAdapter | None:
        """Starts the adapter's drain: phase Deleting (out of the routing table now), gone once
        the base's drain grace passed (`sweep_adapters`); at once when that grace is 0 or the
        base is gone. Returns the adapter while Deleting, None once removed. Idempotent while
        Deleting. Raises NotFoundError."""
        self._guard()
        with self._lock:
            current = self._adapter(name)
            if current.phase == ADAPTER_DELETING:
                return current
            base = self._deployments.get(current.base_deployment)
            if base is None or base.rollout.drain_grace_period_seconds <= 0:
                adapters = {k: v for k, v in self._adapters.items() if k != current.adapter_id}
                self._commit_adapters(StateChange(delete_adapters=(current.adapter_id,)), adapters)
                log.info("adapter_deleted", adapter=current.adapter_id, drained=False)
                return None
            deleting = dataclasses.replace(
                current, phase=ADAPTER_DELETING, delete_time=self._clock.now()
            )
            adapters = {**self._adapters, deleting.adapter_id: deleting}
            self._commit_adapters(StateChange(put_adapters=(deleting,)), adapters)
            log.info(
                "adapter_deleting",
                adapter=current.adapter_id,
                grace_seconds=base.rollout.drain_grace_period_seconds,
            )
            return deleting

    def sweep_adapters(
        self, quiet: Quiet | None = None, *, propagation_seconds: float = 1.0
    ) -> list[str]:
        """Removes the Deleting adapters whose base's drain grace has passed (or whose base is
        gone), and, with `quiet`, those whose base no router has a request for in a report
        made after the routers saw the adapter leave the table (`propagation_seconds` after
        the delete); the leader calls it from its sweep loop. Returns their ids.

        `quiet(deployment_id, within_seconds)`: every router with a fresh report said, in a
        report of the last `within_seconds`, that it has nothing in flight, queued or held
        for the deployment (`RoutingHub.quiet`). The routers report per deployment, not per
        adapter: a base busy with other requests keeps its deleting adapters for the grace."""
        self._guard()
        with self._lock:
            now = self._clock.now()
            done = []
            for adapter in self._adapters.values():
                if adapter.phase != ADAPTER_DELETING:
                    continue
                base = self._deployments.get(adapter.base_deployment)
                grace = base.rollout.drain_grace_period_seconds if base is not None else 0
                age = (now - (adapter.delete_time or now)).total_seconds()
                after_table = age - propagation_seconds
                if age >= grace or (
                    quiet is not None
                    and after_table > 0
                    and quiet(adapter.base_deployment, after_table)
                ):
                    done.append(adapter.adapter_id)
            if done:
                adapters = {k: v for k, v in self._adapters.items() if k not in done}
                self._commit_adapters(StateChange(delete_adapters=tuple(sorted(done))), adapters)
                log.info("adapters_deleted", adapters=sorted(done), drained=True)
            return sorted(done)

    # ---- checks the deployment use cases run (`catalog/service.py`) --------------------------

    def _check_free_of_adapters(self, candidate: Deployment) -> None:
        """A deployment's id and aliases may not be an adapter's model name or alias.

        Raises:
            AlreadyExistsError: naming the adapter.
        """
        names = self._adapter_names()
        for name in (candidate.deployment_id, *candidate.aliases):
            owner = names.get(name)
            if owner is not None:
                raise AlreadyExistsError(
                    f"{name!r} is already a model name of adapters/{owner}",
                    reason="DEPLOYMENT_EXISTS",
                    param="deployment_id"
                    if name == candidate.deployment_id
                    else "deployment.aliases",
                )

    def _check_keeps_adapters(self, candidate: Deployment) -> None:
        """A profile update must still serve the deployment's Ready adapters.

        Raises:
            FailedPreconditionError: LoRA turned off, or `max_lora_rank` below an adapter's.
        """
        mine = self._adapters_of(candidate.deployment_id)
        if not mine:
            return
        p = candidate.profile
        if p.max_loras <= 0:
            raise FailedPreconditionError(
                f"deployments/{candidate.deployment_id} serves adapters "
                f"({', '.join(a.adapter_id for a in mine)}): delete them before setting "
                "profile.max_loras to 0",
                reason="DEPLOYMENT_HAS_ADAPTERS",
                param="deployment.profile.max_loras",
            )
        above = [a.adapter_id for a in mine if a.rank > p.max_lora_rank]
        if above:
            raise FailedPreconditionError(
                f"profile.max_lora_rank {p.max_lora_rank} is below the rank of adapters "
                f"{', '.join(above)}",
                reason="DEPLOYMENT_HAS_ADAPTERS",
                param="deployment.profile.max_lora_rank",
            )

    def _check_deletable(self, deployment_id: str) -> None:
        """Raises FailedPreconditionError while the deployment serves a Ready adapter."""
        mine = self._adapters_of(deployment_id)
        if mine:
            raise FailedPreconditionError(
                f"deployments/{deployment_id} serves adapters "
                f"({', '.join(a.adapter_id for a in mine)}): delete them first",
                reason="DEPLOYMENT_HAS_ADAPTERS",
                param="name",
            )

    # ---- helpers -----------------------------------------------------------------------------

    def _adapters_of(self, deployment_id: str) -> list[LoraAdapter]:
        return [
            a
            for a in self._adapters.values()
            if a.base_deployment == deployment_id and a.phase == ADAPTER_READY
        ]

    def _adapter_names(self, ignore: str = "") -> dict[str, str]:
        """Model name → adapter id, for every adapter but `ignore` (both phases)."""
        return {
            m: a.adapter_id
            for a in self._adapters.values()
            if a.adapter_id != ignore
            for m in a.models
        }

    def _check_adapter_names(self, candidate: LoraAdapter) -> None:
        taken = self._adapter_names(ignore=candidate.adapter_id)
        for name in candidate.models:
            param = "adapter_id" if name == candidate.model else "adapter.aliases"
            if name in self._deployments:
                owner = f"deployments/{name}"
            elif name in self._aliases:
                owner = f"deployments/{self._aliases[name]} (an alias)"
            elif name in taken:
                owner = f"adapters/{taken[name]}"
            else:
                continue
            raise AlreadyExistsError(
                f"model name {name!r} is already used by {owner}",
                reason="ADAPTER_EXISTS",
                param=param,
            )

    def _base(self, name: str, *, found: bool = True) -> Deployment:
        key = name.removeprefix("deployments/")
        deployment = self._deployments.get(key) or self._deployments.get(self._aliases.get(key, ""))
        if deployment is None:
            message = f"base deployment {name!r} does not exist"
            if found:  # creating: the request's field is at fault
                raise _invalid(message, "adapter.base_deployment")
            raise NotFoundError(message, reason="DEPLOYMENT_NOT_FOUND", param="base_deployment")
        return deployment

    def _adapter(self, name: str) -> LoraAdapter:
        key = name.removeprefix("adapters/")
        adapter = self._adapters.get(key)
        if adapter is None:
            raise NotFoundError(
                f"adapters/{key} not found", reason="ADAPTER_NOT_FOUND", param="name"
            )
        return adapter

    def _commit_adapters(self, change: StateChange, adapters: dict[str, LoraAdapter]) -> None:
        self._store.commit(change)
        self._adapters = adapters
        for callback in self._listeners:
            callback()
