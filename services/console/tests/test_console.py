"""The console over real HTTP (aiohttp test server) against a fake platform: sign-in and the
session cookie, CSRF on every POST, session expiry, tenant-scoped pages, the secret shown
once, CSV export, and the playground relay carrying the key server-side only."""

from __future__ import annotations

import csv
import html
import io
import json
from typing import Any

from aiohttp import web

from inferplane.api.auth.v1 import usage_pb2
from inferplane.console.sessions import COOKIE_NAME
from inferplane.wire.headers import UNKNOWN_MODEL

ADMIN_KEY = "ip-admin-key-0000000000000000000000000000000"
ACME_KEY = "ip-acme-console-00000000000000000000000000000"
INFERENCE_KEY = "ip-acme-inference-000000000000000000000000000"


def test_sign_in_sets_a_strict_httponly_cookie_and_keeps_the_key_server_side(
    run_console: Any, sign_in: Any
) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        first = await client.get("/console/sign-in")
        anonymous = first.cookies[COOKIE_NAME].value
        response = await sign_in(client, ACME_KEY)
        assert response.status == 200 and str(response.url).endswith("/console/keys")
        page = await response.text()
        assert "Signed in as tenant acme" in page
        assert ACME_KEY not in page
        [redirect] = response.history
        cookie = redirect.cookies[COOKIE_NAME]
        assert cookie["httponly"] and cookie["samesite"] == "Strict"
        assert cookie["path"] == "/console/" and not cookie["secure"]  # plain http here
        assert cookie.value != anonymous  # a new id at sign-in (no session fixation)
        assert ACME_KEY not in redirect.headers.getall("Set-Cookie")[0]
        assert "default-src 'self'" in response.headers["Content-Security-Policy"]

    run_console(scenario)


def test_cookie_is_secure_when_the_console_is_served_over_https(
    run_console: Any, sign_in: Any
) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        response = await client.get("/console/sign-in")
        assert "Secure" in response.headers["Set-Cookie"]

    run_console(scenario, public_https=True)


def test_wrong_keys_cannot_sign_in(run_console: Any, sign_in: Any) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        response = await sign_in(client, "ip-unknown-000000000000000000000000000000000")
        assert response.status == 401 and "Incorrect API key" in await response.text()
        response = await sign_in(client, INFERENCE_KEY)
        assert response.status == 403
        assert "needs the 'admin' or 'console' scope" in html.unescape(await response.text())
        keys = await client.get("/console/keys", allow_redirects=False)
        assert keys.status == 303 and keys.headers["Location"] == "/console/sign-in"
        assert platform.closed == 2  # each refused key's client was closed

    run_console(scenario)


def test_every_post_needs_the_sessions_csrf_token(
    run_console: Any, sign_in: Any, csrf: Any
) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        await sign_in(client, ADMIN_KEY)
        page = await (await client.get("/console/keys")).text()
        for data in ({}, {"csrf_token": "forged"}):
            refused = await client.post("/console/keys/k-acme/revoke", data=data)
            assert refused.status == 403 and "CSRF" in await refused.text()
        assert platform.keys["k-acme"].state == 1  # still active
        ok = await client.post(
            "/console/keys/k-acme/revoke", data={"csrf_token": csrf(page)}, allow_redirects=False
        )
        assert ok.status == 303
        assert platform.keys["k-acme"].state == 2  # revoked
        # The playground's JSON POST presents the token in a header instead.
        refused = await client.post("/console/playground/chat", json={"model": "m"})
        assert refused.status == 403

    run_console(scenario)


def test_sign_in_form_needs_a_session_first(run_console: Any) -> None:
    """A cross-site form (no session cookie yet, so no token) cannot sign a browser in."""

    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        response = await client.post(
            "/console/sign-in", data={"api_key": ADMIN_KEY, "csrf_token": "x"}
        )
        assert response.status == 403

    run_console(scenario)


def test_session_expires_after_idle_ttl_and_on_sign_out(
    run_console: Any, sign_in: Any, csrf: Any
) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        await sign_in(client, ADMIN_KEY)
        clock.advance(299)
        assert (await client.get("/console/keys", allow_redirects=False)).status == 200
        clock.advance(299)  # sliding: 299 s since the last use
        assert (await client.get("/console/keys", allow_redirects=False)).status == 200
        clock.advance(300)
        gone = await client.get("/console/keys", allow_redirects=False)
        assert gone.status == 303 and gone.headers["Location"] == "/console/sign-in"
        assert platform.closed == 1  # the expired session's client was closed

        page = await (await sign_in(client, ADMIN_KEY)).text()
        out = await client.post(
            "/console/sign-out", data={"csrf_token": csrf(page)}, allow_redirects=False
        )
        assert out.status == 303
        assert (await client.get("/console/keys", allow_redirects=False)).status == 303
        assert platform.closed == 2

    run_console(scenario, session_ttl_seconds=300)


