"""The pinned coding agents (Claude Code, Codex CLI, OpenCode: `tests/agents/package.json`)
pointed at an endpoint, each configured only as its own documentation says for a custom
endpoint, in a throw-away directory with its own HOME and config dirs (docs/agents.md).

`invocation(agent, endpoint, workdir, prompt)` writes the agent's configuration under `workdir`
and returns its command line and environment; `Invocation.run(timeout)` runs it. The
environment is built from nothing but PATH and the locale (no key, config or proxy setting of
the caller leaks in), plus an unreachable HTTP(S) proxy for every host but the loopback: a
request to the agent's vendor fails at once instead of reaching it, so a turn that completes
needed nothing but the endpoint (CI's machine reaches only the package registries).

With `weather=True` each agent also gets a `get_weather` tool from the stdio MCP server
`inferplane.testing.weather_mcp`, declared in its own MCP configuration; each call appends a
line to `Invocation.tool_calls_path`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferplane.testing import weather_mcp

REPO = Path(__file__).resolve().parents[3]
PACKAGE_DIR = REPO / "tests" / "agents"  # package.json + package-lock.json: the pins
BIN_ENV = "INFERPLANE_AGENTS_BIN"  # another node_modules/.bin holding the three binaries

CLAUDE_CODE = "claude-code"
CODEX = "codex"
OPENCODE = "opencode"
AGENTS = (CLAUDE_CODE, CODEX, OPENCODE)
BINARIES = {CLAUDE_CODE: "claude", CODEX: "codex", OPENCODE: "opencode"}

PROVIDER = "inferplane"  # the provider id in Codex's and OpenCode's configuration
KEY_ENV = "INFERPLANE_API_KEY"  # the variable Codex's provider and OpenCode's config read
# Requests to anything but the loopback go here and fail at once (discard port, nothing listens).
DEAD_PROXY = "http://127.0.0.1:9"


@dataclass(frozen=True)
class Endpoint:
    """An inferplane edge (or any server speaking its APIs): `root_url` without `/v1`."""

    root_url: str
    api_key: str
    model: str
    context_tokens: int = 131_072  # what OpenCode is told the model holds (its compaction limit)
    output_tokens: int = 1_024

    @property
    def v1_url(self) -> str:
        return self.root_url.rstrip("/") + "/v1"


@dataclass(frozen=True)
class Invocation:
    agent: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: Path
    tool_calls_path: Path

    def run(self, timeout: float) -> Completed:
        """Runs the agent to its end (stdin closed). After `timeout` seconds its process group
        is killed and the result says so (`timed_out`), with what it had written."""
        started = time.monotonic()
        with subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=dict(self.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        ) as process:
            timed_out = False
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
        seconds = time.monotonic() - started
        return Completed(self, process.returncode, stdout, stderr, seconds, timed_out)

    def tool_calls(self) -> list[dict[str, object]]:
        """The `get_weather` calls the tool received, in order."""
        if not self.tool_calls_path.exists():
            return []
        lines = self.tool_calls_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def describe(self) -> str:
        return f"(cd {self.cwd} && {shlex.join(self.argv)})"


@dataclass(frozen=True)
class Completed:
    invocation: Invocation
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    def turn(self) -> Turn:
        """What the agent's machine-readable output (each is run with its JSON output mode)
        says of the turn."""
        return {CLAUDE_CODE: _claude_turn, CODEX: _codex_turn, OPENCODE: _opencode_turn}[
            self.invocation.agent
        ](self.stdout)

    def summary(self) -> str:
        ended = "was killed (time out)" if self.timed_out else f"exited {self.returncode}"
        return (
            f"{self.invocation.agent} {ended} after {self.seconds:.1f} s: "
            f"{self.invocation.describe()}\n--- stdout\n{self.stdout[-3000:]}\n"
            f"--- stderr\n{self.stderr[-3000:]}"
        )


@dataclass(frozen=True)
class Turn:
    """One turn as the agent reports it: `completed` when it says the turn ended without an
    error (`error` holds what it said otherwise); `text` is the model's answer, else its
    reasoning; `output_tokens` what the agent counted (reasoning included)."""

    completed: bool
    error: str
    text: str
    output_tokens: int


def _json_lines(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _claude_turn(stdout: str) -> Turn:
    # `--output-format json`: one result object (`is_error`, `result`, `usage`).
    results = [event for event in _json_lines(stdout) if event.get("type") == "result"]
    if not results:
        return Turn(False, "no result object", "", 0)
    result = results[-1]
    usage = result.get("usage") or {}
    error = str(result.get("result", "")) if result.get("is_error") else ""
    text = str(result.get("result") or "")
    return Turn(not result.get("is_error"), error, text, int(usage.get("output_tokens") or 0))


def _codex_turn(stdout: str) -> Turn:
    # `exec --json`: JSON lines; `turn.completed` (with usage) or `turn.failed` / `error`.
    events = _json_lines(stdout)
    errors = [
        str(event.get("message") or event.get("error"))
        for event in events
        if event.get("type") in ("turn.failed", "error")
    ]
    items = [event["item"] for event in events if event.get("type") == "item.completed"]
    answers = [str(i.get("text", "")) for i in items if i.get("type") == "agent_message"]
    reasoning = [str(i.get("text", "")) for i in items if i.get("type") == "reasoning"]
    done = [event for event in events if event.get("type") == "turn.completed"]
    tokens = sum(int((event.get("usage") or {}).get("output_tokens") or 0) for event in done)
    completed = bool(done) and not errors
    return Turn(completed, "; ".join(errors), "".join(answers or reasoning), tokens)


def _opencode_turn(stdout: str) -> Turn:
    # `run --format json`: JSON lines of parts; each model step ends with `step_finish`.
    events = _json_lines(stdout)
    errors = [str(event.get("error")) for event in events if event.get("type") == "error"]
    texts = [
        str((event.get("part") or {}).get("text", ""))
        for event in events
        if event.get("type") in ("text", "reasoning")
    ]
    steps = [event.get("part") or {} for event in events if event.get("type") == "step_finish"]
    tokens = sum(
        int((step.get("tokens") or {}).get("output") or 0)
        + int((step.get("tokens") or {}).get("reasoning") or 0)
        for step in steps
    )
    return Turn(bool(steps) and not errors, "; ".join(errors), "".join(texts), tokens)


class AgentsNotInstalled(RuntimeError):
    pass


def bin_dir() -> Path:
    return Path(os.environ.get(BIN_ENV) or PACKAGE_DIR / "node_modules" / ".bin")


def binary(agent: str) -> Path:
    """The agent's executable. Raises AgentsNotInstalled (saying how to install) if absent."""
    path = bin_dir() / BINARIES[agent]
    if not os.access(path, os.X_OK):
        raise AgentsNotInstalled(
            f"{path} is missing: install the pinned agents with `./scripts/setup.sh --agents` "
            f"(npm ci in {PACKAGE_DIR.relative_to(REPO)})"
        )
    return path


