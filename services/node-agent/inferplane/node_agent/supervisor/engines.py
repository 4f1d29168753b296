"""The engines this node offers and which one a spec runs (issue 30, engines side by side).

An engine is an interpreter whose environment has vLLM and our replica distribution: the
node-agent's own (the default) and each engine environment it is given (`--engine-env DIR`,
`scripts/setup.sh` builds `.venv-engines/<name>/` from `engines/<name>.lock`). Each one's
version is read from its package metadata (`inferplane.artifacts.engine_package_version`, run
in that interpreter: milliseconds, vLLM is not imported). The engine kind is the node's:
"vllm-cpu" on a CPU node, "vllm" on a GPU node (`inferplane.artifacts.engine_kind`).

A spec selects one by `engine` ("" = the node's kind) and `engine_version` ("" = the default);
a node without it refuses the start with FAILED_PRECONDITION naming the field.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.artifacts import engine_kind, engine_package_version
from inferplane.runtime import ConfigError, FailedPreconditionError

log = structlog.get_logger("inferplane.node_agent.engines")

PROBE_TIMEOUT_SECONDS = 60.0
"""How long reading an environment's engine version may take (an interpreter start)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Engine:
    """One installed engine: its kind, version, the interpreter that runs
    `python -m inferplane.replica` with it, and whether a spec without a version gets it."""

    engine: str
    version: str
    python: str
    default: bool = False

    def to_proto(self) -> nodeagent_pb2.EngineInstall:
        return nodeagent_pb2.EngineInstall(
            engine=self.engine, version=self.version, location=self.python, default=self.default
        )


def env_python(env: str | Path) -> Path:
    """The interpreter of an engine environment given as its folder (`<env>/bin/python`) or as
    the interpreter itself."""
    path = Path(env)
    return path / "bin" / "python" if path.is_dir() else path


def probe_version(python: str | Path, *, timeout: float = PROBE_TIMEOUT_SECONDS) -> str:
    """The vLLM version installed for `python` (`python -m inferplane.artifacts`).

    Raises:
        ConfigError: the interpreter is missing, fails, or has no vLLM or no inferplane
            distribution (not an engine environment that setup built).
    """
    try:
        done = subprocess.run(
            [str(python), "-m", "inferplane.artifacts"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"engine environment {python}: cannot run it: {exc}") from None
    words = done.stdout.split()
    if done.returncode != 0 or len(words) != 2:
        detail = (done.stderr.strip().splitlines() or ["no vLLM installed"])[-1]
        raise ConfigError(f"engine environment {python}: no engine found ({detail})")
    return words[1]


def discover_engines(env_dirs: Sequence[str | Path], *, cpu: bool) -> list[Engine]:
    """The default engine (this interpreter's vLLM, its version from package metadata; "" when
    none is installed) then one per engine environment of `env_dirs`, each of the node's kind
    (`engine_kind`). An environment with the default's version, or one already listed, adds
    nothing.

    Raises:
        ConfigError: an environment that is no engine environment (`probe_version`).
    """
    kind = engine_kind(cpu)
    installed = engine_package_version()
    engines = [Engine(kind, installed[1] if installed else "", sys.executable, default=True)]
    for env in env_dirs:
        python = env_python(env)
        version = probe_version(python)
        if any(e.version == version for e in engines):
            log.warning("engine_env_duplicate", env=str(env), version=version)
            continue
        engines.append(Engine(kind, version, str(python)))
    return engines


class EngineCatalog:
    """The engines of this node; `select` picks a spec's."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if sum(e.default for e in engines) != 1:
            raise ValueError("exactly one engine must be the default")
        self.engines = tuple(engines)
        self.default = next(e for e in engines if e.default)

    def to_proto(self) -> list[nodeagent_pb2.EngineInstall]:
        return [e.to_proto() for e in self.engines]

    def select(self, spec: nodeagent_pb2.ReplicaSpec) -> Engine:
        """The engine `spec` runs: its `engine` kind ("" = the node's) at its `engine_version`
        ("" = the default engine).

        Raises:
            FailedPreconditionError: (reason ENGINE_UNAVAILABLE) a kind this node does not run
                (param `spec.engine`) or a version it has not installed (param
                `spec.engine_version`); the message lists what it offers.
        """
        kinds = {e.engine for e in self.engines}
        kind = spec.engine or self.default.engine
        if kind not in kinds:
            raise FailedPreconditionError(
                f"spec.engine {kind!r} is not installed on this node; it runs "
                + ", ".join(sorted(kinds)),
                reason="ENGINE_UNAVAILABLE",
                param="spec.engine",
            )
        if not spec.engine_version:
            return self.default
        for engine in self.engines:
            if engine.engine == kind and engine.version == spec.engine_version:
                return engine
        raise FailedPreconditionError(
            f"spec.engine_version {spec.engine_version!r} of {kind} is not installed on this "
            "node; it has " + ", ".join(f"{e.engine} {e.version}" for e in self.engines),
            reason="ENGINE_UNAVAILABLE",
            param="spec.engine_version",
        )
