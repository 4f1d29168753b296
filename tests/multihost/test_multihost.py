"""The platform on three hosts with real networking between them (issue 20, "Multi-host").

Hosts are network namespaces (conftest.py): a control host (orchestrator, auth, two routers,
telemetry, the Envoy edge) and two workers, each a node-agent with one kimi-tiny replica (vLLM
on the CPU), every service on its host's own address, mutual TLS between them. The test is a
client on the bridge and talks to the edge's address only, with the official `openai` client.
Liveness is short here (heartbeats every 1 s, NotReady after 5 missed), so a lost node shows
within seconds. Invariants:

- requests are spread over both workers (each request's replica from auth's usage ledger,
  each replica's node from the routing table);
- with worker w1's cable pulled: requests sent afterwards all succeed (on w2: w1 has no
  network); every stream in flight on w1 ends with an error within `STREAM_END_BOUND_S` (a
  transport error: Envoy resets a response whose replica went silent; no SSE error event can
  come from an unreachable replica, docs/architecture.md), never a clean end without its
  finish, never a hang; the streams on w2 finish; the ledger names w1's replica for exactly the
  streams that ended by an error (a row the router wrote before it heard how its request
  ended is provisional until the replica's report replaces it); the orchestrator marks w1
  NotReady and the routing table drops it within `LOST_BOUND_S`, and its replica is re-placed
  on w2 (room for two there);
- with the cable back: w1 is Ready again and the deployment still has exactly its two
  replicas, both on w2: w1's node-agent no longer runs the replica it was cut off with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import httpx
import openai
import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2, nodeagent_pb2_grpc
from inferplane.api.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import EDGE_PROCESS, MODEL_NAME, Stack, StackConfig, running_stack

from .conftest import CONTROL, WORKERS, Hosts

pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(1200)]

T = TypeVar("T")

INTERNAL_TOKEN = "multihost-internal-token"
HEARTBEAT_S = 1.0
MISSED_HEARTBEATS = 5  # 5 s: a node-agent stalled a few seconds under load is not lost
# NotReady after MISSED_HEARTBEATS × HEARTBEAT_S without a heartbeat, seen by the next sweep;
# out of the routing table at the next reconcile tick, which waits at most the orchestrator's
# node_agent_observe_timeout_seconds (5 s) for the silent node-agent.
LOST_BOUND_S = 20.0
# Envoy finds a silent replica host by its HTTP/2 keepalive toward the replicas (a ping every
# 11-12.65 s, 5 s to answer: inferplane.edge REPLICA_KEEPALIVE, ≤ 17.65 s), then resets the
# streams on it and retries the requests that had no response yet on the next replica picked.
STREAM_END_BOUND_S = 25.0
STREAM_READ_TIMEOUT_S = 300.0
# ignore_eos: ~40 s idle; outlasts the wait for the slowest first chunk and the cut.
STREAM_TOKENS = 3600
# The replica's engine starts on a loaded two-core machine beside the other one.
REPLACE_BOUND_S = 600.0
REJOIN_BOUND_S = 120.0

CUT, KEPT = WORKERS


@pytest.fixture(scope="module")
def stack(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    control = hosts.host(CONTROL)
    placement = {name: control for name in ("orchestrator", "auth", "router", "router_2")}
    placement |= {"telemetry": control, EDGE_PROCESS: control}
    placement |= {"node_agent": hosts.host(WORKERS[0]), "node_agent_2": hosts.host(WORKERS[1])}
    config = StackConfig(
        data_dir=tmp_path_factory.mktemp("multihost"),
        # Every host has its own ports: the defaults do.
        hosts=placement,
        nodes=WORKERS,
        routers=2,
        replicas=2,
        transport="inproc",
        startup_timeout_seconds=900,
        warmup_timeout_seconds=300,
        # vLLM's CPU auto-binding would pin both engines to core 0.
        engine_env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        service_args={
            "orchestrator": (
                "--heartbeat-interval-seconds",
                str(HEARTBEAT_S),
                "--missed-heartbeats",
                str(MISSED_HEARTBEATS),
                "--sweep-interval-seconds",
                "0.5",
                # Telemetry accepts the edge's overhead log from other hosts by this token
                # (or the edge's certificate; loopback callers need neither).
                "--edge-telemetry-internal-token",
                INTERNAL_TOKEN,
            ),
            # Auth accepts the routers' usage reports from other hosts by this token only.
            "auth": ("--internal-token", INTERNAL_TOKEN),
            "router": ("--auth-internal-token", INTERNAL_TOKEN),
            "telemetry": ("--internal-token", INTERNAL_TOKEN),
            # Both "hosts" share this machine's cores: a niced engine (19 once ready, the CPU
            # nodes' default) would starve behind the other worker's engine starting at 0 (the
            # re-placed replica) and behind anything else the machine runs, and its streams
            # would stall for minutes.
            "node_agent": (
                "--engine-cpu-core-niceness",
                "0",
                "--engine-cpu-autogroup-niceness",
                "0",
            ),
        },
    )
    with running_stack(config, print) as started:
        yield started


@pytest.fixture(scope="module")
def admin(stack: Stack) -> dict[str, str]:
    return {"authorization": f"Bearer {stack.admin_key}"}


def _client(stack: Stack, key: str, timeout: float = 120.0) -> openai.OpenAI:
    # trust_env off: the edge is on the bridge, never behind a proxy of the machine.
    return openai.OpenAI(
        base_url=stack.config.base_url,
        api_key=key,
        max_retries=0,
        timeout=timeout,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )


def _new_key(stack: Stack, admin: dict[str, str], name: str) -> tuple[str, str]:
    """A fresh inference key through the edge's admin API: (secret, key id)."""
    answer = httpx.post(
        f"{stack.config.base_url}/admin/api-keys",
        json={"display_name": name, "tenant": "multihost", "scopes": ["inference"]},
        headers=admin,
        timeout=30,
        trust_env=False,
    )
    assert answer.status_code == 200, answer.text
    created = answer.json()
    return created["secret"], created["api_key"]["name"].removeprefix("api-keys/")