def invocation(
    agent: str, endpoint: Endpoint, workdir: Path, prompt: str, *, weather: bool = False
) -> Invocation:
    """Writes `agent`'s configuration for `endpoint` under `workdir` (its HOME, config dirs and
    a `project/` working directory) and returns how to run one non-interactive turn."""
    home = workdir / "home"
    project = workdir / "project"
    for folder in (home, project):
        folder.mkdir(parents=True, exist_ok=True)
    calls = workdir / "weather-calls.jsonl"
    env = _base_env(home)
    env[weather_mcp.CALLS_ENV] = str(calls)
    build = {CLAUDE_CODE: _claude_code, CODEX: _codex, OPENCODE: _opencode}[agent]
    argv = build(endpoint, home, project, prompt, env, weather)
    return Invocation(agent, tuple(argv), env, project, calls)


def _base_env(home: Path) -> dict[str, str]:
    node_dir = str(Path(sys.executable).parent)  # the venv's python, for the MCP server
    path = os.pathsep.join([str(bin_dir()), node_dir, os.environ.get("PATH", "/usr/bin:/bin")])
    env = {
        "PATH": path,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "TMPDIR": str(home / "tmp"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
    }
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env[name] = DEAD_PROXY
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost,::1"
    return env


def _mcp_command() -> list[str]:
    return [sys.executable, "-m", weather_mcp.__name__]


def _claude_code(
    endpoint: Endpoint, home: Path, project: Path, prompt: str, env: dict[str, str], weather: bool
) -> list[str]:
    # Claude Code's documented variables for an LLM gateway: base URL (no /v1), key (sent as
    # x-api-key), the main and small/fast model names, non-essential traffic off.
    env.update(
        {
            "ANTHROPIC_BASE_URL": endpoint.root_url,
            "ANTHROPIC_API_KEY": endpoint.api_key,
            "ANTHROPIC_MODEL": endpoint.model,
            "ANTHROPIC_SMALL_FAST_MODEL": endpoint.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": endpoint.model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": endpoint.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": endpoint.model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        }
    )
    argv = [str(binary(CLAUDE_CODE)), "-p", prompt, "--output-format", "json"]
    if weather:
        config = home / "mcp.json"
        server = {"command": _mcp_command()[0], "args": _mcp_command()[1:]}
        config.write_text(json.dumps({"mcpServers": {weather_mcp.SERVER_NAME: server}}))
        tool = f"mcp__{weather_mcp.SERVER_NAME}__{weather_mcp.TOOL_NAME}"
        argv += ["--mcp-config", str(config), "--strict-mcp-config", "--allowedTools", tool]
        # MCP tools are otherwise deferred behind its ToolSearch tool (a name, no schema, until
        # fetched): declared up front, the model sees get_weather's schema in the first turn.
        env["ENABLE_TOOL_SEARCH"] = "false"
    return argv


def _codex(
    endpoint: Endpoint, home: Path, project: Path, prompt: str, env: dict[str, str], weather: bool
) -> list[str]:
    # Codex's documented custom provider: config.toml in CODEX_HOME, the Responses wire API.
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    lines = [
        f'model = "{endpoint.model}"',
        f'model_provider = "{PROVIDER}"',
        "",
        f"[model_providers.{PROVIDER}]",
        'name = "inferplane"',
        f'base_url = "{endpoint.v1_url}"',
        f'env_key = "{KEY_ENV}"',
        'wire_api = "responses"',
        "request_max_retries = 0",
        "stream_max_retries = 0",
        "",
        "[analytics]",
        "enabled = false",
    ]
    if weather:
        lines += [
            "",
            f"[mcp_servers.{weather_mcp.SERVER_NAME}]",
            f"command = {json.dumps(_mcp_command()[0])}",
            f"args = {json.dumps(_mcp_command()[1:])}",
            f"env = {{ {weather_mcp.CALLS_ENV} = {json.dumps(env[weather_mcp.CALLS_ENV])} }}",
            # An optional server still starting is left out of the first request; a required
            # one is waited for (up to startup_timeout_sec: Python's start on a loaded box).
            "required = true",
            "startup_timeout_sec = 120",
            # `exec` never asks: a tool that needs approval fails unless approved here.
            'default_tools_approval_mode = "approve"',
        ]
    (codex_home / "config.toml").write_text("\n".join(lines) + "\n")
    env.update({"CODEX_HOME": str(codex_home), KEY_ENV: endpoint.api_key})
    return [
        str(binary(CODEX)),
        "exec",
        "--json",
        "--skip-git-repo-check",
        "--ephemeral",
        "--sandbox",
        "read-only",
        prompt,
    ]


def _opencode(
    endpoint: Endpoint, home: Path, project: Path, prompt: str, env: dict[str, str], weather: bool
) -> list[str]:
    # OpenCode's documented custom provider: an openai-compatible provider in opencode.json.
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "inferplane",
                "options": {"baseURL": endpoint.v1_url, "apiKey": f"{{env:{KEY_ENV}}}"},
                "models": {
                    endpoint.model: {
                        "name": endpoint.model,
                        "limit": {
                            "context": endpoint.context_tokens,
                            "output": endpoint.output_tokens,
                        },
                    }
                },
            }
        },
        "model": f"{PROVIDER}/{endpoint.model}",
        "small_model": f"{PROVIDER}/{endpoint.model}",
        "autoupdate": False,
        "share": "disabled",
    }
    if weather:
        config["mcp"] = {
            weather_mcp.SERVER_NAME: {
                "type": "local",
                "command": _mcp_command(),
                "environment": {weather_mcp.CALLS_ENV: env[weather_mcp.CALLS_ENV]},
            }
        }
    (project / "opencode.json").write_text(json.dumps(config, indent=2))
    env.update(
        {
            KEY_ENV: endpoint.api_key,
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        }
    )
    model = f"{PROVIDER}/{endpoint.model}"
    # --thinking: the reasoning parts are in the JSON output too (the turn's text when the
    # model only reasons, as the fixture model does).
    argv = [str(binary(OPENCODE)), "run", "--format", "json", "--thinking", "--model", model]
    return [*argv, prompt]
