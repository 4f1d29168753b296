"""The web console (issue 21): aiohttp serving server-rendered pages under `/console/`.

Composition root: `build_app(settings, platform=..., clock=...)`. Pages: sign-in, API keys
(create with the secret shown once, scopes, model allow-list, limits, rotate, revoke), usage
(SVG charts per day, per model and per key; CSV export), deployments (replicas, placement and
its explanation, health, release progress), playground (streaming chat through the edge) and
alerts. Every platform call acts for the signed-in key (`inferplane.console.platform`), so auth
decides what the page may show. Every asset is served from `static/` (no CDN), and the
Content-Security-Policy allows nothing else.

Errors: a refused platform call shows its message on the page with the status the edge would
answer (401 signs the session out); bad form input answers 400 naming the field; the
playground's JSON endpoint answers OpenAI's error shape.
"""

from __future__ import annotations

import dataclasses
import json
import ssl
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import jinja2
import structlog
from aiohttp import web

from inferplane.api.auth.v1 import auth_pb2
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.console.charts import bar_chart
from inferplane.console.platform import Platform, PlatformSession, SdkPlatform
from inferplane.console.sessions import (
    COOKIE_NAME,
    Identity,
    Session,
    SessionStore,
    cookie_attributes,
)
from inferplane.console.settings import ConsoleSettings
from inferplane.console.usage import token_bars, total_tokens, usage_csv
from inferplane.runtime import InferplaneError, UnauthenticatedError
from inferplane.runtime.clock import Clock, SystemClock

log = structlog.get_logger("inferplane.console")

PREFIX = "/console"
SCOPES = ("inference", "console", "admin")
USAGE_PERIODS = (1, 7, 30, 90)  # days the usage page offers
_SESSION_KEY = web.RequestKey("session", dict)
_CONSOLE = web.AppKey("console", object)
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)
_LIMIT_FIELDS = (
    ("requests_per_minute", "requests per minute"),
    ("tokens_per_minute", "tokens per minute"),
    ("max_concurrent_requests", "concurrent requests"),
    ("monthly_token_budget", "monthly token budget"),
)


class FormError(Exception):
    """Bad form input: answered 400 with the message on the page."""


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("inferplane.console", "templates"),
        autoescape=jinja2.select_autoescape(("html", "svg")),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["ts"] = _format_ts
    env.globals["prefix"] = PREFIX
    env.globals["replica_state"] = lambda v: nodeagent_pb2.Replica.State.Name(v).removeprefix(
        "STATE_"
    )
    env.globals["key_state"] = lambda v: auth_pb2.ApiKey.State.Name(v).removeprefix("STATE_")
    return env


def _format_ts(value: Any) -> str:
    """A protobuf Timestamp (unset → "") as `YYYY-MM-DD HH:MM:SS UTC`."""
    if value is None or not value.seconds:
        return ""
    return f"{value.ToDatetime():%Y-%m-%d %H:%M:%S} UTC"


