"""Junk keys and revocations against the picker's key table (issue 28): the picker
authenticates a request from the table auth streams every router, so a flood of made-up keys
never reaches auth or its database, and a revoked key stops working on every router at once.

    .venv/bin/python bench/auth_flood.py [--routers 3] [--flood-seconds 10] [--concurrency 32]
                                         [--revocations 20] [--skip-flood] [--skip-revocation]

Starts the local stack (kimi-tiny, mutual TLS, `--routers` router processes, each watching
auth's key table; Envoy spreads requests over all of them), then:

1. **Flood.** `--flood-seconds` of streaming chat requests through the edge, each with a fresh
   random key of our own format (`ip-` + 43 base64url characters: well formed, so it is looked
   up, and unknown), `--concurrency` at a time over keep-alive connections, each opened from
   its own loopback address and replaced after 20 requests (the edge's `auth_failure_guard`
   turns an address away with 429 after 30 refusals in 10 s, without asking the picker: a
   real attacker's single address costs the picker 30 refusals per window). Printed: the
   status codes (all must be 401 `invalid_api_key`), refusals per second, and CPU µs per
   refusal of the routers (all their threads, /proc schedstat), Envoy and auth, each less its
   idle rate measured for 3 s before over the same wall time; then whether auth was touched:
   its finished RPCs by method (`inferplane_grpc_server_handled_total`; the key table watch
   is one open stream and finishes none) and its data directory's files (size, mtime).
2. **Revocation.** `--revocations` times: a new key is created through ApiKeyService (the
   admin SDK), and each router is asked, every `--poll-ms`, whether it takes the key: one
   ext_proc stream per poll on the router's own picker port, presenting the edge's
   certificate and sending the request headers the edge sends (the picker's real first
   exchange; the answer is the table's: a continue, or an immediate 401). Once every router
   takes it, the key is revoked and the polls go on until every router refuses it; the time
   from the revoke call to each router's first refusal is recorded (so the revoke RPC itself
   is included), then the edge is asked too (it must answer 401). Printed: a row per
   revocation, the creation and revocation propagation p50 / p99 over all routers, and last

       revocation_seconds_p99: X   (p99 over revocations of the slowest router; goal ≤ 1)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import secrets
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from envoy.config.core.v3 import base_pb2 as core_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from inferplane.api.auth.v1 import auth_pb2
from inferplane.localstack import EDGE_PROCESS, MODEL_NAME, Stack, StackConfig
from inferplane.runtime.processes.ports import free_port, free_port_run
from inferplane.runtime.security.identity import EDGE
from inferplane.sdk import AsyncClient

#: The chat body every flood request carries (never read: the key is refused first).
BODY = json.dumps(
    {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "max_tokens": 16,
        "stream": True,
    }
).encode()
#: The path the edge's listener serves chat on (before any transcoding).
CHAT_PATH = "/v1/chat/completions"


def log(message: str) -> None:
    print(f"# {message}", flush=True)


def junk_key() -> str:
    """A well-formed key no one issued (our format: `ip-` + 32 random bytes, base64url)."""
    return "ip-" + secrets.token_urlsafe(32)


def cpu_seconds(pid: int) -> float:
    """CPU time (s) of every thread of `pid` (schedstat: nanoseconds)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def handled_rpcs(metrics_url: str) -> dict[str, float]:
    """`inferplane_grpc_server_handled_total` of one service, summed per method."""
    out: dict[str, float] = collections.defaultdict(float)
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("inferplane_grpc_server_handled_total{"):
                labels, _, value = line.rpartition(" ")
                method = labels.split('grpc_method="', 1)[1].split('"', 1)[0]
                service = labels.split('grpc_service="', 1)[1].split('"', 1)[0]
                out[f"{service.rsplit('.', 1)[-1]}/{method}"] += float(value)
    return dict(out)


