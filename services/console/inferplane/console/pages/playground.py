"""The playground: a chat page whose script (`static/playground.js`) posts to `playground/chat`,
which relays a streaming chat completion to the edge's `/v1/chat/completions` with the
session's key and streams the edge's SSE bytes back unchanged (the key never reaches the
browser).

Errors of the relay, in OpenAI's shape: 401 `invalid_api_key` (not signed in), 400
`invalid_json` (a body that is not a JSON object), 502 `edge_unavailable`; the edge's own
error answers pass through with its status.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web

from inferplane.console.sessions import Session
from inferplane.console.web import SESSION_KEY, Console, openai_error


class PlaygroundPages:
    """`playground` (GET, the page) and `playground/chat` (POST, the relay)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    async def playground_page(self, request: web.Request) -> web.StreamResponse:
        self.console.signed_in(request)
        return self.console.render(request, "playground.html")

    async def playground_chat(self, request: web.Request) -> web.StreamResponse:
        """Relays a streaming chat completion to the edge with the session's key and streams
        the edge's SSE bytes back unchanged; the key never reaches the browser."""
        session: Session = request[SESSION_KEY]["session"]
        if session.identity is None:
            return openai_error(401, "Sign in to the console first.", "invalid_api_key")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return openai_error(400, "The request body is not valid JSON.", "invalid_json")
        if not isinstance(body, dict):
            return openai_error(400, "The request body must be a JSON object.", "invalid_json")
        body["stream"] = True
        assert self.console.edge is not None
        url = self.console.settings.edge_url.rstrip("/") + "/v1/chat/completions"
        headers = {"authorization": f"Bearer {session.identity.api_key}"}
        try:
            upstream = await self.console.edge.post(url, json=body, headers=headers)
        except aiohttp.ClientError as exc:
            return openai_error(502, f"The edge is unreachable: {exc}", "edge_unavailable")
        async with upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type or "text/event-stream"
            response.headers["Cache-Control"] = "no-store"
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
