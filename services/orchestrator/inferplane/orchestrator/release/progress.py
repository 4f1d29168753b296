"""A release's pipeline state (issue 30): the candidate revision, the stage it is in, the
gates' verdicts and the canary's window, kept on the `Release` and persisted with it (one JSON
document, `releases.pipeline`, migration 0008).

Stages (`ReleaseProgress.stage`, orchestrator.proto): "Qualifying" (the gates run on a
candidate replica that takes no live traffic), "Canary" (the candidate serves
`canary_percent` of live traffic beside the stable revision), "Promoted" (the candidate passed:
the rest rolls as a plain rolling release), "RolledBack" (a gate or the canary failed).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from google.protobuf import json_format

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb

QUALIFYING = "Qualifying"
CANARY = "Canary"
PROMOTED = "Promoted"
ROLLED_BACK = "RolledBack"
STAGES = (QUALIFYING, CANARY, PROMOTED, ROLLED_BACK)

#: `GateVerdict.result` values (orchestrator.proto).
PASSED = "passed"
FAILED = "failed"
ERROR = "error"


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    """Where one release of `candidate_revision` stands.

    `verdicts`: the gates' verdicts in the order they ran. `canary_since`: when the canary's
    current window started (timezone-aware UTC; None outside the canary); `extensions`: how
    many times the window was extended for too few requests (at most `MAX_CANARY_EXTENSIONS`,
    canary.py). `message`: a sentence a person can act on. `artifacts`: what the candidate
    replica runs (the compatibility matrix's key), once known.
    """

    candidate_revision: str
    stage: str = QUALIFYING
    canary_percent: int = 0
    verdicts: tuple[pb.GateVerdict, ...] = ()
    message: str = ""
    canary_since: datetime | None = None
    extensions: int = 0
    artifacts: replica_pb2.ReplicaArtifacts | None = None

    @property
    def qualified(self) -> bool:
        """The qualifying gates passed (the candidate may take live traffic)."""
        return self.stage in (CANARY, PROMOTED)

    @property
    def ended(self) -> bool:
        return self.stage in (PROMOTED, ROLLED_BACK)

    def with_verdict(self, verdict: pb.GateVerdict) -> Progress:
        return dataclasses.replace(self, verdicts=(*self.verdicts, verdict))

    def to_proto(self) -> pb.ReleaseProgress:
        """`DeploymentStatus.release`."""
        return pb.ReleaseProgress(
            stage=self.stage,
            candidate_revision=self.candidate_revision,
            canary_percent=self.canary_percent if self.stage == CANARY else 0,
            verdicts=list(self.verdicts),
            message=self.message,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate_revision": self.candidate_revision,
            "stage": self.stage,
            "canary_percent": self.canary_percent,
            "verdicts": [json_format.MessageToDict(v) for v in self.verdicts],
            "message": self.message,
            "canary_since": self.canary_since.isoformat() if self.canary_since else None,
            "extensions": self.extensions,
            "artifacts": (
                json_format.MessageToDict(self.artifacts) if self.artifacts is not None else None
            ),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Progress | None:
        if not data:
            return None
        since = data.get("canary_since")
        artifacts = data.get("artifacts")
        return cls(
            candidate_revision=str(data.get("candidate_revision", "")),
            stage=str(data.get("stage", QUALIFYING)),
            canary_percent=int(data.get("canary_percent", 0)),
            verdicts=tuple(
                json_format.ParseDict(v, pb.GateVerdict(), ignore_unknown_fields=True)
                for v in data.get("verdicts", ())
            ),
            message=str(data.get("message", "")),
            canary_since=datetime.fromisoformat(since) if since else None,
            extensions=int(data.get("extensions", 0)),
            artifacts=(
                json_format.ParseDict(
                    artifacts, replica_pb2.ReplicaArtifacts(), ignore_unknown_fields=True
                )
                if artifacts
                else None
            ),
        )
