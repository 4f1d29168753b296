"""Faults under load (issue 18, "the chaos suite"; issue 31: failure semantics on HTTP/1.1 and
HTTP/2): one fault at a time, with recovery in between, under a streaming load through the edge
of the whole local stack.

    .venv/bin/python bench/chaos.py [--quick] [--faults router,auth,...] [--workers 4]
                                    [--max-tokens 300] [--database postgresql|sqlite]
                                    [--http2] [--replicas 1|2] [--routers 1|2]
                                    [--transport inproc] [--keep]

Starts the local stack (`inferplane.localstack.Stack`: Envoy, auth, router, orchestrator,
telemetry, one node-agent and `--replicas` kimi-tiny replicas on the CPU engine; with one,
Envoy has nowhere else to retry a request, with two its retries show) with auth logging at
debug level, then for each fault: a load of `--workers` closed loops of streamed chat
completions (`--max-tokens` each, `ignore_eos`, raw SSE read with httpx, on HTTP/1.1 or with
`--http2` on HTTP/2) plus a probe (one short streamed request at a time, back to back), the
fault once every load stream is mid-way, recovery, a few more seconds of load, the load's end
(streams in flight finish) and the usage reports' settling.

Faults (`--faults`, table order; `--quick` without `--faults`: the four service kills that
restart no engine, with shorter phases):

    engine-core      SIGKILL of a replica's vLLM engine core (`VLLM::EngineCore`)
    replica          SIGKILL of a replica process
    node-agent       SIGKILL of the node-agent
    router           SIGKILL of the router
    auth             SIGKILL of auth
    orchestrator     SIGKILL of the orchestrator
    telemetry        SIGKILL of telemetry
    node-agent-term  SIGTERM of the node-agent while streams longer than its replica processes'
                     drain grace (`replica_drain_grace_seconds`, 5 s) run
    database         PostgreSQL (auth's and the orchestrator's database) stopped at once
                     (`pg_ctl -m immediate`) and started again 10 s later

`inferplane up` restarts no component, so the bench does what a process supervisor (systemd's
`Restart=always`, a pod's restart policy) would: a killed service starts again at once, same
argv; the node-agent restarts replica processes and the orchestrator places replicas, as in
production. The database fault needs PostgreSQL (`scripts/postgres.sh`; installed when
missing): a SQLite file cannot go away from the connections that hold it open (an unreadable
or renamed file keeps serving them), so the whole bench runs auth and the orchestrator on
PostgreSQL when that fault is selected (`--database`).

Each request ends as exactly one of (`chaoslib/streams.py`):
- completed: HTTP 200, a finish_reason, `data: [DONE]` last, no error event;
- failed before the first token: no generated token and an explicit refusal: an HTTP error
  status (its OpenAI error code is shown), an SSE error event, or no response at all
  (a connection error before any status, shown as `conn`);
- ended by an error event: generated tokens, then `data: {"error": ...}`;
- reset after the first byte: an HTTP 200 stream ended by a transport-level error (HTTP/1.1:
  the chunked body without its terminating chunk; HTTP/2: RST_STREAM) and no error event:
  visible to every client, accepted when the process writing the stream dies
  (docs/architecture.md, "Failure semantics");
- cut silently: an HTTP 200 stream that ended cleanly with neither `data: [DONE]` nor an error
  event, which a client takes for a whole answer (goal 0).
Envoy's retries are its `upstream_rq_retry` counter of the replicas cluster over the phase.

Usage: auth logs every request it accounts (`usage_accounted`, with the edge's request id, at
debug level) and every response carries that id (`x-request-id`, the id the router reports).
Once the reports settle, a request a replica served (HTTP 200) that auth never accounted is
lost; a request id accounted twice is doubled (goal 0 for both); a line with `replaced=True`
amends a provisional row and is no copy. Requests refused before the router (auth or the
picker down) have no usage to account.

Recovery: from the fault until a probe request started after it completes.

Last lines: per fault `silent_truncations <fault>: N`, `reset_streams <fault>: N`,
`lost_usage_records <fault>: N`, `failed_after_first_byte <fault>: N` (error events, resets
and silent cuts of HTTP 200 streams), `migrated_streams <fault>: N` (streams a replica moved
to a sibling when its engine died: the replicas' `stream_migrated` log lines; with
`--replicas 2`); then `doubled_usage_records: D` and the totals `silent_truncations: N` (goal
0), `reset_streams: R`, `lost_usage_records: M` (goal 0), `failed_after_first_byte: F`,
`migrated_streams: G`.

The machinery lives in `bench/chaoslib/` (streams, load, ledger, processes, faults, phase,
report); this module re-exports what `tests/e2e/test_chaos.py` uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from chaoslib.faults import DATABASE_AWAY_S, FAULTS, QUICK_FAULTS, Context, Fault
from chaoslib.ledger import UsageLedger, settle_usage
from chaoslib.load import Load
from chaoslib.phase import Phase, run_fault
from chaoslib.processes import Postgres, engine_core_pid, envoy_retries, restart_service
from chaoslib.report import HEADER, SEPARATOR, Row, evidence, last_lines, table_row
from chaoslib.streams import (
    AFTER_FIRST_BYTE,
    API_PATHS,
    COMPLETED,
    CUT_SILENTLY,
    ENDED_BY_ERROR_EVENT,
    FAILED_BEFORE_FIRST_TOKEN,
    RESET_AFTER_FIRST_BYTE,
    Request,
    body,
    client,
    stream,
)

from inferplane.api.auth.v1 import auth_pb2
from inferplane.localstack import Stack, StackConfig
from inferplane.runtime.processes.ports import free_port, free_port_run

__all__ = [
    "AFTER_FIRST_BYTE",
    "API_PATHS",
    "COMPLETED",
    "CUT_SILENTLY",
    "DATABASE_AWAY_S",
    "ENDED_BY_ERROR_EVENT",
    "FAILED_BEFORE_FIRST_TOKEN",
    "FAULTS",
    "HEADER",
    "QUICK_FAULTS",
    "RESET_AFTER_FIRST_BYTE",
    "Context",
    "Fault",
    "Load",
    "Phase",
    "Postgres",
    "Request",
    "Row",
    "UsageLedger",
    "bench_key",
    "body",
    "client",
    "engine_core_pid",
    "envoy_retries",
    "evidence",
    "last_lines",
    "restart_service",
    "run_fault",
    "settle_usage",
    "stack_config",
    "stream",
    "table_row",
]


def bench_key(stack: Stack) -> str:
    """An API key with limits far above the load (its checks and reports then take the
    counter store's path, as production keys do)."""
    return stack.create_api_key(
        "chaos",
        limits=auth_pb2.Limits(
            requests_per_minute=100_000, tokens_per_minute=100_000_000, max_concurrent_requests=64
        ),
    )


def stack_config(
    data_dir: Path, transport: str, database_urls: dict[str, str], replicas: int = 1
) -> StackConfig:
    """The bench's stack: auth at debug level (its `usage_accounted` lines), the databases of
    `database_urls` (service name → URL; SQLite for the others), `replicas` kimi-tiny
    replicas (with more than one, their engines start side by side unbound: vLLM's CPU
    auto-binding would pin every engine to core 0)."""
    args: dict[str, tuple[str, ...]] = {"auth": ("--log-level", "debug")}
    for name, url in database_urls.items():
        args[name] = (*args.get(name, ()), "--database-url", url)
    more: dict[str, object] = {}
    if replicas > 1:
        more = {
            "replicas": replicas,
            "engine_env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
            "warmup_timeout_seconds": 300,
        }
    return StackConfig(
        data_dir=data_dir,
        http_port=free_port(),
        grpc_base_port=free_port_run(5),
        metrics_base_port=free_port_run(5),
        envoy_admin_port=free_port(),
        transport=transport,
        startup_timeout_seconds=420 if replicas == 1 else 900,
        service_args=args,
        **more,  # type: ignore[arg-type]
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--faults", default="", help="comma list (default: all; --quick: four)")
    parser.add_argument("--quick", action="store_true", help="shorter phases, four faults")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--http2", action="store_true", help="the load on HTTP/2 (h2c)")
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=1)
    parser.add_argument("--routers", type=int, choices=(1, 2), default=1)
    parser.add_argument("--transport", default="inproc")
    parser.add_argument("--database", choices=("postgresql", "sqlite"), default="")
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args(argv)

    known = {f.name: f for f in FAULTS}
    names = [n for n in args.faults.split(",") if n] or (
        list(QUICK_FAULTS) if args.quick else list(known)
    )
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(known)}")
    faults = [f for f in FAULTS if f.name in names]
    phase = Phase(
        workers=args.workers,
        max_tokens=args.max_tokens,
        warm_s=2.0 if args.quick else 3.0,
        after_s=2.0 if args.quick else 5.0,
        http2=args.http2,
    )
    database = args.database or (
        "postgresql" if any(f.needs_postgres for f in faults) else "sqlite"
    )

    began = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    data_dir = Path(tempfile.mkdtemp(prefix="inferplane-chaos-"))
    postgres: Postgres | None = None
    rows: list[Row] = []
    try:
        urls: dict[str, str] = {}
        if database == "postgresql":
            postgres = Postgres(data_dir / "pg")
            try:
                postgres.start()
                urls = {n: postgres.database(f"chaos_{n}") for n in ("auth", "orchestrator")}
            except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
                print(f"PostgreSQL unavailable ({exc}): SQLite, without the database fault")
                postgres = None
                faults = [f for f in faults if not f.needs_postgres]
        elif any(f.needs_postgres for f in faults):
            print("the database fault needs --database postgresql: skipped")
            faults = [f for f in faults if not f.needs_postgres]
        config = stack_config(data_dir / "stack", args.transport, urls, args.replicas)
        config = dataclasses.replace(config, routers=args.routers)  # sharing each replica's cap
        print(
            f"chaos {date}: {len(faults)} faults, {phase.workers} streams of "
            f"{phase.max_tokens} tokens (+ a probe) on HTTP/{'2' if args.http2 else '1.1'}, "
            f"transport {args.transport}, databases {database}, {args.replicas} replica(s); "
            f"data in {data_dir}"
        )
        stack = Stack(config)
        stack.start(lambda m: print(f"  {m}"))
        try:
            print(f"stack up in {time.monotonic() - began:.0f} s")
            ctx = Context(stack, lambda m: print(m, flush=True), postgres)
            key = bench_key(stack)
            ledger = UsageLedger(config.data_dir / "logs" / "auth.log")
            for fault in faults:
                print(f"== {fault.name}: {fault.what}", flush=True)
                row = run_fault(fault, ctx, key, phase, ledger)
                rows.append(row)
                print(f"  {table_row(row)}  ({row.wall_s:.0f} s)", flush=True)
                print(f"  streams in flight at the fault: {row.in_flight()}")
                print(f"  responses on {row.protocols()}")
                for line in evidence(row):
                    print(line)
                dead = stack.dead_component()
                if dead:
                    print(f"  a component is down after {fault.name}: {dead.splitlines()[0]}")
        finally:
            stack.stop()
    finally:
        if postgres is not None:
            postgres.close()
        if args.keep:
            print(f"kept {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)

    print()
    print(f"chaos {date}, {time.monotonic() - began:.0f} s in all")
    print(HEADER)
    print(SEPARATOR)
    for row in rows:
        print(table_row(row))
    for row in rows:
        print(f"  {row.fault.name}: streams in flight at the fault: {row.in_flight()}")
    for row in rows:
        for line in evidence(row):
            print(line)
    for line in last_lines(rows):
        print(line)


if __name__ == "__main__":
    main()
