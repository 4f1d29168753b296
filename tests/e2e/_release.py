"""Helpers of the release pipeline's scenario suite (`test_release_pipeline.py`): the
orchestrator calls a release makes and waits on, the model-folder copies its candidates run
(the test fault switch's marker; the broken chat template is
`inferplane.fixtures.kimi_tiny_broken_template`), and live traffic through the edge
with the official `openai` client, counted by the revision that served each request."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from pathlib import Path

import grpc
import openai
import tenacity
from google.protobuf import field_mask_pb2

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME
from inferplane.replica.server.faults import FAULT_MARKER
from inferplane.wire.headers import SERVED_REVISION

NAME = f"deployments/{MODEL_NAME}"
#: ReleaseProgress.stage values a release ends in.
PROMOTED, ROLLED_BACK = "Promoted", "RolledBack"
ENDED = (PROMOTED, ROLLED_BACK)


def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


class Release:
    """The orchestrator's DeploymentService, as an operator drives a release of kimi-tiny."""

    def __init__(
        self,
        deployments: orchestrator_pb2_grpc.DeploymentServiceStub,
        endpoints: Callable[[], list[pb.RouteEndpoint]],
    ) -> None:
        self.stub = deployments
        self._endpoints = endpoints  # the routing table's serving endpoints of kimi-tiny

    @tenacity.retry(
        retry=tenacity.retry_if_exception(_unavailable),
        stop=tenacity.stop_after_delay(30),
        wait=tenacity.wait_fixed(1),
        reraise=True,
    )
    def get(self) -> pb.Deployment:
        """The deployment, retried for 30 s on UNAVAILABLE (run 3: a leader lease renewal late
        on the loaded box answered "not the leader" once, as any client may see)."""
        return self.stub.GetDeployment(pb.GetDeploymentRequest(name=NAME), timeout=10).deployment

    def update(
        self,
        profile: pb.DeploymentProfile,
        rollout: pb.RolloutStrategy | None = None,
        *,
        force_reason: str = "",
    ) -> str:
        """Replaces the whole profile (and the rollout strategy, when given); returns the
        candidate revision. `force_reason`: override a failed verdict (audited)."""
        paths = ["profile"] + (["rollout"] if rollout is not None else [])
        change = pb.Deployment(name=NAME, profile=profile, rollout=rollout)
        response = self.stub.UpdateDeployment(
            pb.UpdateDeploymentRequest(
                deployment=change,
                update_mask=field_mask_pb2.FieldMask(paths=paths),
                force=bool(force_reason),
                force_reason=force_reason,
            ),
            timeout=30,
        )
        revision = response.deployment.status.target_revision
        assert revision, response.deployment.status
        return revision

    def wait(self, revision: str, stages: Iterable[str], timeout: float) -> pb.Deployment:
        """Polls until the release of `revision` is in one of `stages` (or ended); returns the
        deployment then.

        Raises:
            AssertionError: `timeout` seconds passed first (the last status in the message).
        """
        wanted = set(stages) | set(ENDED)
        deadline = time.monotonic() + timeout
        while True:
            deployment = self.get()
            release = deployment.status.release
            if release.candidate_revision == revision and release.stage in wanted:
                return deployment
            assert time.monotonic() < deadline, (
                f"release of {revision} not in {sorted(wanted)} after {timeout:.0f} s: "
                f"{deployment.status}"
            )
            time.sleep(1.0)

    def settled(self, revision: str, timeout: float) -> pb.Deployment:
        """Polls until `revision` serves alone: current revision `revision`, phase Available
        (or RolledBack: the candidate after it failed) and every serving endpoint of the
        routing table of that revision (a promoted release still rolls the rest, a rolled-back
        one still drains its candidate).

        Raises:
            AssertionError: `timeout` seconds passed first.
        """
        deadline = time.monotonic() + timeout
        while True:
            deployment = self.get()
            status = deployment.status
            revisions = {e.revision for e in self._endpoints()}
            if (
                status.current_revision == revision
                and status.phase in ("Available", ROLLED_BACK)
                and revisions == {revision}
            ):
                return deployment
            assert time.monotonic() < deadline, (
                f"{revision} not serving alone after {timeout:.0f} s: table {revisions}, "
                f"{describe(deployment)}"
            )
            time.sleep(1.0)

    def matrix(self, revision: str) -> list[pb.CompatibilityEntry]:
        """The compatibility matrix's rows measured on kimi-tiny's `revision`."""
        rows = self.stub.ListCompatibility(
            pb.ListCompatibilityRequest(deployment=MODEL_NAME, page_size=1000), timeout=10
        ).entries
        return [row for row in rows if row.revision == revision]

    def forced(self) -> list[pb.ForcedChange]:
        return list(
            self.stub.ListForcedChanges(
                pb.ListForcedChangesRequest(deployment=MODEL_NAME), timeout=10
            ).changes
        )


def verdicts(deployment: pb.Deployment) -> dict[str, pb.GateVerdict]:
    """The release's gate verdicts by gate name (the last of each)."""
    return {v.gate: v for v in deployment.status.release.verdicts}


def describe(deployment: pb.Deployment) -> str:
    """A one-line view of a release for assertion messages."""
    release = deployment.status.release
    gates = ", ".join(
        f"{v.gate}={v.result} ({v.seconds:.1f} s: {v.reason})" for v in release.verdicts
    )
    return (
        f"phase {deployment.status.phase}, stage {release.stage}, candidate "
        f"{release.candidate_revision}, current {deployment.status.current_revision}: {gates}; "
        f"{release.message}"
    )


