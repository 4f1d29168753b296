"""Two regions behind the global tier, on network namespaces (issue 31 part 3; docs/regions.md).

Hosts (`inferplane.localstack.netns`): per region a control host (orchestrator, auth, router,
telemetry, the region's edge) and a worker (node-agent, one kimi-tiny replica process around
the fake vLLM HTTP engine: this test is about routing, keys and usage, not generation); one
more host runs the global tier's Envoy. The test is the client, in the root namespace, and
talks to the global tier only (and to each region's admin API for keys and ledgers).

Invariants:
- a key is served by its home region (`x-inferplane-region`), and authenticates in the other
  region too (its auth follows the home region's key table); a pinned key does not;
- a revocation in the home region reaches the other region within `REVOCATION_BOUND_S`;
- region `a` cut (both its cables pulled): `a`'s keys are served by `b` within
  `FAILOVER_BOUND_S`, and every request sent after the cut succeeds; `a`'s streams in flight
  end visibly (an error, never a clean end without its finish) within `STREAM_END_BOUND_S`;
  a key pinned to `a` gets a 503 `region_unavailable`, never an answer from `b`;
- cables back: `a`'s keys are served by `a` again within `RESTORE_BOUND_S`;
- usage: every request a client saw complete is in exactly one region's ledger, once (the
  regions' rows merged by request id), and none is there twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import httpx
import pytest

from inferplane.localstack import MODEL_NAME
from inferplane.localstack.netns import Hosts
from inferplane.localstack.regions import (
    Regions,
    control_host,
    layout_host_names,
    namespace_layout,
    running_regions,
    worker_host,
)
from inferplane.regions import KEY_REPLICATION_SECONDS, REGION_UNAVAILABLE
from inferplane.sdk import Client, MergedUsage, MultiRegionUsage
from inferplane.wire.headers import SERVED_REGION

from .conftest import HOME, OTHER

pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(1200)]

T = TypeVar("T")

INTERNAL_TOKEN = "regions-internal-token"
TOKEN_DELAY_S = 0.02  # the fake engine: 50 tokens/s per stream
STREAM_TOKENS = 1500  # ~30 s: outlasts the cut's detection
# Health checks every 1 s, unhealthy after 2 misses; a request sent before that is retried
# to the fallback after its connect timeout (docs/regions.md, "The global tier").
FAILOVER_BOUND_S = 15.0
# The global tier finds a silent region edge by its HTTP/2 keepalive (docs/regions.md).
STREAM_END_BOUND_S = 40.0
RESTORE_BOUND_S = 30.0
REVOCATION_BOUND_S = KEY_REPLICATION_SECONDS
SENT_AFTER_CUT = 24  # one every 0.5 s
SLOW_S = 1.0  # a 4-token completion takes ~0.1-0.5 s here; one held by the cut takes longer


@dataclasses.dataclass(slots=True)
class Sent:
    """One request sent after the cut: seconds from the cut to its send and to its answer,
    its HTTP status (0: none), the region that answered, the error."""

    at: float
    end: float = 0.0
    status: int = 0
    region: str = ""
    error: str = ""


@pytest.fixture(scope="module")
def regions(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Regions]:
    names = layout_host_names((HOME, OTHER))
    config = namespace_layout(
        {name: hosts.host(name) for name in names},
        (HOME, OTHER),
        tmp_path_factory.mktemp("regions"),
        internal_token=INTERNAL_TOKEN,
        fake_engine_token_delay=TOKEN_DELAY_S,
    )
    with running_regions(config, print) as started:
        yield started


def _poll(what: str, seconds: float, read: Callable[[], T | None], every: float = 0.25) -> T:
    deadline = time.monotonic() + seconds
    while True:
        value = read()
        if value is not None:
            return value
        assert time.monotonic() < deadline, f"timed out after {seconds:.0f} s waiting for {what}"
        time.sleep(every)


def _admin(regions: Regions, region: str) -> tuple[str, dict[str, str]]:
    stack = regions.stacks[region]
    return stack.config.base_url, {"authorization": f"Bearer {stack.admin_key}"}


def _new_key(regions: Regions, region: str, name: str, **fields: Any) -> tuple[str, str]:
    """A fresh inference key made by `region`'s admin API: (secret, key id)."""
    url, headers = _admin(regions, region)
    body = {"display_name": name, "tenant": "regions", "scopes": ["inference"], **fields}
    answer = httpx.post(
        f"{url}/admin/api-keys", json=body, headers=headers, timeout=30, trust_env=False
    )
    assert answer.status_code == 200, answer.text
    created = answer.json()
    return created["secret"], created["api_key"]["name"].removeprefix("api-keys/")


