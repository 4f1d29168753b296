"""The web console (issue 21): aiohttp serving server-rendered pages under `/console/`.

Composition root: `build_app(settings, platform=..., clock=...)` builds the `Console`
(`web.py`: sessions, CSRF, rendering) and routes each page to its area in `pages/`: sign-in,
API keys (create with the secret shown once, scopes, model allow-list, limits, rotate,
revoke), usage (SVG charts per day, per model and per key; CSV export), deployments
(replicas, placement and its explanation, health, release progress), playground (streaming
chat through the edge) and alerts. Every platform call acts for the signed-in key
(`inferplane.console.platform`), so auth decides what the page may show. Every asset is
served from `static/` (no CDN), and the Content-Security-Policy allows nothing else.

Errors: a refused platform call shows its message on the page with the status the edge would
answer (401 signs the session out); bad form input answers 400 naming the field; the
playground's JSON endpoint answers OpenAI's error shape.
"""

from __future__ import annotations

import ssl
from importlib import resources
from pathlib import Path

import aiohttp
from aiohttp import web

from inferplane.console.pages.fleet import FleetPages
from inferplane.console.pages.keys import KeyPages
from inferplane.console.pages.playground import PlaygroundPages
from inferplane.console.pages.sign_in import SignInPages
from inferplane.console.pages.usage import UsagePages
from inferplane.console.platform import Platform, SdkPlatform
from inferplane.console.sessions import SessionStore
from inferplane.console.settings import ConsoleSettings
from inferplane.console.web import PREFIX, Console, templates
from inferplane.runtime.time.clock import Clock, SystemClock

_CONSOLE = web.AppKey("console", object)


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


async def health(request: web.Request) -> web.StreamResponse:
    """`healthz`: `{"status": "ok"}` while the process serves."""
    return web.json_response({"status": "ok"})


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
            usage_regions=settings.usage_regions,
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
        templates=templates(),
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
    sign_in = SignInPages(console)
    keys = KeyPages(console)
    usage = UsagePages(console)
    fleet = FleetPages(console)
    playground = PlaygroundPages(console)
    app.add_routes(
        [
            web.get(f"{PREFIX}/", sign_in.index),
            web.get(f"{PREFIX}/healthz", health),
            web.get(f"{PREFIX}/sign-in", sign_in.sign_in_page),
            web.post(f"{PREFIX}/sign-in", sign_in.sign_in),
            web.post(f"{PREFIX}/sign-out", sign_in.sign_out),
            web.get(f"{PREFIX}/keys", keys.keys_get),
            web.post(f"{PREFIX}/keys", keys.key_create),
            web.post(f"{PREFIX}/keys/{{key_id}}/rotate", keys.key_rotate),
            web.post(f"{PREFIX}/keys/{{key_id}}/revoke", keys.key_revoke),
            web.post(f"{PREFIX}/keys/{{key_id}}/update", keys.key_update),
            web.get(f"{PREFIX}/usage", usage.usage_page),
            web.get(f"{PREFIX}/usage.csv", usage.usage_export),
            web.get(f"{PREFIX}/deployments", fleet.deployments_page),
            web.get(f"{PREFIX}/alerts", fleet.alerts_page),
            web.get(f"{PREFIX}/playground", playground.playground_page),
            web.post(f"{PREFIX}/playground/chat", playground.playground_chat),
            web.static(f"{PREFIX}/static", static),
        ]
    )
    return app


__all__ = ["build_app", "server_ssl"]
