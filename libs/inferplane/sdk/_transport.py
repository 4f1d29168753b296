"""How every SDK call is made: one channel per address (opened on first use, mutual TLS from a
`PeerSecurity`), a deadline per call, retries on UNAVAILABLE for the methods that allow them,
and gRPC errors turned into the platform's error classes (`inferplane.runtime`).

A target may name several servers, comma-separated: the orchestrators on one database, of
which one leads (`inferplane.orchestrator.leadership`). Calls go to one of them; UNAVAILABLE
moves the next call to the next one, and a refusal with reason NOT_LEADER (nothing was done)
is retried there whatever the method, once per server, so calls reach the leader."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Mapping
from typing import Any, TypeVar, cast

import grpc
from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_random_exponential,
)

from inferplane.runtime import (
    ConfigError,
    InferplaneError,
    ServiceSettings,
    UnavailableError,
    error_from_call,
    grpc_options,
)
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.sdk._methods import Method, Req, Resp, Target

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]
_END: Any = object()  # a stream that ended before its first message
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # (missing from grpc-stubs)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Retries of a call that failed with UNAVAILABLE, for methods that may be repeated.

    At most `max_attempts` attempts in all (1: never retry), all within the call's deadline.
    Waits are exponential with full jitter: before retry n, a uniform draw from
    [0, min(max_backoff_seconds, initial_backoff_seconds · 2^(n-1))] (tenacity
    `wait_random_exponential`; "Exponential Backoff And Jitter", AWS Architecture Blog, 2015).
    The channel's reconnect backoff follows the same bounds, so a retry finds a server that
    came back (gRPC's default waits a second, then up to two minutes, before reconnecting).

    Raises:
        ValueError: `max_attempts` below 1, or a negative or inverted backoff.
    """

    max_attempts: int = 4
    initial_backoff_seconds: float = 0.1
    max_backoff_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0 < self.initial_backoff_seconds <= self.max_backoff_seconds:
            raise ValueError("need 0 < initial_backoff_seconds <= max_backoff_seconds")

    def channel_options(self) -> list[tuple[str, Any]]:
        """The platform's channel options (message size limits, keepalive) with this
        policy's reconnect backoff."""
        return [
            *grpc_options(ServiceSettings()),
            ("grpc.initial_reconnect_backoff_ms", round(self.initial_backoff_seconds * 1000)),
            ("grpc.max_reconnect_backoff_ms", round(self.max_backoff_seconds * 1000)),
            ("grpc.primary_user_agent", "inferplane-sdk"),
        ]


def error_from_rpc(exc: grpc.RpcError) -> InferplaneError:
    """The platform's error for a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`:
    both carry code, details and trailing metadata); see `inferplane.runtime.error_from_call`."""
    call = cast(Any, exc)
    code = call.code() if callable(getattr(call, "code", None)) else grpc.StatusCode.UNKNOWN
    details = call.details() if callable(getattr(call, "details", None)) else str(exc)
    trailers = (
        call.trailing_metadata() if callable(getattr(call, "trailing_metadata", None)) else ()
    )
    return error_from_call(code, details or "", dict(trailers or ()))


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoints:
    """What a client talks to: an address per target (None: not configured), the identity it
    presents, and the admin key auth's ApiKeyService asks for (sent to auth only)."""

    addresses: Mapping[Target, str | None]
    security: PeerSecurity
    admin_key: str | None

    def address(self, target: Target) -> str:
        address = self.addresses.get(target)
        if not address:
            raise ConfigError(
                f"no {target.value} address: pass {target.value}='host:port' to the client"
            )
        return address

    def candidates(self, target: Target) -> list[str]:
        """The target's servers (its address split at commas)."""
        return [a.strip() for a in self.address(target).split(",") if a.strip()]

    def metadata(self, target: Target) -> Metadata:
        if target is Target.AUTH and self.admin_key:
            return (("authorization", f"Bearer {self.admin_key}"),)
        return ()


NOT_LEADER = "NOT_LEADER"


def _stop(policy: RetryPolicy, retry: bool, timeout: float, servers: int) -> Any:
    attempts = max(policy.max_attempts, servers) if retry else servers
    return stop_after_attempt(attempts) | stop_before_delay(timeout)