def _known(stack: Stack, secret: str, seconds: float = 60) -> None:
    """Waits until the edge accepts `secret` (`GET /v1/models` answers 200): a key created a
    moment ago reaches the pickers' key table by its stream, which a loaded box can hold back
    for seconds (the picker answers 503 `auth_unavailable` for a key it does not know yet)."""

    def accepted() -> bool | None:
        with contextlib.suppress(httpx.HTTPError):
            answer = httpx.get(
                f"{stack.config.base_url}/models",
                headers={"authorization": f"Bearer {secret}"},
                timeout=10,
                trust_env=False,
            )
            if answer.status_code == 200:
                return True
        return None

    _poll("a new key to be accepted", seconds, accepted, every=0.5)


def _poll(what: str, seconds: float, read: Callable[[], T | None], every: float = 0.25) -> T:
    deadline = time.monotonic() + seconds
    while True:
        value = read()
        if value is not None:
            return value
        assert time.monotonic() < deadline, f"timed out after {seconds:.0f} s waiting for {what}"
        time.sleep(every)


def _ledger(
    stack: Stack, admin: dict[str, str], key_id: str, want: int, seconds: float = 60
) -> list[dict[str, Any]]:
    """The key's usage-ledger rows once `want` of them arrived (reports follow responses)."""

    def read() -> list[dict[str, Any]] | None:
        answer = httpx.get(
            f"{stack.config.base_url}/admin/usage",
            params={"key_id": key_id},
            headers=admin,
            timeout=30,
            trust_env=False,
        )
        assert answer.status_code == 200, answer.text
        rows = list(answer.json().get("rows", []))
        return rows if len(rows) >= want else None

    return _poll(f"{want} usage-ledger rows of key {key_id}", seconds, read, every=0.5)


