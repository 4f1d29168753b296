"""The deployments page's Compatibility section (issue 30): the compatibility matrix and the
forced changes, for admin keys only, rendered on the server (text escaped); a refused read is
said in the section without breaking the page."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.console.platform import CompatibilityView, SdkSession
from inferplane.orchestrator.app import build_components
from inferplane.orchestrator.settings import OrchestratorSettings
from inferplane.runtime import RunningServer
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.testing.clock import FakeClock

ADMIN_KEY = "ip-admin-key-0000000000000000000000000000000"
ACME_KEY = "ip-acme-console-00000000000000000000000000000"


def view() -> CompatibilityView:
    failed = pb.CompatibilityEntry(
        artifacts=replica_pb2.ReplicaArtifacts(
            engine="vllm",
            engine_version="0.31.0",
            model_digest="sha256:weights-1",
            chat_template_digest="sha256:template-1",
            parser="kimi_k2/kimi_k2",
        ),
        verdict="failed",
        gates=[
            pb.GateVerdict(gate="performance", result="passed", reason="fine"),
            pb.GateVerdict(gate="canary", result="failed", reason="errors <b>3%</b> > 1%"),
        ],
        deployment="kimi",
        revision="r2",
    )
    failed.update_time.FromSeconds(1_790_000_000)
    forced = pb.ForcedChange(
        deployment="kimi", revision="r3", actor="admin", reason="hotfix <script>", overridden="x"
    )
    forced.create_time.FromSeconds(1_790_000_100)
    return CompatibilityView([failed], [forced])


def test_admins_see_the_compatibility_matrix_and_forced_changes(
    run_console: Any, sign_in: Any, csrf: Any
) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        platform.compatibility = view()
        page = await (await sign_in(client, ACME_KEY)).text()
        tenant_view = await (await client.get("/console/deployments")).text()
        assert "Compatibility" not in tenant_view and "sha256:weights-1" not in tenant_view
        await client.post("/console/sign-out", data={"csrf_token": csrf(tenant_view)})
        page = await (await sign_in(client, ADMIN_KEY)).text()
        assert page
        admin_view = await (await client.get("/console/deployments")).text()
        assert '<h2 id="compat-heading">Compatibility</h2>' in admin_view
        assert "vllm 0.31.0" in admin_view and "sha256:template-1" in admin_view
        assert '<td class="verdict">failed</td>' in admin_view
        # The first gate that did not pass, escaped.
        assert "canary: errors &lt;b&gt;3%&lt;/b&gt; &gt; 1%" in admin_view
        assert "kimi@r2" in admin_view and "kimi@r3" in admin_view
        assert (
            "hotfix &lt;script&gt;" in admin_view
            and "<script>" not in admin_view.split("compat-heading")[1]
        )

    run_console(scenario)


def test_an_unreadable_matrix_is_said_in_the_section(run_console: Any, sign_in: Any) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        platform.compatibility = CompatibilityView(error="this orchestrator keeps no matrix")
        await sign_in(client, ADMIN_KEY)
        response = await client.get("/console/deployments")
        page = await response.text()
        assert response.status == 200 and "kimi-tiny" in page
        assert "could not be read: this orchestrator keeps no matrix" in page
        assert "No verdicts yet." in page and "None." in page

    run_console(scenario)


def test_the_sdk_session_reads_the_matrix_of_a_real_orchestrator(tmp_path: Path) -> None:
    """`SdkSession.compatibility` against an in-process orchestrator (plaintext): entries
    newest first and the forced changes, as the page gets them."""
    settings = OrchestratorSettings(
        host="127.0.0.1", port=0, data_dir=tmp_path, sweep_interval_seconds=3600.0,
        grace_period_seconds=0.2, plaintext=True,
    )  # fmt: skip
    components = build_components(settings, clock=FakeClock())
    matrix = components.compat.matrix

    async def scenario() -> CompatibilityView:
        server = RunningServer(components.app(), settings)
        await server.start()  # migrates the database
        for verdict in ("qualified", "failed"):
            entry = view().entries[0]
            entry.verdict = verdict
            entry.artifacts.engine_version = f"0.3{len(verdict)}.0"
            entry.ClearField("update_time")
            matrix.record(entry)
        matrix.record_forced(
            deployment="kimi", revision="r3", actor="admin", reason="hotfix", overridden="failed"
        )
        session = SdkSession(
            ADMIN_KEY, auth="", orchestrator=f"127.0.0.1:{server.port}", telemetry="",
            security=PeerSecurity.plaintext("admin"), timeout=10.0,
        )  # fmt: skip
        try:
            return await session.compatibility()
        finally:
            await session.close()
            await server.stop()

    got = asyncio.run(scenario())
    assert got.error == ""
    assert [(e.verdict, e.artifacts.engine_version) for e in got.entries] == [
        ("failed", "0.36.0"),
        ("qualified", "0.39.0"),
    ]
    assert [(c.deployment, c.reason) for c in got.forced] == [("kimi", "hotfix")]
