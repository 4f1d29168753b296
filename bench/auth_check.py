"""ext_authz `Check` latency with and without per-key limits (issue 6: limits must not add more
than 1 ms at p50 to a request).

Starts the auth service (SQLite in a temp dir unless `--database-url`, the `sql` counter store
every instance shares) on loopback, creates four keys (no limits; requests + tokens per
minute; concurrent requests; all three), then calls Check for each key in turn, interleaved,
so that every kind sees the same machine load:

- in-process: `Authorization.Check` awaited on the server's event loop (what auth itself
  spends: key cache hit, limits, response building; includes the worker-thread hop);
- gRPC: the same request over loopback through a sync stub (what Envoy waits for).

After each Check the request's concurrency lease is released the way the router's usage
report does (`RateLimiter.record_usage`, not timed), so leases stay at one per key.
Prints p50/p99 in microseconds per kind and path and the p50 added by limits; last line
`check_p50_us_with_limits: X` (in-process, all three limits). Run:
`.venv/bin/python bench/auth_check.py [--rounds 2000] [--database-url URL]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc

from inferplane.api.auth.v1 import auth_pb2, auth_pb2_grpc
from inferplane.auth.app import build_components
from inferplane.auth.ext_authz import Authorization
from inferplane.auth.settings import AuthSettings
from inferplane.runtime import RunningServer
from inferplane.testing.loop import LoopThread

RUN_TIMEOUT_S = 60.0
"""How long one coroutine on the server's loop may take (a full in-process round)."""
ADMIN_KEY = "bench-bootstrap-admin-key-0123456789abcdef"
KINDS: dict[str, dict[str, int]] = {
    "no_limits": {},
    "rpm_tpm": {"requests_per_minute": 10**9, "tokens_per_minute": 10**9},
    "concurrency": {"max_concurrent_requests": 10**6},
    "all_limits": {
        "requests_per_minute": 10**9,
        "tokens_per_minute": 10**9,
        "max_concurrent_requests": 10**6,
    },
}


def check_request(secret: str, request_id: str) -> external_auth_pb2.CheckRequest:
    http = attribute_context_pb2.AttributeContext.HttpRequest(
        path="/v1/chat/completions",
        method="POST",
        headers={
            ":path": "/v1/chat/completions",
            ":method": "POST",
            "authorization": f"Bearer {secret}",
            "x-request-id": request_id,
            "content-type": "application/json",
        },
    )
    return external_auth_pb2.CheckRequest(
        attributes=attribute_context_pb2.AttributeContext(
            request=attribute_context_pb2.AttributeContext.Request(http=http)
        )
    )


def pct(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100)[q - 1] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2000, help="in-process Checks per kind")
    parser.add_argument("--grpc-rounds", type=int, default=600, help="gRPC Checks per kind")
    parser.add_argument("--database-url", default="", help="default: SQLite in a temp dir")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ip-auth-bench-") as tmp:
        settings = AuthSettings(
            host="127.0.0.1",
            port=0,
            data_dir=Path(tmp),
            database_url=args.database_url,
            bootstrap_admin_key=ADMIN_KEY,
            grace_period_seconds=0.5,
            json_logs=False,
            log_level="warning",
        )
        components = build_components(settings)
        assert components.limiter is not None
        limiter = components.limiter
        loop = LoopThread()

        async def start() -> RunningServer:
            server = RunningServer(components.app(), settings)
            await server.start()
            return server

        server = loop.run(start(), RUN_TIMEOUT_S)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            keys = auth_pb2_grpc.ApiKeyServiceStub(channel)
            secrets: dict[str, tuple[str, str]] = {}
            for kind, limits in KINDS.items():
                created = keys.CreateApiKey(
                    auth_pb2.CreateApiKeyRequest(
                        api_key=auth_pb2.ApiKey(
                            tenant="bench", scopes=["inference"], limits=auth_pb2.Limits(**limits)
                        )
                    ),
                    metadata=(("authorization", f"Bearer {ADMIN_KEY}"),),
                )
                secrets[kind] = (created.secret, created.api_key.name.split("/")[1])
            authz = Authorization(components.verifier, limiter)
            counter = iter(range(10**9))

            async def in_process(rounds: int) -> dict[str, list[float]]:
                out: dict[str, list[float]] = {k: [] for k in KINDS}
                for _ in range(rounds):
                    for kind, (secret, key_id) in secrets.items():
                        rid = f"req-{next(counter)}"
                        request = check_request(secret, rid)
                        start = time.perf_counter()
                        response = await authz.Check(request, None)
                        out[kind].append(time.perf_counter() - start)
                        assert response.status.code == 0, response
                        await limiter.record_usage(key_id, rid, 0)
                return out

            def over_grpc(rounds: int) -> dict[str, list[float]]:
                stub = external_auth_pb2_grpc.AuthorizationStub(channel)
                out: dict[str, list[float]] = {k: [] for k in KINDS}
                for _ in range(rounds):
                    for kind, (secret, key_id) in secrets.items():
                        rid = f"req-{next(counter)}"
                        request = check_request(secret, rid)
                        start = time.perf_counter()
                        response = stub.Check(request, timeout=5)
                        out[kind].append(time.perf_counter() - start)
                        assert response.status.code == 0, response
                        loop.run(limiter.record_usage(key_id, rid, 0), RUN_TIMEOUT_S)
                return out

            loop.run(in_process(200), RUN_TIMEOUT_S)  # warm-up: caches, statement compilation, pool
            local = loop.run(in_process(args.rounds), RUN_TIMEOUT_S)
            over_grpc(100)
            remote = over_grpc(args.grpc_rounds)
        finally:
            channel.close()
            loop.run(server.stop(), RUN_TIMEOUT_S)
            loop.close()

    where = args.database_url.split("://", 1)[0] if args.database_url else "sqlite (temp file)"
    print(f"Check latency, counter store: {where}; {args.rounds} / {args.grpc_rounds} per kind")
    print(f"{'kind':<12} {'in-process p50':>15} {'p99':>8} {'gRPC p50':>10} {'p99':>8}  (µs)")
    for kind in KINDS:
        print(
            f"{kind:<12} {pct(local[kind], 50):>15.0f} {pct(local[kind], 99):>8.0f} "
            f"{pct(remote[kind], 50):>10.0f} {pct(remote[kind], 99):>8.0f}"
        )
    base_local, base_remote = pct(local["no_limits"], 50), pct(remote["no_limits"], 50)
    for kind in list(KINDS)[1:]:
        print(
            f"added_p50_us_{kind}: in-process {pct(local[kind], 50) - base_local:.0f}, "
            f"gRPC {pct(remote[kind], 50) - base_remote:.0f}"
        )
    print(f"check_p50_us_with_limits: {pct(local['all_limits'], 50):.0f}")


if __name__ == "__main__":
    main()
