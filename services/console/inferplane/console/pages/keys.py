"""The API keys page: list (optionally inactive keys too), create, edit, rotate, revoke.

The secret of a created or rotated key is shown once: it waits in the server-side session for
the one keys page that follows the redirect (Post/Redirect/Get), never in a URL or cookie.
Auth decides what the signed-in key may do; its refusals are shown with the edge's status.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from inferplane.api.auth.v1 import auth_pb2
from inferplane.console.sessions import Identity
from inferplane.console.web import PREFIX, Console, FormError, uint_field
from inferplane.runtime import InferplaneError

SCOPES = ("inference", "console", "admin")
LIMIT_FIELDS = (
    ("requests_per_minute", "requests per minute"),
    ("tokens_per_minute", "tokens per minute"),
    ("max_concurrent_requests", "concurrent requests"),
    ("monthly_token_budget", "monthly token budget"),
)
"""The `Limits` fields the forms set, with their labels."""

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
        limits=auth_pb2.Limits(**{f: uint_field(form, f, label) for f, label in LIMIT_FIELDS}),
    )
    days = uint_field(form, "expire_days", "expiry (days)")
    if days:
        key.expire_time.FromDatetime(datetime.now(UTC) + timedelta(days=days))
    return key


class KeyPages:
    """`keys` (GET list, POST create) and `keys/{key_id}/{rotate,update,revoke}` (POST)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    async def keys_page(
        self,
        request: web.Request,
        *,
        created: Any = None,
        status: int = 200,
        error: str | None = None,
    ) -> web.StreamResponse:
        _, _, client = self.console.signed_in(request)
        show_inactive = request.query.get("inactive") == "1"
        try:
            keys = await client.list_keys(show_inactive=show_inactive)
        except InferplaneError as exc:
            return await self.console.platform_error(
                request, exc, "keys.html", keys=[], created=None, show_inactive=show_inactive,
                scopes=SCOPES, limit_fields=LIMIT_FIELDS,
            )  # fmt: skip
        return self.console.render(
            request,
            "keys.html",
            status=status,
            error=error,
            keys=keys,
            created=created,
            show_inactive=show_inactive,
            scopes=SCOPES,
            limit_fields=LIMIT_FIELDS,
        )

    async def keys_get(self, request: web.Request) -> web.StreamResponse:
        session, _, _ = self.console.signed_in(request)
        created, session.flash = session.flash, None
        return await self.keys_page(request, created=created)

    async def key_create(self, request: web.Request) -> web.StreamResponse:
        _, identity, client = self.console.signed_in(request)
        try:
            key = key_from_form(await request.post(), identity)
            made = await client.create_key(key)
        except FormError as exc:
            return await self.keys_page(request, status=400, error=str(exc))
        except InferplaneError as exc:
            return await self.keys_page(request, status=exc.http_status, error=exc.message)
        return self._show_once(request, made)

    async def key_rotate(self, request: web.Request) -> web.StreamResponse:
        _, _, client = self.console.signed_in(request)
        form = await request.post()
        try:
            grace = uint_field(form, "grace_period_seconds", "grace period (seconds)")
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
        session, _, _ = self.console.signed_in(request)
        session.flash = made
        raise web.HTTPSeeOther(f"{PREFIX}/keys")

    async def key_update(self, request: web.Request) -> web.StreamResponse:
        """Sets a key's name, scopes, model allow-list and limits (the edit form); auth
        refuses what the signed-in key may not change."""
        _, identity, client = self.console.signed_in(request)
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
        _, _, client = self.console.signed_in(request)
        try:
            await client.revoke_key(request.match_info["key_id"])
        except InferplaneError as exc:
            return await self.keys_page(request, status=exc.http_status, error=exc.message)
        raise web.HTTPSeeOther(f"{PREFIX}/keys")