def _complete(base_url: str, secret: str, timeout: float = 60.0) -> httpx.Response:
    """One short text completion (not streamed); the raw answer."""
    return httpx.post(
        f"{base_url}/completions",
        json={"model": MODEL_NAME, "prompt": "Count: t", "max_tokens": 4},
        headers={"authorization": f"Bearer {secret}"},
        timeout=timeout,
        trust_env=False,
    )


def _served_by(regions: Regions, secret: str) -> str | None:
    """The region that served one completion through the global tier, None on failure."""
    with contextlib.suppress(httpx.HTTPError):
        answer = _complete(regions.base_url, secret, timeout=30)
        if answer.status_code == 200:
            return str(answer.headers.get(SERVED_REGION, "?"))
    return None


def _accepted_by(regions: Regions, region: str, secret: str) -> bool:
    """Whether `region`'s own edge authenticates `secret` (`GET /v1/models` answers 200)."""
    url = regions.stacks[region].config.base_url
    with contextlib.suppress(httpx.HTTPError):
        answer = httpx.get(
            f"{url}/models",
            headers={"authorization": f"Bearer {secret}"},
            timeout=10,
            trust_env=False,
        )
        return answer.status_code == 200
    return False


class Stream(threading.Thread):
    """One long streamed completion through the global tier, read line by line."""

    def __init__(self, base_url: str, secret: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.secret = base_url, secret
        self.first_chunk = threading.Event()
        self.region = ""
        self.done = False
        self.finish: str | None = None
        self.error = ""
        self.ended_at = 0.0

    def run(self) -> None:
        body = {"model": MODEL_NAME, "prompt": "Count: t", "max_tokens": STREAM_TOKENS}
        body |= {"stream": True, "ignore_eos": True}
        try:
            with httpx.stream(
                "POST",
                f"{self.base_url}/completions",
                json=body,
                headers={"authorization": f"Bearer {self.secret}"},
                timeout=httpx.Timeout(10, read=120),
                trust_env=False,
            ) as response:
                self.region = response.headers.get(SERVED_REGION, "")
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    self.first_chunk.set()
                    if data == "[DONE]":
                        self.done = True
                    elif '"error"' in data:
                        self.error = data[:200]
                    elif '"finish_reason":"' in data.replace(" ", ""):
                        self.finish = data
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.ended_at = time.monotonic()
        self.first_chunk.set()


def test_home_routing_and_key_replication(regions: Regions) -> None:
    home_key, _ = _new_key(regions, HOME, "home")
    other_key, _ = _new_key(regions, OTHER, "other")
    pinned_key, _ = _new_key(regions, HOME, "pinned", region_pinned=True)
    assert home_key.startswith(f"ip-{HOME}.") and pinned_key.startswith(f"ip-{HOME}~")
    assert other_key.startswith(f"ip-{OTHER}.")
    assert _poll("the home key served", 30, lambda: _served_by(regions, home_key)) == HOME
    assert _poll("the other key served", 30, lambda: _served_by(regions, other_key)) == OTHER
    assert _poll("the pinned key served", 30, lambda: _served_by(regions, pinned_key)) == HOME
    # The other region authenticates the home region's key (replicated), never a pinned one.
    _poll(
        "the home key known in the other region",
        30,
        lambda: True if _accepted_by(regions, OTHER, home_key) else None,
    )
    assert not _accepted_by(regions, OTHER, pinned_key)

    revoked, revoked_id = _new_key(regions, HOME, "revoked")
    _poll(
        "a new key replicated", 30, lambda: True if _accepted_by(regions, OTHER, revoked) else None
    )
    url, headers = _admin(regions, HOME)
    answer = httpx.post(
        f"{url}/admin/api-keys/{revoked_id}:revoke", headers=headers, timeout=30, trust_env=False
    )
    assert answer.status_code == 200, answer.text
    started = time.monotonic()
    _poll(
        "the revocation to reach the other region",
        REVOCATION_BOUND_S + 5,
        lambda: True if not _accepted_by(regions, OTHER, revoked) else None,
        every=0.1,
    )
    took = time.monotonic() - started
    print(f"revocation reached region {OTHER} in {took:.2f} s")
    assert took <= REVOCATION_BOUND_S


def test_a_region_cut_off_and_back(regions: Regions, hosts: Hosts) -> None:
    home_key, home_id = _new_key(regions, HOME, "failover")
    pinned_key, _ = _new_key(regions, HOME, "failover-pinned", region_pinned=True)
    _poll("the failover key served", 30, lambda: _served_by(regions, home_key))
    _poll("the pinned key served", 30, lambda: _served_by(regions, pinned_key))
    streams = [Stream(regions.base_url, home_key) for _ in range(3)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_chunk.wait(60), "a stream sent no first chunk in 60 s"
        assert stream.region == HOME and not stream.error, (stream.region, stream.error)

    served: dict[str, str] = {}  # request id → the region that answered
    cut_at = time.monotonic()
    hosts.cut(control_host(HOME))
    hosts.cut(worker_host(HOME))
    try:
        # New requests after the cut: each must succeed (retried by the global tier before
        # its first byte when it was sent to the lost region), in the other region.
        def send(delay: float) -> Sent:
            time.sleep(delay)
            out = Sent(at=time.monotonic() - cut_at)
            try:
                answer = _complete(regions.base_url, home_key, timeout=90)
            except httpx.HTTPError as exc:
                out.error = f"{type(exc).__name__}: {exc}"
            else:
                out.status, out.region = answer.status_code, answer.headers.get(SERVED_REGION, "")
                if answer.status_code == 200:
                    served[answer.headers.get("x-request-id", f"?{out.at}")] = out.region
                else:
                    out.error = answer.text[:200]
            out.end = time.monotonic() - cut_at
            return out

        # One worker per request: each is sent on schedule, however long the others wait.
        with futures.ThreadPoolExecutor(SENT_AFTER_CUT) as pool:
            outcomes = list(pool.map(send, [0.5 * k for k in range(SENT_AFTER_CUT)]))
        print("after the cut (sent, answered, status, region):")
        print("  " + ", ".join(f"+{o.at:.1f}/{o.end:.1f}/{o.status}/{o.region}" for o in outcomes))
        assert all(o.status == 200 for o in outcomes), [o for o in outcomes if o.status != 200]
        assert {o.region for o in outcomes} == {OTHER}
        # Failover: until every request is answered as fast as without the cut.
        failover_s = max((o.end for o in outcomes if o.end - o.at > SLOW_S), default=0.0)
        print(f"regions_failover_seconds {failover_s:.2f}")
        assert failover_s <= FAILOVER_BOUND_S

        # The pinned key: a clear 503, never the other region.
        answer = _complete(regions.base_url, pinned_key, timeout=60)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == REGION_UNAVAILABLE, answer.text
        assert SERVED_REGION not in answer.headers or answer.headers[SERVED_REGION] != OTHER

        # The streams in flight end visibly, never cleanly without their finish.
        for stream in streams:
            stream.join(STREAM_END_BOUND_S + 30)
            assert not stream.is_alive(), "a stream of the lost region still hangs"
            print(
                f"stream ended +{stream.ended_at - cut_at:.1f} s after the cut: "
                f"error {stream.error[:100]!r}, done {stream.done}"
            )
            assert stream.error, "a stream of the lost region ended without an error"
            assert stream.ended_at - cut_at <= STREAM_END_BOUND_S
    finally:
        hosts.restore(control_host(HOME))
        hosts.restore(worker_host(HOME))
    restored_at = time.monotonic()
    _poll(
        "the home region to serve its keys again",
        RESTORE_BOUND_S,
        lambda: True if _served_by(regions, home_key) == HOME else None,
        every=0.5,
    )
    print(f"regions_restore_seconds {time.monotonic() - restored_at:.2f}")
    assert _poll("the pinned key served again", 30, lambda: _served_by(regions, pinned_key)) == HOME

    # Usage: the requests served during the cut are in the other region's ledger, once; the
    # home region's ledger has none of them; merged, each request appears exactly once.
    merged = _merged_usage(regions, home_id, want=len(served) + 1)
    assert merged.complete and merged.duplicates == 0, (merged.missing, merged.duplicates)
    by_id = {item.row.request_id: item for item in merged.rows}
    print(f"merged usage rows by region: {Counter(i.region for i in merged.rows)}")
    for request_id, region in served.items():
        assert request_id in by_id, f"request {request_id} is in no region's ledger"
        assert by_id[request_id].region == region
        assert by_id[request_id].row.completion_tokens > 0


def _merged_usage(regions: Regions, key_id: str, want: int) -> MergedUsage:
    """The key's usage rows from every region's ledger, merged by request id (the SDK's
    `MultiRegionUsage`), once at least `want` arrived (reports follow responses)."""
    clients = {
        name: Client(
            auth=stack.config.address("auth"),
            security=stack.config.security,
            admin_key=stack.admin_key,
            timeout=30,
        )
        for name, stack in regions.stacks.items()
    }
    try:
        with MultiRegionUsage(clients) as usage:

            def read() -> MergedUsage | None:
                merged = usage.rows(key=key_id)
                return merged if len(merged.rows) >= want else None

            return _poll(f"{want} merged usage rows", 90, read, every=1.0)
    finally:
        for client in clients.values():
            client.close()
