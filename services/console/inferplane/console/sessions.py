"""Server-side sessions of the web console and their CSRF tokens.

The browser holds only an opaque session id in a cookie (HttpOnly, SameSite=Strict, Secure
under TLS: `cookie_attributes`); the signed-in API key stays here, in memory, and goes to the
platform only from the server (`inferplane.console.platform`). A session expires
`ttl_seconds` after its last use (sliding) and at most `max_age_seconds` after sign-in
(absolute), and is forgotten at sign-out. Sessions do not survive a console restart: users sign
in again (no key is ever written to disk).

CSRF: every session, anonymous ones too (the sign-in form's), carries a random token that
each form POST must echo (`csrf_token` field, or the `x-csrf-token` header for the
playground's fetch), compared in constant time (OWASP's synchronizer token pattern). With the
SameSite=Strict cookie this is defence in depth.
"""

from __future__ import annotations

import dataclasses
import hmac
import secrets
from collections import OrderedDict
from typing import Any

from inferplane.runtime.time.clock import Clock

COOKIE_NAME = "inferplane_console"
_ID_BYTES = 32  # 256-bit session ids and CSRF tokens (unguessable)


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """Who a signed-in session acts for: the key (sent to auth as a bearer token from the
    server only), its tenant ("" for an admin, who sees every tenant), and whether it holds
    the admin scope."""

    api_key: str = dataclasses.field(repr=False)
    tenant: str
    is_admin: bool

    @property
    def label(self) -> str:
        """What the page header shows: never the key."""
        return "admin (all tenants)" if self.is_admin else f"tenant {self.tenant}"


@dataclasses.dataclass(slots=True)
class Session:
    """One browser's session: its id (the cookie's value), CSRF token, identity once signed
    in, and times on the store's monotonic clock (seconds)."""

    session_id: str
    csrf_token: str
    created: float
    last_seen: float
    identity: Identity | None = None
    client: Any = None  # the platform client opened for `identity` (closed with the session)
    # A created or rotated key's secret, shown by the next page and dropped there (Post /
    # Redirect / Get: a reload never repeats the create, and the secret is in one page only).
    flash: Any = dataclasses.field(default=None, repr=False)

    def csrf_ok(self, presented: str | None) -> bool:
        """Whether `presented` is this session's CSRF token (constant-time comparison)."""
        return bool(presented) and hmac.compare_digest(
            self.csrf_token.encode(), str(presented).encode()
        )


class SessionStore:
    """In-memory sessions, least recently used evicted first beyond `max_sessions`.

    Args:
        clock: the time source (monotonic seconds decide expiry).
        ttl_seconds: idle time after which a session is gone (sliding expiry).
        max_age_seconds: time after creation after which a session is gone, used or not.
        max_sessions: sessions kept at most (anonymous ones included); the least recently
            used goes first.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        ttl_seconds: float = 1800.0,
        max_age_seconds: float = 12 * 3600.0,
        max_sessions: int = 10_000,
    ) -> None:
        if ttl_seconds <= 0 or max_age_seconds <= 0 or max_sessions < 1:
            raise ValueError("ttl_seconds, max_age_seconds and max_sessions must be positive")
        self._clock = clock
        self._ttl = ttl_seconds
        self._max_age = max_age_seconds
        self._max = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def new(self) -> tuple[Session, list[Session]]:
        """A fresh anonymous session, and the sessions evicted to make room (their clients
        must be closed by the caller)."""
        now = self._clock.monotonic()
        session = Session(
            secrets.token_urlsafe(_ID_BYTES), secrets.token_urlsafe(_ID_BYTES), now, now
        )
        self._sessions[session.session_id] = session
        evicted = []
        while len(self._sessions) > self._max:
            evicted.append(self._sessions.popitem(last=False)[1])
        return session, evicted

    def get(self, session_id: str | None) -> tuple[Session | None, list[Session]]:
        """The live session of `session_id` (its idle timer restarted), or None; and the
        expired sessions removed on the way (the caller closes their clients)."""
        expired = self.expire()
        if not session_id:
            return None, expired
        session = self._sessions.get(session_id)
        if session is None:
            return None, expired
        session.last_seen = self._clock.monotonic()
        self._sessions.move_to_end(session_id)
        return session, expired

    def sign_in(self, session: Session, identity: Identity, client: Any) -> Session:
        """A new session for `identity` replacing `session` (a new id and CSRF token at
        sign-in, so an id planted before sign-in is worthless: session fixation)."""
        self._sessions.pop(session.session_id, None)
        fresh, _ = self.new()
        fresh.identity = identity
        fresh.client = client
        return fresh

    def drop(self, session: Session) -> None:
        """Forgets `session` (sign-out)."""
        self._sessions.pop(session.session_id, None)

    def clear(self) -> list[Session]:
        """Forgets every session and returns them (shutdown: the caller closes clients)."""
        gone = list(self._sessions.values())
        self._sessions.clear()
        return gone

    def expire(self) -> list[Session]:
        """Removes and returns every session idle longer than the TTL or older than the
        maximum age."""
        now = self._clock.monotonic()
        gone = [
            s
            for s in self._sessions.values()
            if now - s.last_seen >= self._ttl or now - s.created >= self._max_age
        ]
        for s in gone:
            del self._sessions[s.session_id]
        return gone


def cookie_attributes(*, secure: bool, max_age_seconds: float) -> dict[str, Any]:
    """The session cookie's attributes for aiohttp's `set_cookie`: HttpOnly (no script reads
    it), SameSite=Strict (no cross-site request carries it), Path=/console/, Secure when the
    console is reached over HTTPS."""
    return {
        "httponly": True,
        "samesite": "Strict",
        "secure": secure,
        "path": "/console/",
        "max_age": int(max_age_seconds),
    }