def _placements(stack: Stack) -> list[orchestrator_pb2.Placement]:
    with stack.config.security.channel(stack.config.address("orchestrator")) as channel:
        return list(
            orchestrator_pb2_grpc.DeploymentServiceStub(channel)
            .ListDeploymentReplicas(
                orchestrator_pb2.ListDeploymentReplicasRequest(parent=f"deployments/{MODEL_NAME}"),
                timeout=10,
            )
            .placements
        )


def _node_condition(stack: Stack, node: str) -> str:
    """The orchestrator's condition of `node` (Ready, NotReady, Draining)."""
    with stack.config.security.channel(stack.config.address("orchestrator")) as channel:
        listed = (
            orchestrator_pb2_grpc.NodeServiceStub(channel)
            .ListNodes(orchestrator_pb2.ListNodesRequest(), timeout=10)
            .nodes
        )
    (found,) = [n for n in listed if n.status.node == node]
    return str(found.condition)


def _agent_replicas(stack: Stack, agent: str) -> list[nodeagent_pb2.Replica]:
    """What node-agent process `agent` runs (stopped replicas left out)."""
    with stack.config.security.channel(stack.config.address(agent)) as channel:
        replicas = (
            nodeagent_pb2_grpc.NodeAgentServiceStub(channel)
            .ListReplicas(nodeagent_pb2.ListReplicasRequest(), timeout=10)
            .replicas
        )
    return [r for r in replicas if r.state != nodeagent_pb2.Replica.STATE_STOPPED]


def _chat(client: openai.OpenAI, salt: int) -> Any:
    request = kimi_tiny.NO_TOOL.request()
    messages = [*request["messages"]]
    messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']} ({salt})"}
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=16,
        temperature=0,
        extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
    )


@dataclasses.dataclass
class Stream:
    """One streamed completion read with the openai client, and how it ended."""

    chunks: int = 0
    finish_reason: str | None = None
    error_event: str = ""  # the message of an SSE error event (openai.APIError)
    transport_error: str = ""  # the connection ended without a clean end of the body
    ended_at: float = 0.0
    first_chunk: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None and not self.error_event and not self.transport_error

    @property
    def ended_by_error(self) -> bool:
        return bool(self.error_event or self.transport_error)

    def run(self, client: openai.OpenAI, salt: int) -> None:
        request = kimi_tiny.NO_TOOL.request()
        try:
            stream = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": f"Count sheep, stream {salt}."}],
                max_tokens=STREAM_TOKENS,
                temperature=0,
                stream=True,
                extra_body={
                    "ignore_eos": True,
                    "chat_template_kwargs": request["chat_template_kwargs"],
                },
            )
            for chunk in stream:
                self.chunks += 1
                self.first_chunk.set()
                for choice in chunk.choices:
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except openai.APIError as exc:
            if isinstance(exc, openai.APIConnectionError):
                self.transport_error = repr(exc)
            else:
                self.error_event = str(exc)
        except httpx.TransportError as exc:  # a reset while reading the body
            self.transport_error = repr(exc)
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()


def _node_of(stack: Stack) -> dict[str, str]:
    """Serving replica id (as node-agents, the routing table and the ledger name it: the
    placement's id with its revision) → its node."""
    return {e.replica_id: e.node for e in stack.serving_endpoints()}


def test_requests_are_spread_over_both_workers(stack: Stack, admin: dict[str, str]) -> None:
    """Two replicas, one per worker, and concurrent requests through the edge land on both."""
    nodes = _node_of(stack)
    assert sorted(nodes.values()) == sorted(WORKERS), nodes
    secret, key_id = _new_key(stack, admin, "spread")
    client = _client(stack, secret)
    with futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: _chat(client, i), range(12)))
    assert all(a.choices[0].message.content for a in answers)
    rows = _ledger(stack, admin, key_id, len(answers))
    served = {nodes.get(row["replica"], row["replica"]) for row in rows}
    print(f"12 requests served by {sorted(r['replica'] for r in rows)}")
    assert served == set(WORKERS), served


