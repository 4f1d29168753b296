"""The console's plumbing, shared by every page: the `Console` state (settings, platform,
sessions, templates, the edge client), the session/CSRF/security-header middleware, page
rendering, and the answers for refused platform calls and bad form input.

Errors: a refused platform call shows its message on the page with the status the edge would
answer (401 signs the session out); bad form input (`FormError`) answers 400 naming the field;
a POST without the session's CSRF token answers 403.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import jinja2
from aiohttp import web

from inferplane.api.auth.v1 import auth_pb2
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.console.platform import Platform, PlatformSession
from inferplane.console.sessions import (
    COOKIE_NAME,
    Identity,
    Session,
    SessionStore,
    cookie_attributes,
)
from inferplane.console.settings import ConsoleSettings
from inferplane.runtime import InferplaneError, UnauthenticatedError

PREFIX = "/console"
SESSION_KEY = web.RequestKey("session", dict)
"""Per request: `{"session": Session}` (replaced at sign-in) and `"signed_out"` after sign-out."""
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)


class FormError(Exception):
    """Bad form input: answered 400 with the message on the page."""


def uint_field(form: Any, field: str, label: str) -> int:
    """A form field as a whole number from 0 to 2**32 - 1 (empty → 0).

    Raises:
        FormError: anything else, naming the field by `label`.
    """
    raw = str(form.get(field, "") or "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) > 2**32 - 1:
        raise FormError(f"{label} must be a whole number from 0 to {2**32 - 1}, got {raw!r}")
    return int(raw)


def openai_error(status: int, message: str, code: str) -> web.Response:
    """OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`) with `status`."""
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


def templates() -> jinja2.Environment:
    """The page templates (`templates/`, autoescaped, undefined names are errors) with the
    `ts` filter and the `prefix`, `replica_state` and `key_state` globals."""
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
        session: Session = request[SESSION_KEY]["session"]
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
        session: Session = request[SESSION_KEY]["session"]
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
        request[SESSION_KEY] = state
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
        session: Session = request[SESSION_KEY]["session"]
        if session.identity is None or session.client is None:
            raise web.HTTPSeeOther(f"{PREFIX}/sign-in")
        return session, session.identity, session.client