def test_a_tenant_console_key_sees_only_its_tenant_and_cannot_pick_another(
    run_console: Any, sign_in: Any, csrf: Any
) -> None:
    """The console never widens a console key's view: it lists what auth returns for that
    key, offers no tenant or admin-scope field, and sends no tenant even when one is posted
    (auth binds the key to the caller's tenant)."""

    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        page = await (await sign_in(client, ACME_KEY)).text()
        assert "acme app" in page and "globex app" not in page
        assert 'name="tenant"' not in page and 'value="admin"' not in page
        form = {"csrf_token": csrf(page), "display_name": "ci", "scopes": "inference"}
        made = await client.post("/console/keys", data={**form, "tenant": "globex"})
        assert made.status == 200
        assert platform.created[-1].tenant == ""
        other = await client.post("/console/keys/k-globex/revoke", data={"csrf_token": csrf(page)})
        assert other.status == 404 and "not found" in await other.text()
        assert platform.keys["k-globex"].state == 1

    run_console(scenario)


def test_admin_sees_every_tenant_and_created_secret_is_shown_once(
    run_console: Any, sign_in: Any, csrf: Any
) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        page = await (await sign_in(client, ADMIN_KEY)).text()
        assert "acme app" in page and "globex app" in page
        response = await client.post(
            "/console/keys",
            data=[
                ("csrf_token", csrf(page)),
                ("display_name", "batch"),
                ("tenant", "globex"),
                ("scopes", "inference"),
                ("scopes", "console"),
                ("allowed_models", "kimi-tiny, qwen3-tiny"),
                ("requests_per_minute", "60"),
                ("monthly_token_budget", "1000000"),
            ],
        )
        body = await response.text()
        key = platform.created[-1]
        assert (key.tenant, list(key.scopes), list(key.allowed_models)) == (
            "globex",
            ["inference", "console"],
            ["kimi-tiny", "qwen3-tiny"],
        )
        assert key.limits.requests_per_minute == 60
        assert key.limits.monthly_token_budget == 1_000_000
        secret = "ip-secret-1-" + "s" * 30
        assert secret in body and "shown this once" in body
        [redirect] = response.history  # Post / Redirect / Get: a reload repeats no create
        assert redirect.status == 303 and secret not in redirect.headers["Location"]
        again = await (await client.get("/console/keys")).text()
        assert secret not in again and len(platform.created) == 1

        bad = await client.post(
            "/console/keys",
            data={"csrf_token": csrf(page), "requests_per_minute": "-5"},
        )
        assert bad.status == 400 and "requests per minute must be a whole number" in (
            await bad.text()
        )

    run_console(scenario)


def test_a_revoked_signed_in_key_ends_the_session(run_console: Any, sign_in: Any) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        await sign_in(client, ACME_KEY)
        platform.revoked_secrets.add(ACME_KEY)
        response = await client.get("/console/keys", allow_redirects=False)
        assert response.status == 303
        assert response.headers["Location"] == "/console/sign-in?expired=1"

    run_console(scenario)


def test_usage_page_charts_and_csv_export(run_console: Any, sign_in: Any) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        platform.groups["day"] = [
            usage_pb2.UsageGroup(group="2026-11-25", requests=2, prompt_tokens=30,
                                 completion_tokens=12),
            usage_pb2.UsageGroup(group="2026-11-26", requests=1, prompt_tokens=5,
                                 completion_tokens=3),
        ]  # fmt: skip
        # Requests for names no route serves arrive as one model, UNKNOWN_MODEL (the picker's).
        platform.groups["model"] = [
            usage_pb2.UsageGroup(group="kimi-tiny", requests=3, prompt_tokens=35,
                                 completion_tokens=15),
            usage_pb2.UsageGroup(group=UNKNOWN_MODEL, requests=2, failed_requests=2),
        ]  # fmt: skip
        for i, (tenant, model) in enumerate((("acme", "=cmd|' /C calc'!A0"), ("globex", "m"))):
            row = usage_pb2.UsageRow(
                request_id=f"r{i}", key_id="k", tenant=tenant, model=model,
                status="completed", prompt_tokens=7, completion_tokens=2, ttft_seconds=0.25,
            )  # fmt: skip
            row.end_time.FromSeconds(1_790_000_000)
            platform.rows.append(row)
        await sign_in(client, ACME_KEY)
        page = await (await client.get("/console/usage?days=7")).text()
        assert page.count('<svg xmlns="http://www.w3.org/2000/svg" class="chart"') == 3
        assert "<title>2026-11-25: 42 tokens</title>" in page
        assert '<td class="total">50</td>' in page  # kimi-tiny: 35 + 15
        assert page.count(f'<th scope="row">{UNKNOWN_MODEL}</th>') == 1
        bad = await client.get("/console/usage?days=5")
        assert bad.status == 400

        export = await client.get("/console/usage.csv?days=7")
        assert export.content_type == "text/csv"
        assert "attachment" in export.headers["Content-Disposition"]
        rows = list(csv.DictReader(io.StringIO(await export.text())))
        assert [r["tenant"] for r in rows] == ["acme"]  # what auth returned for this key
        assert rows[0]["model"] == "'=cmd|' /C calc'!A0"  # no formula
        assert rows[0]["ttft_seconds"] == "0.250000"
        assert rows[0]["end_time"].startswith("2026-09-21T")

    run_console(scenario)


