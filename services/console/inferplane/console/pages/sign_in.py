"""Sign-in and sign-out: an API key with the `admin` or `console` scope opens a session.

The key is checked through the platform (`PlatformSession.identify`); a key auth refuses
answers 401, one without either scope 403, an unreachable platform 503. A successful sign-in
gives the session a new id (`SessionStore.sign_in`) and redirects to the keys page.
"""

from __future__ import annotations

import structlog
from aiohttp import web

from inferplane.console.sessions import Session
from inferplane.console.web import PREFIX, SESSION_KEY, Console
from inferplane.runtime import InferplaneError

log = structlog.get_logger("inferplane.console")


class SignInPages:
    """`/console/` (redirect), `sign-in` (GET form, POST key), `sign-out` (POST)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    async def index(self, request: web.Request) -> web.StreamResponse:
        session: Session = request[SESSION_KEY]["session"]
        raise web.HTTPSeeOther(f"{PREFIX}/keys" if session.identity else f"{PREFIX}/sign-in")

    async def sign_in_page(self, request: web.Request) -> web.StreamResponse:
        notice = "Your session ended: sign in again." if request.query.get("expired") else None
        return self.console.render(request, "sign_in.html", notice=notice)

    async def sign_in(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        api_key = str(form.get("api_key", "")).strip()
        if not api_key:
            return self.console.render(
                request, "sign_in.html", status=400, error="Enter an API key.", notice=None
            )
        client = self.console.platform.open(api_key)
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
            return self.console.render(
                request, "sign_in.html", status=status, error=message, notice=None
            )
        state = request[SESSION_KEY]
        state["session"] = self.console.sessions.sign_in(state["session"], identity, client)
        log.info("console_sign_in", admin=identity.is_admin, tenant=identity.tenant)
        raise web.HTTPSeeOther(f"{PREFIX}/keys")

    async def sign_out(self, request: web.Request) -> web.StreamResponse:
        state = request[SESSION_KEY]
        session: Session = state["session"]
        await self.console.close_sessions([session])
        self.console.sessions.drop(session)
        state["signed_out"] = True
        raise web.HTTPSeeOther(f"{PREFIX}/sign-in")