def _wait(policy: RetryPolicy) -> Any:
    return wait_random_exponential(
        multiplier=policy.initial_backoff_seconds, max=policy.max_backoff_seconds
    )


def _retry(retry: bool) -> Any:
    """UNAVAILABLE when the method may be repeated; a NOT_LEADER refusal always."""
    return retry_if_exception(
        lambda exc: isinstance(exc, UnavailableError) and (retry or exc.reason == NOT_LEADER)
    )


class _Servers:
    """The server a target's calls go to now, among its comma-separated addresses."""

    def __init__(self, endpoints: Endpoints) -> None:
        self._endpoints = endpoints
        self._index: dict[Target, int] = {}

    def count(self, target: Target) -> int:
        return len(self._endpoints.candidates(target))

    def current(self, target: Target) -> str:
        servers = self._endpoints.candidates(target)
        return servers[self._index.get(target, 0) % len(servers)]

    def failed(self, target: Target, address: str, exc: InferplaneError) -> None:
        """After UNAVAILABLE from `address`, the target's next call goes to the next one."""
        if isinstance(exc, UnavailableError) and self.current(target) == address:
            self._index[target] = self._index.get(target, 0) + 1


class SyncTransport:
    """Blocking calls over `grpc.Channel`s; safe to share between threads."""

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        timeout: float,
        retry: RetryPolicy,
        sleep: Callable[[float], None],
    ) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self._policy = retry
        self._sleep = sleep
        self._channels: dict[str, grpc.Channel] = {}
        self._servers = _Servers(endpoints)
        self._lock = threading.Lock()
        self._closed = False

    def _channel(self, target: Target) -> tuple[str, grpc.Channel]:
        with self._lock:
            if self._closed:
                raise ConfigError("the client is closed")
            address = self._servers.current(target)
            channel = self._channels.get(address)
            if channel is None:
                channel = self.endpoints.security.channel(address, self._policy.channel_options())
                self._channels[address] = channel
            return address, channel

    def _failed(self, target: Target, address: str, exc: InferplaneError) -> InferplaneError:
        with self._lock:
            self._servers.failed(target, address, exc)
        return exc

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def _attempts(self, target: Target, retry: bool, timeout: float, fn: Callable[[float], T]) -> T:
        """`fn(seconds left)` with retries, all within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        retrying = Retrying(
            retry=_retry(retry),
            stop=_stop(self._policy, retry, timeout, self._servers.count(target)),
            wait=_wait(self._policy),
            sleep=self._sleep,
            reraise=True,
        )
        return retrying(lambda: fn(max(deadline - time.monotonic(), 0.001)))

    def unary(
        self,
        method: Method[Req, Resp],
        request: Req,
        *,
        timeout: float | None = None,
    ) -> Resp:
        """Calls `method`; raises an `InferplaneError` subclass for any non-OK status."""
        metadata = self.endpoints.metadata(method.target)

        def attempt(seconds: float) -> Resp:
            address, channel = self._channel(method.target)
            call = channel.unary_unary(
                method.path,
                request_serializer=method.serialize,
                response_deserializer=method.deserialize,
            )
            try:
                return cast(Resp, call(request, timeout=seconds, metadata=metadata))
            except grpc.RpcError as exc:
                raise self._failed(method.target, address, error_from_rpc(exc)) from exc

        seconds = self.timeout if timeout is None else timeout
        return self._attempts(method.target, method.retry, seconds, attempt)

    def stream(
        self, method: Method[Req, Resp], request: Req, *, timeout: float | None = None
    ) -> Generator[Resp, None, None]:
        """Starts a server stream and returns once its first message arrived (retrying
        UNAVAILABLE until then, when `method` allows it); the iterator yields every message.
        `timeout` covers the whole stream. Closing the iterator cancels the call."""
        metadata = self.endpoints.metadata(method.target)
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds

        def attempt(_left: float) -> tuple[Any, Any]:
            address, channel = self._channel(method.target)
            call = channel.unary_stream(
                method.path,
                request_serializer=method.serialize,
                response_deserializer=method.deserialize,
            )
            responses: Any = call(
                request, timeout=max(deadline - time.monotonic(), 0.001), metadata=metadata
            )
            try:
                return responses, next(responses)
            except StopIteration:
                return responses, _END
            except grpc.RpcError as exc:
                responses.cancel()
                raise self._failed(method.target, address, error_from_rpc(exc)) from exc

        responses, first = self._attempts(method.target, method.retry, seconds, attempt)
        return _rest(responses, first)


def _rest(responses: Any, first: Any) -> Generator[Any, None, None]:
    try:
        if first is _END:
            return
        yield first
        yield from responses
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from exc
    finally:
        responses.cancel()


class AsyncTransport:
    """Calls over `grpc.aio.Channel`s; channels open on first use, on the running loop."""

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        timeout: float,
        retry: RetryPolicy,
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self._policy = retry
        self._sleep = sleep
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._servers = _Servers(endpoints)
        self._closed = False

    def _channel(self, target: Target) -> tuple[str, grpc.aio.Channel]:
        if self._closed:
            raise ConfigError("the client is closed")
        address = self._servers.current(target)
        channel = self._channels.get(address)
        if channel is None:
            channel = self.endpoints.security.aio_channel(address, self._policy.channel_options())
            self._channels[address] = channel
        return address, channel

    def _failed(self, target: Target, address: str, exc: InferplaneError) -> InferplaneError:
        self._servers.failed(target, address, exc)
        return exc

    async def close(self) -> None:
        self._closed = True
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(None)

    async def _attempts(
        self, target: Target, retry: bool, timeout: float, fn: Callable[[float], Awaitable[T]]
    ) -> T:
        deadline = time.monotonic() + timeout
        retrying = AsyncRetrying(
            retry=_retry(retry),
            stop=_stop(self._policy, retry, timeout, self._servers.count(target)),
            wait=_wait(self._policy),
            sleep=self._sleep,
            reraise=True,
        )

        async def attempt() -> T:  # a coroutine function: tenacity awaits only those
            return await fn(max(deadline - time.monotonic(), 0.001))

        return await retrying(attempt)

    async def unary(
        self,
        method: Method[Req, Resp],
        request: Req,
        *,
        timeout: float | None = None,
    ) -> Resp:
        """`SyncTransport.unary` for asyncio."""
        metadata = self.endpoints.metadata(method.target)

        async def attempt(seconds: float) -> Resp:
            address, channel = self._channel(method.target)
            call = channel.unary_unary(
                method.path,
                request_serializer=method.serialize,
                response_deserializer=method.deserialize,
            )
            try:
                return cast(Resp, await call(request, timeout=seconds, metadata=metadata))
            except grpc.RpcError as exc:
                raise self._failed(method.target, address, error_from_rpc(exc)) from exc

        seconds = self.timeout if timeout is None else timeout
        return await self._attempts(method.target, method.retry, seconds, attempt)

    async def stream(
        self, method: Method[Req, Resp], request: Req, *, timeout: float | None = None
    ) -> AsyncGenerator[Resp, None]:
        """`SyncTransport.stream` for asyncio: returns once the first message arrived."""
        metadata = self.endpoints.metadata(method.target)
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds

        async def attempt(_left: float) -> tuple[Any, Any]:
            address, channel = self._channel(method.target)
            call = channel.unary_stream(
                method.path,
                request_serializer=method.serialize,
                response_deserializer=method.deserialize,
            )
            responses: Any = call(
                request, timeout=max(deadline - time.monotonic(), 0.001), metadata=metadata
            )
            try:
                first = await responses.read()
            except grpc.RpcError as exc:
                responses.cancel()
                raise self._failed(method.target, address, error_from_rpc(exc)) from exc
            return responses, _END if first is _EOF else first

        responses, first = await self._attempts(method.target, method.retry, seconds, attempt)
        return _arest(responses, first)


async def _arest(responses: Any, first: Any) -> AsyncGenerator[Any, None]:
    try:
        if first is _END:
            return
        yield first
        while (item := await responses.read()) is not _EOF:
            yield item
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from exc
    finally:
        responses.cancel()