# -- candidates' model folders ------------------------------------------------------------------


def model_copy(folder: Path, replace: Mapping[str, str]) -> Path:
    """A copy of kimi-tiny in `folder`: every file linked, those in `replace` (name → text)
    written instead. A new folder is a new `model_source`, hence a new profile revision."""
    folder.mkdir(parents=True)
    source = kimi_tiny.model_path()
    for item in source.iterdir():
        if item.name not in replace:
            (folder / item.name).symlink_to(item.resolve())
    for name, text in replace.items():
        (folder / name).write_text(text)
    return folder


def faulty_model(folder: Path, error_rate: float) -> Path:
    """kimi-tiny with the test fault switch's marker: its replicas (in a stack whose engines
    run with `INFERPLANE_TEST_FAULTS=1`) fail `error_rate` of their live requests."""
    return model_copy(folder, {FAULT_MARKER: json.dumps({"error_rate": error_rate})})


# -- traffic ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Served:
    """What a batch of requests got: successes by served revision, failures as text."""

    by_revision: Counter[str] = dataclasses.field(default_factory=Counter)
    failed: list[str] = dataclasses.field(default_factory=list)
    error_codes: Counter[str] = dataclasses.field(default_factory=Counter)

    @property
    def ok(self) -> int:
        return sum(self.by_revision.values())


def chat(client: openai.OpenAI, session: str, turn: int) -> str:
    """One short chat completion in `session` (sent as `user`: the canary split's sticky key);
    returns the revision that served it (`x-inferplane-revision-served`, else the response's
    `system_fingerprint`, which the replica sets to its revision).

    Raises:
        openai.APIError: the request failed.
    """
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": f"Turn {turn} of {session}: what is 2+2?"}],
        max_tokens=2,
        user=session,
    )
    revision = raw.headers.get(SERVED_REVISION) or raw.parse().system_fingerprint or ""
    assert revision, "the response names no revision"
    return revision


def _record(
    served: Served, lock: threading.Lock, client: openai.OpenAI, session: str, turn: int
) -> None:
    """One `chat`, counted in `served` (a failure with its HTTP status and error code)."""
    try:
        revision = chat(client, session, turn)
    except openai.APIStatusError as exc:
        code = ""
        if isinstance(exc.body, dict):
            code = str(exc.body.get("code") or exc.body.get("error", {}).get("code") or "")
        with lock:
            served.failed.append(f"HTTP {exc.status_code} {code}: {exc.message[:200]}")
            served.error_codes[code] += 1
        return
    except openai.APIError as exc:
        with lock:
            served.failed.append(f"{type(exc).__name__}: {exc}")
        return
    with lock:
        served.by_revision[revision] += 1


def sessions_batch(client: openai.OpenAI, sessions: int, turns: int, workers: int) -> Served:
    """`sessions` × `turns` requests (session s, turn t sent after every session's turn t-1 was
    queued), `workers` at a time; waits for all."""
    served, lock = Served(), threading.Lock()
    with futures.ThreadPoolExecutor(max_workers=workers) as pool:
        jobs = [
            pool.submit(_record, served, lock, client, f"batch-{s}", t)
            for t in range(turns)
            for s in range(sessions)
        ]
        futures.wait(jobs)
    return served


class Traffic:
    """Live traffic in the background: `rate` chat completions per second over `sessions`
    sessions (round robin), at most `max_in_flight` at once, until `stop()`; `pause()` stops
    sending (and waits for the requests in flight) until `resume()`."""

    def __init__(
        self,
        client: openai.OpenAI,
        *,
        rate: float,
        sessions: int,
        prefix: str = "live",
        max_in_flight: int = 8,
    ) -> None:
        self.served = Served()
        self._client, self._rate, self._sessions, self._prefix = client, rate, sessions, prefix
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = futures.ThreadPoolExecutor(max_workers=max_in_flight)
        self._slots = threading.Semaphore(max_in_flight)
        self._pending: list[futures.Future[None]] = []
        self._thread = threading.Thread(target=self._drive, daemon=True)
        self._sending = threading.Event()
        self._sending.set()

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _drive(self) -> None:
        n, next_at = 0, time.monotonic()
        while not self._stop.is_set():
            if not self._sending.is_set():
                self._sending.wait(1)
                next_at = time.monotonic()
                continue
            if self._slots.acquire(timeout=1):
                session = f"{self._prefix}-{n % self._sessions}"
                self._pending.append(self._pool.submit(self._one, session, n // self._sessions))
                n += 1
            next_at += 1.0 / self._rate
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _one(self, session: str, turn: int) -> None:
        try:
            _record(self.served, self._lock, self._client, session, turn)
        finally:
            self._slots.release()

    def pause(self) -> None:
        """Stops sending and waits (up to 180 s) for the requests in flight."""
        self._sending.clear()
        futures.wait(self._pending, timeout=180)

    def resume(self) -> None:
        self._sending.set()

    def stop(self) -> Served:
        """Stops sending, waits for the requests in flight; returns what was served."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(10)
            futures.wait(self._pending, timeout=180)
            self._pool.shutdown(wait=True)
        return self.served


def orchestrator_stub(
    channel: grpc.Channel, endpoints: Callable[[], list[pb.RouteEndpoint]]
) -> Release:
    return Release(orchestrator_pb2_grpc.DeploymentServiceStub(channel), endpoints)
