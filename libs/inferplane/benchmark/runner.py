"""Runs a pinned workload with GuideLLM (a subprocess in its own environment, `.venv-guidellm`)
against an OpenAI-compatible endpoint, optionally pinned to one profile revision
(`inferplane-revision`, honoured by the edge's picker for an `admin` key), and returns the
`BenchReport`.

The whole spec goes to GuideLLM as a scenario file (`guidellm run -c FILE`): GuideLLM's
`openai_http` backend (streamed chat completions), its `synthetic_text` data (multi-turn, shared
prefixes, the spec's token distributions), its `poisson` / `constant` profile and its static
seed. The file holds the API key, so it is written 0600 into a private temporary folder that is
removed after the run; GuideLLM's own report prints the key masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import signal
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inferplane.benchmark.report import (
    BenchmarkError,
    BenchReport,
    capture_environment,
    parse_guidellm_report,
)
from inferplane.benchmark.workload import REPO_ROOT, Workload
from inferplane.wire.headers import REVISION

GUIDELLM = REPO_ROOT / ".venv-guidellm" / "bin" / "guidellm"
"""GuideLLM's command (scripts/setup.sh installs it from bench/guidellm.lock); the environment
variable `INFERPLANE_GUIDELLM` overrides it."""
REQUEST_TIMEOUT_SECONDS = 60.0
"""GuideLLM's per-request timeout: one stuck stream errs instead of holding the run."""


def guidellm_command() -> Path:
    """`$INFERPLANE_GUIDELLM`, else `GUIDELLM`."""
    return Path(os.environ.get("INFERPLANE_GUIDELLM") or GUIDELLM)


def edge_target(base_url: str) -> str:
    """GuideLLM's `target` from an OpenAI base URL: the URL without a trailing `/v1`."""
    return base_url.rstrip("/").removesuffix("/v1")


def scenario(
    workload: Workload,
    *,
    base_url: str,
    api_key: str,
    model: str,
    revision: str,
    tokenizer: Path,
    report_path: Path,
) -> dict[str, Any]:
    """GuideLLM's scenario (`guidellm run -c`) for one side: backend (the edge, the key, the
    revision pin as an extra header), profile, data, constraints, tokenizer, seed, JSON output."""
    backend: dict[str, Any] = {
        "kind": "openai_http",
        "target": edge_target(base_url),
        "model": model,
        "request_format": workload.spec["request_format"],
        "api_key": api_key,
        "timeout": REQUEST_TIMEOUT_SECONDS,
    }
    if revision:
        backend["extras"] = {"headers": {REVISION: revision}}
    return {
        "metadata": {"name": workload.name, "description": workload.spec["description"]},
        "spec": {
            "backend": backend,
            "profile": workload.guidellm_profile(),
            "data": [workload.guidellm_data()],
            "constraints": workload.guidellm_constraints(),
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "seed": {"kind": "static", "value": workload.seed},
            "outputs": [{"kind": "json", "path": str(report_path)}],
        },
    }


async def run_workload_async(
    base_url: str,
    api_key: str,
    model: str,
    workload: Workload,
    revision: str | None = None,
    timeout: float = 300.0,
    *,
    tokenizer: Path | None = None,
    ca_path: Path | None = None,
    environment: Mapping[str, Any] | None = None,
) -> BenchReport:
    """Runs `workload` against `model` at `base_url` (the edge, `.../v1` or not) with `api_key`,
    pinned to `revision` when given; returns the parsed report.

    Args:
        timeout: seconds the GuideLLM process may take, start-up included; past it the
            process group is killed.
        tokenizer: the folder that sizes the synthetic text (default: the spec's).
        ca_path: a CA bundle for an https edge with a private CA (`SSL_CERT_FILE`).
        environment: facts the caller knows (e.g. `{"engine_versions": {...}}`), stored
            with the report's environment.

    Raises:
        BenchmarkError: GuideLLM is missing, exits non-zero, takes longer than `timeout`, or
            writes no readable report. Cancellation kills GuideLLM and re-raises.
    """
    command = guidellm_command()
    if not command.exists():
        raise BenchmarkError(
            f"{command} is missing: scripts/setup.sh installs GuideLLM (bench/guidellm.lock)"
        )
    tokenizer = tokenizer or workload.tokenizer_path()
    env = capture_environment(environment)
    env["started_at"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    env["workload_source"] = workload.source
    env["tokenizer"] = str(tokenizer)
    env["guidellm_worker_processes"] = workload.worker_processes
    with tempfile.TemporaryDirectory(prefix="inferplane-bench-") as folder:
        work = Path(folder)
        report_path = work / "guidellm.json"
        scenario_path = work / "scenario.json"
        body = scenario(
            workload,
            base_url=base_url,
            api_key=api_key,
            model=model,
            revision=revision or "",
            tokenizer=tokenizer,
            report_path=report_path,
        )
        fd = os.open(scenario_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(body, out)
        child_env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "GUIDELLM__MAX_WORKER_PROCESSES": str(workload.worker_processes),
        }
        if ca_path is not None:
            child_env["SSL_CERT_FILE"] = str(ca_path)
        started = time.monotonic()
        output = await _run(
            [str(command), "run", "-c", str(scenario_path), "--disable-console"],
            cwd=work,
            env=child_env,
            timeout=timeout,
        )
        wall = time.monotonic() - started
        try:
            raw = json.loads(report_path.read_text("utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise BenchmarkError(
                f"GuideLLM wrote no readable report ({error}); its output ends: {output[-1500:]}"
            ) from None
    return parse_guidellm_report(
        raw,
        workload=workload.name,
        workload_digest=workload.digest,
        seed=workload.seed,
        model=model,
        revision=revision or "",
        base_url=base_url,
        wall_seconds=wall,
        environment=env,
    )


def run_workload(
    base_url: str,
    api_key: str,
    model: str,
    workload: Workload,
    revision: str | None = None,
    timeout: float = 300.0,
    **options: Any,
) -> BenchReport:
    """`run_workload_async` from synchronous code (the CLI, scripts); not from a running loop."""
    return asyncio.run(
        run_workload_async(base_url, api_key, model, workload, revision, timeout, **options)
    )


async def _run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Runs `argv` in its own process group; returns its output (stdout and stderr, the last
    64 KiB). Kills the group on timeout or cancellation (GuideLLM starts worker processes)."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        stdout, _ = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        _kill_group(process)
        await process.wait()
        raise BenchmarkError(f"GuideLLM did not finish within {timeout:.0f} s") from None
    except BaseException:
        _kill_group(process)
        with contextlib.suppress(Exception):
            await process.wait()
        raise
    text = stdout[-65536:].decode("utf-8", errors="replace")
    if process.returncode != 0:
        raise BenchmarkError(f"GuideLLM exited with {process.returncode}: {text[-2000:]}")
    return text


def _kill_group(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