def files_state(folder: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime ns) of every file under `folder` (auth's database and its journal)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def stack_config(data_dir: Path, routers: int) -> StackConfig:
    return StackConfig(
        data_dir=data_dir,
        http_port=free_port(),
        grpc_base_port=free_port_run(5 + routers),
        metrics_base_port=free_port_run(5 + routers),
        envoy_admin_port=free_port(),
        routers=routers,
    )


# -- 1. the flood ----------------------------------------------------------------------------


@dataclasses.dataclass
class FloodResult:
    statuses: collections.Counter[int]
    codes: collections.Counter[str]
    wall: float
    cpu_us: dict[str, float]  # process group → CPU µs per refusal, idle subtracted
    idle_rate: dict[str, float]  # process group → idle CPU s per s
    client_cpu_s: float
    auth_rpcs: dict[str, float]  # auth's finished RPCs by method during the flood
    auth_files: list[str]  # files of auth's data directory that changed during it


def process_groups(stack: Stack) -> dict[str, list[int]]:
    routers = [stack.processes[r].proc for r in stack.config.router_names]
    auth = stack.processes["auth"].proc
    assert auth is not None and all(p is not None for p in routers)
    assert stack.edge is not None and stack.edge.pid is not None
    return {
        "routers": [p.pid for p in routers if p is not None],
        "envoy": [stack.edge.pid],
        "auth": [auth.pid],
    }


def group_cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in groups.items()}


class Connection:
    """One keep-alive HTTP/1.1 connection to the edge from its own loopback address (the
    edge's `auth_failure_guard` counts 401s per client address: 30 in 10 s, then 429 without
    asking the picker; the flood spreads over addresses so that the picker's refusal is what
    is measured, each address used for fewer requests than that)."""

    PER_ADDRESS = 20

    def __init__(self, host: str, port: int, addresses: Iterator[str]) -> None:
        self.host, self.port, self.addresses = host, port, addresses
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.used = 0

    async def _open(self) -> None:
        await self.close()
        self.reader, self.writer = await asyncio.open_connection(
            self.host, self.port, local_addr=(next(self.addresses), 0)
        )
        self.used = 0

    async def post(self, path: str, key: str) -> tuple[int, bytes]:
        """Sends one chat request with `key`; (status, body); status 0 on a broken
        connection."""
        if self.writer is None or self.used >= self.PER_ADDRESS:
            await self._open()
        assert self.reader is not None and self.writer is not None
        self.used += 1
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(BODY)}\r\n\r\n"
        )
        try:
            self.writer.write(head.encode() + BODY)
            status_line = await self.reader.readuntil(b"\r\n")
            headers = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            length = 0
            for line in headers.split("\r\n"):
                name, _, value = line.partition(":")
                if name == "content-length":
                    length = int(value)
            body = await self.reader.readexactly(length) if length else b""
            if "connection: close" in headers:
                await self.close()
            return int(status_line.split()[1]), body
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            await self.close()
            return 0, b""

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None


def loopback_addresses() -> Iterator[str]:
    """127.1.0.1, 127.1.0.2, ... (65,534 addresses, then again)."""
    while True:
        for n in range(1, 65535):
            yield f"127.1.{n >> 8}.{n & 255}"


async def flood(stack: Stack, seconds: float, concurrency: int) -> FloodResult:
    groups = process_groups(stack)
    auth_dir = stack.config.data_dir / "auth"
    metrics = f"http://127.0.0.1:{stack.config.metrics_ports['auth']}/metrics"
    idle_before = group_cpu(groups)
    await asyncio.sleep(3.0)
    idle_rate = {k: (v - idle_before[k]) / 3.0 for k, v in group_cpu(groups).items()}
    host = stack.config.host_address(EDGE_PROCESS)
    path = "/v1/chat/completions"
    statuses: collections.Counter[int] = collections.Counter()
    codes: collections.Counter[str] = collections.Counter()
    addresses = loopback_addresses()
    connections = [Connection(host, stack.config.http_port, addresses) for _ in range(concurrency)]

    async def worker(connection: Connection, deadline: float) -> None:
        while time.monotonic() < deadline:
            status, payload = await connection.post(path, junk_key())
            statuses[status] += 1
            try:
                codes[json.loads(payload)["error"]["code"]] += 1
            except (ValueError, KeyError, TypeError):
                codes[f"{status} without an error code"] += 1

    try:
        # One short round first: connections open, Envoy and the routers warm.
        await asyncio.gather(*(worker(c, time.monotonic() + 1.0) for c in connections))
        statuses.clear()
        codes.clear()
        rpcs_before, files_before = handled_rpcs(metrics), files_state(auth_dir)
        before = group_cpu(groups)
        client_before = time.process_time()
        started = time.monotonic()
        deadline = started + seconds
        await asyncio.gather(*(worker(c, deadline) for c in connections))
        wall = time.monotonic() - started
        client_cpu = time.process_time() - client_before
        after = group_cpu(groups)
        rpcs_after, files_after = handled_rpcs(metrics), files_state(auth_dir)
    finally:
        for connection in connections:
            await connection.close()
    refused = max(1, statuses[401])
    cpu_us = {
        k: max(0.0, after[k] - before[k] - idle_rate[k] * wall) * 1e6 / refused for k in groups
    }
    rpcs = {m: n - rpcs_before.get(m, 0.0) for m, n in rpcs_after.items()}
    changed = [f for f in files_after if files_after[f] != files_before.get(f)]
    return FloodResult(statuses, codes, wall, cpu_us, idle_rate, client_cpu, rpcs, changed)


