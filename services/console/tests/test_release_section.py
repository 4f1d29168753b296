"""The deployments page's release section (issue 30): a deployment's release stage, canary
share and gate verdicts, escaped; nothing before its first release."""

from __future__ import annotations

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.console.web import templates


def render(status: pb.DeploymentStatus) -> str:
    deployment = pb.Deployment(name="deployments/kimi", status=status)
    return templates().get_template("release.html").render(d=deployment)


def test_the_release_shows_its_stage_share_and_verdicts() -> None:
    verdict = pb.GateVerdict(
        gate="conformance", result="passed", reason="replay 4/4 <ok>", seconds=12.34
    )
    verdict.decide_time.FromSeconds(1_800_000_000)
    html = render(
        pb.DeploymentStatus(
            phase="Progressing",
            release=pb.ReleaseProgress(
                stage="Canary",
                candidate_revision="abc123",
                canary_percent=10,
                verdicts=[verdict],
                message="decision after 60 s",
            ),
        )
    )
    assert "Release of abc123: Canary, canary serves 10% of live traffic." in html
    assert '<th scope="row">conformance</th><td class="verdict">passed</td>' in html
    assert "<td>12.3</td>" in html and "2027-01-15 08:00:00 UTC" in html
    assert "replay 4/4 &lt;ok&gt;" in html


def test_no_release_no_section() -> None:
    assert "Release of" not in render(pb.DeploymentStatus(phase="Available"))