def test_playground_relays_the_stream_with_the_sessions_key(
    run_console: Any, sign_in: Any, csrf: Any
) -> None:
    """The browser never holds the key: the console adds it to the edge request and streams
    the edge's SSE bytes back unchanged."""
    seen: dict[str, Any] = {}

    async def fake_edge(request: web.Request) -> web.StreamResponse:
        seen["authorization"] = request.headers.get("authorization")
        seen["body"] = await request.json()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in ({"choices": [{"delta": {"reasoning_content": "hm"}}]}, "[DONE]"):
            data = event if isinstance(event, str) else json.dumps(event)
            await response.write(f"data: {data}\n\n".encode())
        return response

    edge = web.Application()
    edge.router.add_post("/v1/chat/completions", fake_edge)

    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        await sign_in(client, ACME_KEY)
        page = await (await client.get("/console/playground")).text()
        token = page.split('data-csrf="')[1].split('"')[0]
        assert ACME_KEY not in page
        response = await client.post(
            "/console/playground/chat",
            json={"model": "kimi-tiny", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-csrf-token": token},
        )
        assert response.status == 200 and response.content_type == "text/event-stream"
        body = await response.text()
        assert body.endswith("data: [DONE]\n\n") and '"reasoning_content": "hm"' in body
        assert seen["authorization"] == f"Bearer {ACME_KEY}"
        assert seen["body"]["stream"] is True
        bad = await client.post(
            "/console/playground/chat", data="{", headers={"x-csrf-token": token}
        )
        assert bad.status == 400
        assert (await bad.json())["error"]["code"] == "invalid_json"

    run_console(scenario, edge_app=edge)


def test_alerts_page_lists_telemetrys_alerts(run_console: Any, sign_in: Any) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        await sign_in(client, ADMIN_KEY)
        page = await (await client.get("/console/alerts")).text()
        assert "ttft_p99" in page and "slow" in page

    run_console(scenario)


def test_where_replicas_run_and_the_alerts_are_for_admin_keys_only(
    run_console: Any, sign_in: Any, csrf: Any
) -> None:
    """A tenant's console key sees the catalogue (model, phase, replicas) but not the fleet's
    layout (nodes, GPUs, placement explanation) nor the platform's alerts (403, and no link);
    an admin key sees all of it."""

    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        page = await (await sign_in(client, ACME_KEY)).text()
        assert 'href="/console/alerts"' not in page
        alerts = await client.get("/console/alerts")
        assert alerts.status == 403 and "ttft_p99" not in await alerts.text()
        tenant_view = await (await client.get("/console/deployments")).text()
        assert "kimi-tiny" in tenant_view and "Ready" in tenant_view
        assert "gpu-node-7" not in tenant_view and "Placement explained" not in tenant_view
        await client.post("/console/sign-out", data={"csrf_token": csrf(tenant_view)})
        page = await (await sign_in(client, ADMIN_KEY)).text()
        assert 'href="/console/alerts"' in page
        admin_view = await (await client.get("/console/deployments")).text()
        assert "gpu-node-7" in admin_view and "most free" in admin_view

    run_console(scenario)


def test_edit_sets_name_scopes_models_and_limits_of_an_own_key(
    run_console: Any, sign_in: Any, csrf: Any
) -> None:
    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        page = await (await sign_in(client, ACME_KEY)).text()
        assert 'action="/console/keys/k-acme/update"' in page
        assert 'action="/console/keys/k-globex/update"' not in page
        form = [
            ("csrf_token", csrf(page)),
            ("display_name", "renamed"),
            ("scopes", "inference"),
            ("scopes", "console"),
            ("allowed_models", "kimi-tiny"),
            ("tokens_per_minute", "500"),
            ("tenant", "globex"),  # ignored: a key's tenant never changes
        ]
        done = await client.post("/console/keys/k-acme/update", data=form, allow_redirects=False)
        assert done.status == 303
        [(sent, fields)] = platform.updates
        assert fields == ("display_name", "scopes", "allowed_models", "limits")
        assert (sent.name, sent.tenant, list(sent.scopes)) == (
            "k-acme",
            "",
            ["inference", "console"],
        )
        key = platform.keys["k-acme"]
        assert key.display_name == "renamed" and list(key.allowed_models) == ["kimi-tiny"]
        assert key.limits.tokens_per_minute == 500
        listed = await (await client.get("/console/keys")).text()
        assert 'value="renamed"' in listed and 'value="500"' in listed
        other = await client.post("/console/keys/k-globex/update", data=form, allow_redirects=False)
        assert other.status == 404

    run_console(scenario)


def test_the_deployments_page_shows_the_autoscaler_to_every_key(
    run_console: Any, sign_in: Any, csrf: Any
) -> None:
    """An autoscaled deployment shows its bounds, desired replicas, scale to zero, last
    decision, signals (TTFT p99 against the SLO) and recent decisions newest first with a
    step chart of its replicas, to a tenant's console key as to an admin key (the catalogue
    is every key's); reasons are text, never markup; a fixed deployment says autoscaling is
    off."""
    from .conftest import HOSTILE_REASON

    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        await sign_in(client, ACME_KEY)
        tenant_view = await (await client.get("/console/deployments")).text()
        await client.post("/console/sign-out", data={"csrf_token": csrf(tenant_view)})
        await sign_in(client, ADMIN_KEY)
        admin_view = await (await client.get("/console/deployments")).text()
        for page in (tenant_view, admin_view):
            fixed, auto = page.split('<section class="deployment"')[1:]
            assert "kimi-tiny" in fixed and "off: replicas are the operator's" in fixed
            assert "Autoscaler" not in fixed
            assert "on: the autoscaler sets replicas within 1..4" in auto
            assert "min 1, desired 3, max 4 (now 3, 2 ready)" in auto
            assert "on: after 90 s without a request" in auto and "held up to 45 s" in auto
            assert "<dt>Scale-down window</dt><dd>30 s</dd>" in auto
            # The hostile reason is escaped wherever it appears, never markup.
            assert "<script>" not in page and HOSTILE_REASON not in page
            escaped = html.escape(HOSTILE_REASON, quote=True)
            assert auto.count(escaped) == 2  # last decision + the decisions table
            assert f"scale_up: {escaped}" in auto
            signals = auto.split('<table class="signals">')[1].split("</table>")[0]
            cells = [c.split("</td>")[0] for c in signals.split("<td>")[1:]]
            assert cells == [
                "8", "1.25 s", "0.50/s", "13", "2", "42%", "0.875 s (0.5 s)", "0", "0 s", "2",
            ]  # fmt: skip
            table = auto.split('<table class="decisions">')[1].split("</table>")[0]
            rows = table.split("<tbody>")[1].split("</tr>")[:-1]
            assert [r.split('<th scope="row">')[1].split("<")[0] for r in rows] == [
                "scale_up",
                "scale_from_zero",
            ]
            assert "1 → 3" in rows[0] and "0 → 1" in rows[1]
            assert "2026-09-21 14:15:00 UTC" in rows[0]
            # The step chart: 0 → 1 → 3, each step titled with its time and count.
            assert 'aria-labelledby="replicas-chart-2"' in auto
            assert "14:13:20 UTC: 0 replicas" in auto and "14:15:00 UTC: 3 replicas" in auto

    run_console(scenario)


def test_decisions_that_cannot_be_read_leave_the_rest_of_the_page(
    run_console: Any, sign_in: Any
) -> None:
    """An orchestrator refusing ListAutoscalerDecisions (e.g. one from before autoscaling):
    the page still answers 200 with the deployment's autoscaler status, and says why the
    decisions are missing."""

    async def scenario(client: Any, platform: Any, clock: Any) -> None:
        platform.decisions_error = "Method not found: ListAutoscalerDecisions"
        await sign_in(client, ADMIN_KEY)
        response = await client.get("/console/deployments")
        page = await response.text()
        assert response.status == 200
        assert "min 1, desired 3, max 4" in page
        assert "decisions could not be read: Method not found: ListAutoscalerDecisions" in page
        assert "No decisions yet." in page and "replicas-chart" not in page

    run_console(scenario)
