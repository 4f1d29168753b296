"""No stored deployment's profile revision changes across an upgrade.

`data/profile_revisions.json` holds revisions computed once, on the code before issue 26
(commit in the file), for representative profiles: the fixture models' deployments (kimi-tiny
chat, embed-tiny embed, whisper-tiny transcribe, qwen3-tiny chat), GPU and MoE profiles with
and without the optional fields, each both as a CreateDeployment request (proto JSON) and as the
store's JSON column, plus a row written before the added fields existed. A code change that
moves any of them would start a rolling release of every such deployment on upgrade. Do not
regenerate the file: a revision that must change needs its own decision (and a release note).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator import convert
from inferplane.orchestrator.release.store import profile_from_json

CASES: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "profile_revisions.json").read_text()
)["cases"]


def request_revision(profile: dict[str, Any]) -> str:
    """The revision CreateDeployment stores for a request carrying this profile."""
    message = json_format.ParseDict({"profile": profile}, pb.Deployment())
    return convert.deployment_from_proto(message, "x").normalised().revision


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_revision_unchanged(case: dict[str, Any]) -> None:
    if "request_profile" in case:
        assert request_revision(case["request_profile"]) == case["revision"]
    else:
        profile = profile_from_json(case["stored_profile"])
        assert profile is not None
        assert profile.revision() == case["revision"]


def test_fixture_covers_each_task_and_transport() -> None:
    profiles = [c["request_profile"] for c in CASES if "request_profile" in c]
    assert {p.get("task", "") for p in profiles} >= {"", "generate", "embed", "transcribe"}
    assert {p.get("transport", "") for p in profiles} >= {"", "inproc", "grpc", "http-completions"}


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if "request_profile" in c],
    ids=[c["name"] for c in CASES if "request_profile" in c],
)
def test_the_enum_spelling_hashes_as_the_string_did(case: dict[str, Any]) -> None:
    """`replica_task` / `replica_transport` instead of (or beside) the deprecated strings give
    the revision the strings gave."""
    tasks = {v: na.ReplicaTask.Name(k) for k, v in convert.TASK_ENUMS.items()}
    transports = {v: na.ReplicaTransport.Name(k) for k, v in convert.TRANSPORT_ENUMS.items()}
    profile = dict(case["request_profile"])
    both = dict(profile)
    for string, enum, names in (
        ("task", "replica_task", tasks),
        ("transport", "replica_transport", transports),
    ):
        if profile.get(string):
            both[enum] = names[profile[string]]
            profile[enum] = names[profile.pop(string)]
    assert request_revision(profile) == case["revision"]
    assert request_revision(both) == case["revision"]