# -- 2. revocation -----------------------------------------------------------------------------


class Probe:
    """Asks one router's picker, as the edge would, whether it takes a key: the first
    message of an ext_proc stream (the request headers), over mTLS as the edge."""

    def __init__(self, stack: Stack, router: str) -> None:
        self.name = router
        self.authority = f"127.0.0.1:{stack.config.http_port}"
        address = stack.config.address(router)
        self.channel = stack.config.security.named(EDGE).aio_channel(address)
        self.stub = ext_grpc.ExternalProcessorStub(self.channel)

    def headers(self, secret: str) -> ext_pb.HttpHeaders:
        pairs = (
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", self.authority),
            (":path", CHAT_PATH),
            ("content-type", "application/json"),
            ("authorization", f"Bearer {secret}"),
            ("x-request-id", secrets.token_hex(8)),
        )
        return ext_pb.HttpHeaders(
            headers=core_pb.HeaderMap(
                headers=[core_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            ),
            end_of_stream=False,
        )

    async def verdict(self, secret: str) -> str:
        """`accepted` (the picker continues to the body), `refused` (an immediate 401) or
        what else it answered."""
        call = self.stub.Process(timeout=5)
        try:
            await call.write(ext_pb.ProcessingRequest(request_headers=self.headers(secret)))
            response = await call.read()
        finally:
            call.cancel()
        if response is None or not isinstance(response, ext_pb.ProcessingResponse):
            return "stream ended"
        if response.HasField("immediate_response"):
            code = response.immediate_response.status.code
            return "refused" if code == 401 else f"immediate {code}"
        if response.HasField("request_headers"):
            return "accepted"
        return response.WhichOneof("response") or "empty"

    async def close(self) -> None:
        await self.channel.close(None)


async def wait_for(
    probes: list[Probe], secret: str, want: str, started: float, poll: float, timeout: float
) -> dict[str, float]:
    """Polls every router until each answers `want`; seconds from `started` to each one's
    first such answer.

    Raises:
        TimeoutError: a router did not within `timeout` (its last answer in the message).
    """
    seen: dict[str, float] = {}
    last: dict[str, str] = {}
    while len(seen) < len(probes):
        waiting = [p for p in probes if p.name not in seen]
        answers = await asyncio.gather(
            *(p.verdict(secret) for p in waiting), return_exceptions=True
        )
        now = time.monotonic()
        for probe, answer in zip(waiting, answers, strict=True):
            last[probe.name] = repr(answer) if isinstance(answer, BaseException) else answer
            if answer == want:
                seen[probe.name] = now - started
        if now - started > timeout and len(seen) < len(probes):
            raise TimeoutError(f"not {want} after {timeout:g} s: {last}")
        await asyncio.sleep(poll)
    return seen


async def edge_status(stack: Stack, secret: str) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{stack.config.base_url}/chat/completions",
            data=BODY,
            headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
        ) as response,
    ):
        await response.read()
        return response.status


@dataclasses.dataclass
class Revocation:
    created: dict[str, float]
    revoke_rpc: float
    revoked: dict[str, float]
    edge_status: int