def _uint(form: Any, field: str, label: str) -> int:
    raw = str(form.get(field, "") or "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) > 2**32 - 1:
        raise FormError(f"{label} must be a whole number from 0 to {2**32 - 1}, got {raw!r}")
    return int(raw)


# What the edit form of a key sets (AIP-134 update mask paths).
UPDATE_FIELDS = ("display_name", "scopes", "allowed_models", "limits")


def key_from_form(form: Any, identity: Identity) -> auth_pb2.ApiKey:
    """The `ApiKey` a create form asks for (scopes checked, models split on commas or
    whitespace, limits whole numbers). A console key's form has no tenant field and sends
    none: auth binds the key to the caller's tenant (and refuses any other).

    Raises:
        FormError: a limit or the expiry is not a whole number, or an unknown scope.
    """
    scopes = [s for s in form.getall("scopes", []) if s]
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown:
        raise FormError(f"unknown scope(s): {', '.join(unknown)}")
    models = [m for m in str(form.get("allowed_models", "")).replace(",", " ").split() if m]
    key = auth_pb2.ApiKey(
        display_name=str(form.get("display_name", "")).strip(),
        tenant=str(form.get("tenant", "")).strip() if identity.is_admin else "",
        scopes=scopes,
        allowed_models=models,
        limits=auth_pb2.Limits(**{f: _uint(form, f, label) for f, label in _LIMIT_FIELDS}),
    )
    days = _uint(form, "expire_days", "expiry (days)")
    if days:
        key.expire_time.FromDatetime(datetime.now(UTC) + timedelta(days=days))
    return key


@dataclasses.dataclass
class Console:
    """The console's state: settings, sessions, the platform and the edge client."""

    settings: ConsoleSettings
    platform: Platform
    sessions: SessionStore
    templates: jinja2.Environment
    edge: aiohttp.ClientSession | None = None

    # -- plumbing ------------------------------------------------------------------------

    async def close_sessions(self, sessions: Sequence[Session]) -> None:
        for s in sessions:
            if s.client is not None:
                await s.client.close()
                s.client = None

    def render(
        self, request: web.Request, template: str, *, status: int = 200, **context: Any
    ) -> web.Response:
        session: Session = request[_SESSION_KEY]["session"]
        page = self.templates.get_template(template).render(
            identity=session.identity,
            csrf_token=session.csrf_token,
            path=request.path,
            error=context.pop("error", None),
            **context,
        )
        return web.Response(text=page, content_type="text/html", status=status)

    def set_cookie(self, response: web.StreamResponse, session: Session) -> None:
        response.set_cookie(
            COOKIE_NAME,
            session.session_id,
            **cookie_attributes(
                secure=self.settings.secure_cookie,
                max_age_seconds=self.settings.session_max_age_seconds,
            ),
        )

    async def platform_error(
        self, request: web.Request, exc: InferplaneError, template: str, **context: Any
    ) -> web.StreamResponse:
        """A refused platform call: sign out on 401 (key revoked or expired meanwhile),
        else the page with the message and the edge's status for that error."""
        session: Session = request[_SESSION_KEY]["session"]
        if isinstance(exc, UnauthenticatedError) and session.identity is not None:
            await self.close_sessions([session])
            self.sessions.drop(session)
            raise web.HTTPSeeOther(f"{PREFIX}/sign-in?expired=1")
        return self.render(request, template, status=exc.http_status, error=exc.message, **context)

    # -- middleware ----------------------------------------------------------------------

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        session, expired = self.sessions.get(request.cookies.get(COOKIE_NAME))
        await self.close_sessions(expired)
        fresh = session is None
        if session is None:
            session, evicted = self.sessions.new()
            await self.close_sessions(evicted)
        state = {"session": session}
        request[_SESSION_KEY] = state
        if request.method == "POST":
            presented = request.headers.get("x-csrf-token")
            if presented is None and request.content_type in (
                "application/x-www-form-urlencoded",
                "multipart/form-data",
            ):
                presented = str((await request.post()).get("csrf_token", ""))
            if fresh or not session.csrf_ok(presented):
                refusal = self.render(
                    request,
                    "error.html",
                    status=403,
                    error="This form has expired or did not come from this console "
                    "(CSRF check failed). Reload the page and try again.",
                )
                self.set_cookie(refusal, session)
                return refusal
        response: web.StreamResponse
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            response = exc
        current: Session = state["session"]
        if state.get("signed_out"):
            response.del_cookie(COOKIE_NAME, path="/console/")
        elif current.session_id != request.cookies.get(COOKIE_NAME):
            # A new anonymous session, or the new id given at sign-in.
            self.set_cookie(response, current)
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        response.headers.setdefault("X-Frame-Options", "DENY")
        if not request.path.startswith(f"{PREFIX}/static/"):
            response.headers.setdefault("Cache-Control", "no-store")
        if isinstance(response, web.HTTPException) and response.status >= 300:
            raise response
        return response

    def signed_in(self, request: web.Request) -> tuple[Session, Identity, PlatformSession]:
        """The session, its identity and platform client; else a redirect to sign-in."""
        session: Session = request[_SESSION_KEY]["session"]
        if session.identity is None or session.client is None:
            raise web.HTTPSeeOther(f"{PREFIX}/sign-in")
        return session, session.identity, session.client

    # -- sign-in -------------------------------------------------------------------------

    async def index(self, request: web.Request) -> web.StreamResponse:
        session: Session = request[_SESSION_KEY]["session"]
        raise web.HTTPSeeOther(f"{PREFIX}/keys" if session.identity else f"{PREFIX}/sign-in")

    async def sign_in_page(self, request: web.Request) -> web.StreamResponse:
        notice = "Your session ended: sign in again." if request.query.get("expired") else None
        return self.render(request, "sign_in.html", notice=notice)

    async def sign_in(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        api_key = str(form.get("api_key", "")).strip()
        if not api_key:
            return self.render(
                request, "sign_in.html", status=400, error="Enter an API key.", notice=None
            )
        client = self.platform.open(api_key)
        try:
            identity = await client.identify()
        except InferplaneError as exc:
            await client.close()
            status = exc.http_status if exc.http_status in (401, 403) else 503
            message = (
                "This key cannot sign in: it needs the 'admin' or 'console' scope."
                if status == 403
                else exc.message
            )
            return self.render(request, "sign_in.html", status=status, error=message, notice=None)
        state = request[_SESSION_KEY]
        state["session"] = self.sessions.sign_in(state["session"], identity, client)
        log.info("console_sign_in", admin=identity.is_admin, tenant=identity.tenant)
        raise web.HTTPSeeOther(f"{PREFIX}/keys")

    async def sign_out(self, request: web.Request) -> web.StreamResponse:
        state = request[_SESSION_KEY]
        session: Session = state["session"]
        await self.close_sessions([session])
        self.sessions.drop(session)
        state["signed_out"] = True
        raise web.HTTPSeeOther(f"{PREFIX}/sign-in")

    # -- keys ----------------------------------------------------------------------------

    async def keys_page(
        self,
        request: web.Request,
        *,
        created: Any = None,
        status: int = 200,
        error: str | None = None,
    ) -> web.StreamResponse:
        _, _, client = self.signed_in(request)
        show_inactive = request.query.get("inactive") == "1"
        try:
            keys = await client.list_keys(show_inactive=show_inactive)
        except InferplaneError as exc:
            return await self.platform_error(
                request, exc, "keys.html", keys=[], created=None, show_inactive=show_inactive,
                scopes=SCOPES, limit_fields=_LIMIT_FIELDS,
            )  # fmt: skip
        return self.render(
            request,
            "keys.html",
            status=status,
            error=error,
            keys=keys,
            created=created,
            show_inactive=show_inactive,
            scopes=SCOPES,
            limit_fields=_LIMIT_FIELDS,
        )

    async def keys_get(self, request: web.Request) -> web.StreamResponse:
        session, _, _ = self.signed_in(request)
        created, session.flash = session.flash, None
        return await self.keys_page(request, created=created)

    async def key_create(self, request: web.Request) -> web.StreamResponse:
        _, identity, client = self.signed_in(request)
        try:
            key = key_from_form(await request.post(), identity)
            made = await client.create_key(key)
        except FormError as exc:
            return await self.keys_page(request, status=400, error=str(exc))
        except InferplaneError as exc:
            return await self.keys_page(request, status=exc.http_status, error=exc.message)
        return self._show_once(request, made)

    async def key_rotate(self, request: web.Request) -> web.StreamResponse:
        _, _, client = self.signed_in(request)
        form = await request.post()
        try:
            grace = _uint(form, "grace_period_seconds", "grace period (seconds)")
            made = await client.rotate_key(request.match_info["key_id"], grace)
        except FormError as exc:
            return await self.keys_page(request, status=400, error=str(exc))
        except InferplaneError as exc:
            return await self.keys_page(request, status=exc.http_status, error=exc.message)
        return self._show_once(request, made)

    def _show_once(self, request: web.Request, made: Any) -> web.StreamResponse:
        """Redirects to the keys page, which shows `made`'s secret once: the secret waits in
        the server-side session for that one page (never in a URL or cookie), and a reload
        of the page neither repeats the create nor shows the secret again."""
        session, _, _ = self.signed_in(request)
        session.flash = made
        raise web.HTTPSeeOther(f"{PREFIX}/keys")

    async def key_update(self, request: web.Request) -> web.StreamResponse:
        """Sets a key's name, scopes, model allow-list and limits (the edit form); auth
        refuses what the signed-in key may not change."""
        _, identity, client = self.signed_in(request)
        try:
            key = key_from_form(await request.post(), identity)
            key.ClearField("tenant")
            key.ClearField("expire_time")
            key.name = request.match_info["key_id"]
            await client.update_key(key, UPDATE_FIELDS)
        except FormError as exc:
            return await self.keys_page(request, status=400, error=str(exc))
        except InferplaneError as exc:
            return await self.keys_page(request, status=exc.http_status, error=exc.message)
        raise web.HTTPSeeOther(f"{PREFIX}/keys")

    async def key_revoke(self, request: web.Request) -> web.StreamResponse:
        _, _, client = self.signed_in(request)
        try:
            await client.revoke_key(request.match_info["key_id"])
        except InferplaneError as exc:
            return await self.keys_page(request, status=exc.http_status, error=exc.message)
        raise web.HTTPSeeOther(f"{PREFIX}/keys")

    # -- usage ---------------------------------------------------------------------------

    def _usage_filters(self, request: web.Request) -> tuple[int, str, datetime]:
        raw = request.query.get("days", "7")
        if not raw.isdigit() or int(raw) not in USAGE_PERIODS:
            raise web.HTTPBadRequest(
                text=f"days must be one of {', '.join(map(str, USAGE_PERIODS))}"
            )
        days = int(raw)
        key = request.query.get("key", "").strip()
        start = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        return days, key, start - timedelta(days=days - 1)

    async def usage_page(self, request: web.Request) -> web.StreamResponse:
        _, _, client = self.signed_in(request)
        days, key, start = self._usage_filters(request)
        context: dict[str, Any] = {"days": days, "key": key, "periods": USAGE_PERIODS}
        try:
            by_day = await client.usage_groups("day", start=start, key=key)
            by_model = await client.usage_groups("model", start=start, key=key)
            by_key = await client.usage_groups("key", start=start, key=key)
        except InferplaneError as exc:
            return await self.platform_error(
                request, exc, "usage.html", charts=None, by_day=[], by_model=[], by_key=[],
                **context,
            )  # fmt: skip
        charts = {
            "day": bar_chart(
                token_bars(by_day), title=f"Tokens per day, last {days} days", unit="tokens",
                chart_id="chart-day",
            ),
            "model": bar_chart(
                token_bars(by_model), title="Tokens per model", unit="tokens",
                chart_id="chart-model",
            ),
            "key": bar_chart(
                token_bars(by_key), title="Tokens per key", unit="tokens", chart_id="chart-key"
            ),
        }  # fmt: skip
        return self.render(
            request,
            "usage.html",
            charts=charts,
            by_day=by_day,
            by_model=by_model,
            by_key=by_key,
            total_tokens=total_tokens,
            **context,
        )

    async def usage_export(self, request: web.Request) -> web.StreamResponse:
        _, _, client = self.signed_in(request)
        days, key, start = self._usage_filters(request)
        try:
            rows = await client.usage_rows(start=start, key=key)
        except InferplaneError as exc:
            return await self.platform_error(request, exc, "error.html")
        name = f"inferplane-usage-{start:%Y%m%d}-{days}d.csv"
        return web.Response(
            text=usage_csv(rows),
            content_type="text/csv",
            charset="utf-8",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )

    # -- deployments, alerts ---------------------------------------------------------------

    async def deployments_page(self, request: web.Request) -> web.StreamResponse:
        """Every deployment's model, phase, replica count and release; for an admin key also
        each replica's node, GPUs and health and the placement explanation (the fleet's
        layout is the operators', not a tenant's: a console key sees the catalogue only)."""
        _, identity, client = self.signed_in(request)
        try:
            views = await client.deployments(placements=identity.is_admin)
        except InferplaneError as exc:
            return await self.platform_error(request, exc, "deployments.html", views=[])
        except grpc.RpcError as exc:  # a raw channel error (the orchestrator unreachable)
            return self.render(
                request, "deployments.html", status=503, views=[],
                error=f"The orchestrator is unreachable: {exc.code().name}",  # type: ignore[attr-defined]
            )  # fmt: skip
        return self.render(request, "deployments.html", views=views)

    async def alerts_page(self, request: web.Request) -> web.StreamResponse:
        """Telemetry's alerts: platform operations, for admin keys only (403 otherwise)."""
        _, identity, client = self.signed_in(request)
        if not identity.is_admin:
            return self.render(
                request, "alerts.html", status=403, alerts=[], include_resolved=False,
                error="Alerts are for platform operators: sign in with an admin key.",
            )  # fmt: skip
        include_resolved = request.query.get("resolved") == "1"
        try:
            alerts = await client.alerts(include_resolved=include_resolved)
        except grpc.RpcError as exc:
            return self.render(
                request, "alerts.html", status=503, alerts=[], include_resolved=include_resolved,
                error=f"Telemetry is unreachable: {exc.code().name}",  # type: ignore[attr-defined]
            )  # fmt: skip
        return self.render(request, "alerts.html", alerts=alerts, include_resolved=include_resolved)

    # -- playground ----------------------------------------------------------------------

    async def playground_page(self, request: web.Request) -> web.StreamResponse:
        self.signed_in(request)
        return self.render(request, "playground.html")

    async def playground_chat(self, request: web.Request) -> web.StreamResponse:
        """Relays a streaming chat completion to the edge with the session's key and streams
        the edge's SSE bytes back unchanged; the key never reaches the browser."""
        session: Session = request[_SESSION_KEY]["session"]
        if session.identity is None:
            return _openai_error(401, "Sign in to the console first.", "invalid_api_key")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _openai_error(400, "The request body is not valid JSON.", "invalid_json")
        if not isinstance(body, dict):
            return _openai_error(400, "The request body must be a JSON object.", "invalid_json")
        body["stream"] = True
        assert self.edge is not None
        url = self.settings.edge_url.rstrip("/") + "/v1/chat/completions"
        headers = {"authorization": f"Bearer {session.identity.api_key}"}
        try:
            upstream = await self.edge.post(url, json=body, headers=headers)
        except aiohttp.ClientError as exc:
            return _openai_error(502, f"The edge is unreachable: {exc}", "edge_unavailable")
        async with upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type or "text/event-stream"
            response.headers["Cache-Control"] = "no-store"
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})