def test_a_worker_cut_off_and_back(stack: Stack, hosts: Hosts, admin: dict[str, str]) -> None:
    """Pull w1's cable under streaming load, then plug it back (module docstring)."""
    before = _node_of(stack)
    (cut_replica,) = [r for r, n in before.items() if n == CUT]
    stream_secret, stream_key = _new_key(stack, admin, "streams")
    after_secret, after_key = _new_key(stack, admin, "after-cut")
    _known(stack, stream_secret)
    _known(stack, after_secret)
    streams = [Stream() for _ in range(4)]
    # A generous read timeout: the kept worker's streams slow down while its second engine
    # starts; a stream on the cut worker must still end by STREAM_END_BOUND_S.
    stream_client = _client(stack, stream_secret, timeout=STREAM_READ_TIMEOUT_S)
    threads = [
        threading.Thread(target=s.run, args=(stream_client, i), daemon=True)
        for i, s in enumerate(streams)
    ]
    for thread in threads:
        thread.start()
    for s in streams:
        assert s.first_chunk.wait(120), "a stream got no first chunk in 120 s"
    assert all(s.chunks and not s.ended_by_error for s in streams), streams

    hosts.cut(CUT)
    cut_at = time.monotonic()
    print(f"cut {CUT} at {time.strftime('%H:%M:%S')}")
    # When the orchestrator marks the node lost, and when the routing table stops listing
    # its replica, watched from the cut on.
    lost_at: list[float] = []
    unlisted_at: list[float] = []

    def watch() -> None:
        while time.monotonic() - cut_at < LOST_BOUND_S and not (lost_at and unlisted_at):
            if not lost_at and _node_condition(stack, CUT) == "NotReady":
                lost_at.append(time.monotonic())
            if not unlisted_at and all(e.node != CUT for e in stack.serving_endpoints()):
                unlisted_at.append(time.monotonic())
            time.sleep(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    # Requests not yet started when the cable went: every one succeeds, on the kept worker.
    after_client = _client(stack, after_secret)
    with futures.ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        answers = list(pool.map(lambda i: _chat(after_client, 100 + i), range(8)))
        took = time.monotonic() - started
    assert all(a.choices[0].message.content for a in answers)
    print(f"8 requests after the cut answered in {took:.1f} s")

    for thread in threads:
        thread.join(STREAM_READ_TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads), "a stream still runs"
    outcomes = [
        (s.chunks, s.finish_reason, s.error_event or s.transport_error, s.ended_at - cut_at)
        for s in streams
    ]
    print(f"streams (chunks, finish, error, ended s after the cut): {outcomes}")
    # Each stream either finished, or ended by an explicit error within the bound; none ended
    # cleanly without its finish_reason (a silent truncation) and none hung.
    for s in streams:
        assert s.finished or s.ended_by_error, outcomes
        if s.ended_by_error:
            assert s.ended_at - cut_at <= STREAM_END_BOUND_S, outcomes
    cut_streams = [s for s in streams if s.ended_by_error]
    assert cut_streams, f"no stream was in flight on {CUT}: {outcomes}"
    assert len(cut_streams) < len(streams), f"every stream failed, also on {KEPT}: {outcomes}"

    # The orchestrator marked the node lost within its bound...
    watcher.join(LOST_BOUND_S)
    assert lost_at, f"{CUT} was not NotReady within {LOST_BOUND_S:.0f} s of the cut"
    assert unlisted_at, f"the routing table still listed {CUT} {LOST_BOUND_S:.0f} s after the cut"
    print(
        f"{CUT} NotReady {lost_at[0] - cut_at:.1f} s after the cut, "
        f"out of the routing table {unlisted_at[0] - cut_at:.1f} s after it"
    )

    # ...and re-places its replica on the kept worker: two serving replicas there.
    def replaced() -> list[str] | None:
        placed = _placements(stack)
        serving = [e.replica_id for e in stack.serving_endpoints() if e.node == KEPT]
        on_kept = [p for p in placed if p.node == KEPT]
        return serving if len(placed) == 2 and len(on_kept) == 2 and len(serving) == 2 else None

    # (A replica keeps its id, `<deployment>-<slot>-<revision>`, when it moves to another node.)
    on_kept = _poll(f"two replicas serving on {KEPT}", REPLACE_BOUND_S, replaced, every=1.0)
    print(f"{cut_replica} re-placed on {KEPT} {time.monotonic() - cut_at:.0f} s after the cut")
    assert sorted(on_kept) == sorted(before), (on_kept, before)

    # Every request after the cut was accounted; w1 had no network, so w2 served them all.
    rows = _ledger(stack, admin, after_key, len(answers))
    print(f"after the cut: served by {sorted(r['replica'] for r in rows)}")

    # The streams that ended by an error are exactly those the cut worker's replica served
    # (the ledger names the replica the router picked; ids of requests before the re-placement).
    # A row is provisional while the router has not heard how its request ended (the stream
    # closed before its trailers and the replica's report was late: the kept worker is busy
    # starting the re-placed engine); the replica's report replaces it. The cut worker's
    # replica cannot report, so only the kept worker's rows are waited for.
    def settled_rows() -> list[dict[str, Any]] | None:
        rows = _ledger(stack, admin, stream_key, len(streams))
        kept = [r for r in rows if r["replica"] != cut_replica]
        return None if any(r.get("provisional") for r in kept) else rows

    stream_rows = _poll("the kept worker's stream rows to settle", 120, settled_rows, every=1.0)
    print(f"stream ledger rows: {[(r['replica'], r['status']) for r in stream_rows]}")
    on_cut = [r for r in stream_rows if r["replica"] == cut_replica]
    assert len(on_cut) == len(cut_streams), (stream_rows, outcomes)
    assert all(r["status"] != "completed" for r in on_cut), stream_rows
    assert all(r["status"] == "completed" for r in stream_rows if r not in on_cut), stream_rows

    # Plug the cable back: the node rejoins and nothing is duplicated.
    hosts.restore(CUT)
    restored_at = time.monotonic()
    _poll(
        f"{CUT} Ready again", REJOIN_BOUND_S, lambda: _node_condition(stack, CUT) == "Ready" or None
    )
    print(f"{CUT} Ready {time.monotonic() - restored_at:.1f} s after the restore")

    def settled() -> tuple[list[str], list[str]] | None:
        placed = _placements(stack)
        serving = sorted(e.replica_id for e in stack.serving_endpoints())
        running = {
            agent: [r.name.removeprefix("replicas/") for r in _agent_replicas(stack, agent)]
            for agent in stack.config.node_agents
        }
        everywhere = sorted(r for names in running.values() for r in names)
        if len(placed) == 2 and everywhere == serving and len(serving) == 2:
            return serving, running["node_agent"]
        return None

    placed, on_cut = _poll(
        f"{CUT}'s old replica stopped, two replicas in all", REJOIN_BOUND_S, settled, every=1.0
    )
    print(f"settled {time.monotonic() - restored_at:.0f} s after the restore: {placed}")
    assert on_cut == [], on_cut
    assert sorted(_node_of(stack).values()) == [KEPT, KEPT]
    serving = stack.serving_endpoints()
    assert len(serving) == 2 and {e.node for e in serving} == {KEPT}, serving
    # Still served end to end.
    assert _chat(_client(stack, after_secret), 999).choices[0].message.content
    # The cut replica generated on while cut off, and may report its streams once the cable is
    # back (before its node-agent stops it): a report of an end after the client's stream had
    # ended amends the tokens only, so those streams stay cancelled in the ledger.
    cut_ids = {r["request_id"] for r in stream_rows if r["replica"] == cut_replica}
    rows = _ledger(stack, admin, stream_key, len(streams))
    ends = [(r["status"], r.get("provisional", False)) for r in rows]
    print(f"stream ledger rows after the restore (status, provisional): {ends}")
    assert all(r["status"] == "cancelled" for r in rows if r["request_id"] in cut_ids), rows