async def revocations(stack: Stack, count: int, poll: float) -> list[Revocation]:
    cfg = stack.config
    probes = [Probe(stack, r) for r in cfg.router_names]
    out: list[Revocation] = []
    try:
        async with AsyncClient(
            auth=cfg.address("auth"), security=cfg.security, admin_key=stack.admin_key, timeout=10
        ) as client:
            for i in range(count):
                key = auth_pb2.ApiKey(
                    display_name=f"auth-flood-{i}", tenant="local", scopes=["inference"]
                )
                made = await client.keys.create(key)
                created = await wait_for(
                    probes, made.secret, "accepted", time.monotonic(), poll, 30.0
                )
                started = time.monotonic()
                await client.keys.revoke(made.api_key.name)
                rpc = time.monotonic() - started
                revoked = await wait_for(probes, made.secret, "refused", started, poll, 30.0)
                status = await edge_status(stack, made.secret)
                out.append(Revocation(created, rpc, revoked, status))
                log(
                    f"revocation {i + 1}: revoke RPC {rpc * 1000:.0f} ms, refused by "
                    + ", ".join(f"{r} {s * 1000:.0f} ms" for r, s in sorted(revoked.items()))
                    + f"; edge {status}"
                )
    finally:
        for probe in probes:
            await probe.close()
    return out


# -- report ------------------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def report_flood(result: FloodResult) -> None:
    refused = result.statuses[401]
    print(f"\nflood: {sum(result.statuses.values())} requests in {result.wall:.1f} s")
    print(f"  status codes: {dict(sorted(result.statuses.items()))}")
    print(f"  error codes: {dict(result.codes)}")
    print(f"  client CPU {result.client_cpu_s / result.wall * 100:.0f}% of a core")
    for group, us in result.cpu_us.items():
        idle = result.idle_rate[group] * 100
        print(f"  {group}: {us:.0f} µs CPU per refusal (idle {idle:.1f}% of a core subtracted)")
    changed = {m: n for m, n in result.auth_rpcs.items() if n}
    files = result.auth_files
    print(f"  auth RPCs finished during the flood: {changed or 'none'}")
    print(f"  auth's data directory: {'changed: ' + ', '.join(files) if files else 'unchanged'}")
    print(f"junk_key_refusals_per_s: {refused / result.wall:.0f}")
    print(f"picker_cpu_us_per_refusal: {result.cpu_us['routers']:.0f}")
    print(f"auth_cpu_us_per_refusal: {result.cpu_us['auth']:.1f}")
    print(f"auth_rpcs_during_flood: {sum(changed.values()):.0f}")


def report_revocations(rows: list[Revocation]) -> None:
    created = [s for r in rows for s in r.created.values()]
    each = [s for r in rows for s in r.revoked.values()]
    slowest = [max(r.revoked.values()) for r in rows]
    rpc = [r.revoke_rpc for r in rows]
    statuses = collections.Counter(r.edge_status for r in rows)
    print(f"\nrevocations: {len(rows)}, {len(rows[0].revoked)} routers")
    print(
        f"  new key taken by a router after p50 {statistics.median(created) * 1000:.0f} ms, "
        f"p99 {pct(created, 99) * 1000:.0f} ms (from the create call's return)"
    )
    print(
        f"  revoke RPC p50 {statistics.median(rpc) * 1000:.0f} ms; refused by a router after "
        f"p50 {statistics.median(each) * 1000:.0f} ms, p99 {pct(each, 99) * 1000:.0f} ms; "
        f"by all: p50 {statistics.median(slowest) * 1000:.0f} ms, max {max(slowest) * 1000:.0f} "
        "ms (from the revoke call)"
    )
    print(f"  the edge afterwards answered: {dict(statuses)}")
    print(f"revocation_seconds_p50: {statistics.median(slowest):.3f}")
    print(f"revocation_seconds_p99: {pct(slowest, 99):.3f}")


@contextlib.contextmanager
def running(config: StackConfig) -> Iterator[Stack]:
    stack = Stack(config)
    stack.start(log)
    try:
        yield stack
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", type=int, default=3)
    parser.add_argument("--flood-seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--revocations", type=int, default=20)
    parser.add_argument("--poll-ms", type=float, default=5.0)
    parser.add_argument("--skip-flood", action="store_true")
    parser.add_argument("--skip-revocation", action="store_true")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="auth-flood-") as tmp,
        running(stack_config(Path(tmp), args.routers)) as stack,
    ):
        if not args.skip_flood:
            report_flood(asyncio.run(flood(stack, args.flood_seconds, args.concurrency)))
        if not args.skip_revocation:
            rows = asyncio.run(revocations(stack, args.revocations, args.poll_ms / 1000))
            report_revocations(rows)


if __name__ == "__main__":
    main()