def _openai_error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        },
        status=status,
    )


def _edge_ssl(settings: ConsoleSettings) -> ssl.SSLContext | bool:
    if settings.edge_ca_path is None:
        return True
    return ssl.create_default_context(cafile=str(settings.edge_ca_path))


def server_ssl(settings: ConsoleSettings) -> ssl.SSLContext | None:
    """HTTPS with a client certificate required (mutual TLS: only peers holding a certificate
    of the platform's CA, i.e. the edge, connect), from the identity's files; None in
    plaintext mode."""
    security = settings.security("console")
    if not security.mtls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(security.ca_path))
    context.verify_mode = ssl.CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(security.cert_path), str(security.key_path))
    return context


def build_app(
    settings: ConsoleSettings,
    *,
    platform: Platform | None = None,
    clock: Clock | None = None,
) -> web.Application:
    """The console's aiohttp application (routes under `/console/`).

    Args:
        settings: the console's settings.
        platform: where keys, usage, deployments and alerts come from (default: the SDK at
            the settings' addresses, presenting the settings' identity).
        clock: the sessions' time source (default: the system clock).

    Raises:
        ConfigError: settings that name no identity and are not plaintext.
    """
    if platform is None:
        platform = SdkPlatform(
            auth=settings.auth_address,
            orchestrator=settings.orchestrator_address,
            telemetry=settings.telemetry_address,
            security=settings.security("console"),
            timeout=settings.request_timeout_seconds,
        )
    console = Console(
        settings=settings,
        platform=platform,
        sessions=SessionStore(
            clock or SystemClock(),
            ttl_seconds=settings.session_ttl_seconds,
            max_age_seconds=settings.session_max_age_seconds,
            max_sessions=settings.max_sessions,
        ),
        templates=_templates(),
    )
    app = web.Application(middlewares=[console.middleware], client_max_size=1024 * 1024)
    app[_CONSOLE] = console

    async def on_startup(_: web.Application) -> None:
        console.edge = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=_edge_ssl(settings)),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=900),
        )

    async def on_cleanup(_: web.Application) -> None:
        if console.edge is not None:
            await console.edge.close()
        await console.close_sessions(console.sessions.clear())

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    static = Path(str(resources.files("inferplane.console").joinpath("static")))
    app.add_routes(
        [
            web.get(f"{PREFIX}/", console.index),
            web.get(f"{PREFIX}/healthz", console.health),
            web.get(f"{PREFIX}/sign-in", console.sign_in_page),
            web.post(f"{PREFIX}/sign-in", console.sign_in),
            web.post(f"{PREFIX}/sign-out", console.sign_out),
            web.get(f"{PREFIX}/keys", console.keys_get),
            web.post(f"{PREFIX}/keys", console.key_create),
            web.post(f"{PREFIX}/keys/{{key_id}}/rotate", console.key_rotate),
            web.post(f"{PREFIX}/keys/{{key_id}}/revoke", console.key_revoke),
            web.post(f"{PREFIX}/keys/{{key_id}}/update", console.key_update),
            web.get(f"{PREFIX}/usage", console.usage_page),
            web.get(f"{PREFIX}/usage.csv", console.usage_export),
            web.get(f"{PREFIX}/deployments", console.deployments_page),
            web.get(f"{PREFIX}/alerts", console.alerts_page),
            web.get(f"{PREFIX}/playground", console.playground_page),
            web.post(f"{PREFIX}/playground/chat", console.playground_chat),
            web.static(f"{PREFIX}/static", static),
        ]
    )
    return app


__all__ = ["Console", "FormError", "build_app", "key_from_form"]
