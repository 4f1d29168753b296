"""The compatibility matrix enforced at CreateDeployment and UpdateDeployment (issue 30).

A profile names a model source, an engine version and parsers, not digests; the orchestrator
learns each model source's digests from what its replicas report (`Replica.artifacts`, seen on
every heartbeat: `observe`). A create, or an update that changes the revision, is checked
against every combination known for its profile:

- each artifacts set reported by a ready replica of the same `model_source` (any engine
  version: the weights and chat template digests do not depend on it), with the profile's
  parsers ("<tool_parser>/<reasoning_parser>") and its `engine_version` when it pins one (the
  versions those replicas reported when it does not);
- a combination whose current verdict is "failed" refuses the change with INVALID_ARGUMENT
  naming `deployment.profile.engine_version` (when the profile pins the failed version) or
  `deployment.profile.model_source`, with the combination and the failed gate's reason, unless
  the request sets `force` with a `force_reason`: then it goes through and a forced change is
  written (`ListForcedChanges`) and logged once the change is committed;
- no known combination, or none failed: allowed (the release qualifies it: `release/`).

`force` without a `force_reason` is INVALID_ARGUMENT naming `force_reason`, whatever the
verdicts. Grandfathering happens in `observe` too: see `CompatibilityMatrix.grandfather`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.artifacts import parser_of
from inferplane.orchestrator.catalog.model import Deployment
from inferplane.orchestrator.release.matrix import FAILED, MAX_REASON, CompatibilityMatrix
from inferplane.runtime import InvalidArgumentError

log = structlog.get_logger("inferplane.orchestrator")

_Combination = tuple[str, str, str, str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class Override:
    """A request's `force` and `force_reason`, and who sent it (the caller's identity)."""

    force: bool = False
    reason: str = ""
    actor: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Forced:
    """A change admitted over a failed verdict, to audit once committed."""

    deployment: str
    revision: str
    overridden: str
    override: Override


def describe(entry: orchestrator_pb2.CompatibilityEntry) -> str:
    """One line naming an entry's combination, verdict and the reason of its first gate that
    did not pass (`ForcedChange.overridden`, refusal messages)."""
    a = entry.artifacts
    reasons = [g for g in entry.gates if g.result != "passed"]
    why = f" ({reasons[0].gate}: {reasons[0].reason})" if reasons else ""
    return (
        f"{entry.verdict} on {entry.deployment}@{entry.revision}{why} for engine {a.engine} "
        f"{a.engine_version}, weights {a.model_digest}, chat template {a.chat_template_digest}, "
        f"parsers {a.parser}"
    )


def _key(a: replica_pb2.ReplicaArtifacts) -> _Combination:
    return (a.engine, a.engine_version, a.model_digest, a.chat_template_digest, a.parser)


class CompatibilityCheck:
    """The digests cache, grandfathering and the create/update check (module docstring) on
    one `CompatibilityMatrix`. Thread-safe; `observe`, `admit` and `audit` block (database)."""

    def __init__(self, matrix: CompatibilityMatrix) -> None:
        self.matrix = matrix
        self._lock = threading.Lock()
        # (model_source, the profile's engine_version) -> the artifacts its replicas reported.
        self._seen: dict[tuple[str, str], dict[_Combination, replica_pb2.ReplicaArtifacts]] = {}
        # (deployment, revision, combination) already considered for grandfathering.
        self._considered: set[tuple[str, str, _Combination]] = set()
        self._grandfathered: set[tuple[str, str]] | None = None

    def observe(self, replicas: Iterable[nodeagent_pb2.Replica]) -> None:
        """Learns the artifacts of every ready replica that reports them, and grandfathers a
        combination the first time a ready replica of a grandfathered (deployment, revision)
        reports it with no verdict recorded. Never raises: a failed write is logged and tried
        again at the next report."""
        for replica in replicas:
            if replica.state != nodeagent_pb2.Replica.STATE_READY:
                continue
            artifacts = replica.artifacts
            if not artifacts.model_digest:
                continue
            spec = replica.spec
            key = _key(artifacts)
            with self._lock:
                self._seen.setdefault((spec.model_source, spec.engine_version), {})[key] = artifacts
                considered = (spec.deployment, spec.revision, key)
                if considered in self._considered:
                    continue
            try:
                if self._grandfathered is None:
                    self._grandfathered = self.matrix.grandfathered()
                if (spec.deployment, spec.revision) in self._grandfathered and (
                    self.matrix.grandfather(artifacts, spec.deployment, spec.revision)
                ):
                    log.info(
                        "compatibility_grandfathered",
                        deployment=spec.deployment,
                        revision=spec.revision,
                        engine_version=artifacts.engine_version,
                        model_digest=artifacts.model_digest,
                    )
            except Exception as exc:  # heartbeats must go on; retried at the next report
                log.warning(
                    "compatibility_grandfather_failed", deployment=spec.deployment, error=str(exc)
                )
                continue
            with self._lock:
                self._considered.add(considered)

    def combinations(self, deployment: Deployment) -> list[replica_pb2.ReplicaArtifacts]:
        """The combinations known for `deployment`'s profile (module docstring), sorted."""
        profile = deployment.profile
        parser = parser_of(profile.tool_parser, profile.reasoning_parser)
        found: dict[_Combination, replica_pb2.ReplicaArtifacts] = {}
        with self._lock:
            for (source, pinned), seen in self._seen.items():
                if source != profile.model_source:
                    continue
                for artifacts in seen.values():
                    if not profile.engine_version and pinned:
                        continue  # an unpinned profile runs what unpinned replicas ran
                    candidate = replica_pb2.ReplicaArtifacts()
                    candidate.CopyFrom(artifacts)
                    candidate.parser = parser
                    if profile.engine_version:
                        candidate.engine_version = profile.engine_version
                    found[_key(candidate)] = candidate
        return [found[k] for k in sorted(found)]

    def admit(self, candidate: Deployment, override: Override | None) -> Forced | None:
        """Checks `candidate` (its revision already computed) against the matrix. Returns the
        forced change to `audit` after the commit, or None when nothing was overridden.

        Raises:
            InvalidArgumentError: `force` without `force_reason` (param "force_reason"), a
                reason over MAX_REASON characters, or a failed verdict for a known combination
                without `force` (param `deployment.profile.engine_version` or
                `deployment.profile.model_source`; the message names the combination and the
                failed gate's reason).
        """
        override = override or Override()
        if override.force and not override.reason.strip():
            raise InvalidArgumentError(
                "force_reason is required with force (why the failed verdict is overridden)",
                param="force_reason",
            )
        if len(override.reason) > MAX_REASON:
            raise InvalidArgumentError(
                f"force_reason must be at most {MAX_REASON} characters", param="force_reason"
            )
        failed = [
            entry
            for entry in map(self.matrix.lookup, self.combinations(candidate))
            if entry is not None and entry.verdict == FAILED
        ]
        if not failed:
            return None
        overridden = describe(failed[0])
        if not override.force:
            field = (
                "deployment.profile.engine_version"
                if candidate.profile.engine_version
                else "deployment.profile.model_source"
            )
            raise InvalidArgumentError(
                f"the compatibility matrix holds a failed verdict for {field} "
                f"{getattr(candidate.profile, field.rsplit('.', 1)[1])!r}: {overridden}; "
                "choose another engine version, or set force with a force_reason to override",
                param=field,
            )
        return Forced(candidate.deployment_id, candidate.revision, overridden, override)

    def audit(self, forced: Forced) -> None:
        """Writes and logs a committed forced change (`ListForcedChanges`). Never raises: the
        change is committed already; a failed write is logged as an error with every field."""
        fields = {
            "deployment": forced.deployment,
            "revision": forced.revision,
            "actor": forced.override.actor,
            "reason": forced.override.reason,
            "overridden": forced.overridden,
        }
        try:
            self.matrix.record_forced(**fields)
        except Exception as exc:  # the change itself is committed
            log.error("deployment_forced_unaudited", error=str(exc), **fields)
            return
        log.warning(
            "deployment_forced",
            deployment=forced.deployment,
            revision=forced.revision,
            actor=forced.override.actor,
            reason=forced.override.reason,
            overridden=forced.overridden,
        )
