"""Records what each pinned coding agent sends in one turn, as test data.

    python tests/agents/capture.py [AGENT...]     # default: every agent

Runs each agent (`inferplane.testing.agents`, configured exactly as the scenario suite does)
against `inferplane.testing.capture_server`, which answers every request with a short
well-formed reply, twice: as configured by default (`default-NN-<api>.json`) and with the
`get_weather` MCP tool (`weather-NN-<api>.json`). Each POST of the turn is written to
`tests/data/agents/<agent>/` as `{"method", "path", "auth", "headers", "body"}`: identical
bodies (retries) once; `auth` names the header the key went in; `headers` are the agent's own,
without the key and the transport's.

Scrubbed: the throw-away directory's path (the agents put the working directory in their
prompts, Claude Code also as a slug) becomes `PROJECT_DIR` (its home `HOME_DIR`); the ids the
agents derive from the machine or the session (`metadata.user_id`, `prompt_cache_key`,
`client_metadata`; UUIDs and OpenCode's `ses_` ids in headers) become fixed strings. No key is
written: the agents are given a placeholder.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from inferplane.localstack import MODEL_NAME
from inferplane.testing import agents
from inferplane.testing.capture_server import CaptureServer

DATA = Path(__file__).resolve().parents[1] / "data" / "agents"
PROMPT = "What is the weather in Tokyo?"
MODEL = MODEL_NAME  # what the stack serves: the bodies replay unchanged
PLACEHOLDER_KEY = "sk-capture-placeholder"
# Stand-ins for the throw-away directories the capture ran in (no machine's paths in the data).
PROJECT = "PROJECT_DIR"
HOME = "HOME_DIR"
WORK = "WORK_DIR"
CHAT_ROUTES = ("/messages/count_tokens", "/messages", "/responses", "/chat/completions")
SCRUBBED = "scrubbed"
# The replaying client's own headers (and the key's), not the agent's.
TRANSPORT_HEADERS = frozenset(
    {"authorization", "x-api-key", "host", "content-length", "connection", "accept-encoding"}
)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
SESSION = re.compile(r"ses_[A-Za-z0-9]+")


def scrub_headers(headers: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, value in sorted(headers.items()):
        if name in TRANSPORT_HEADERS:
            continue
        value = UUID.sub("00000000-0000-0000-0000-000000000000", value)
        out[name] = SESSION.sub("ses_scrubbed", value)
    return out


def api_of(path: str) -> str | None:
    route = path.split("?", 1)[0].rstrip("/")
    for suffix in CHAT_ROUTES:
        if route.endswith(suffix):
            return suffix.strip("/").replace("/", "-")
    return None


def scrub(value: Any, replacements: dict[str, str]) -> Any:
    if isinstance(value, str):
        for old, new in replacements.items():
            value = value.replace(old, new)
        return value
    if isinstance(value, list):
        return [scrub(item, replacements) for item in value]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in ("user_id", "prompt_cache_key", "client_metadata") and item:
                out[key] = SCRUBBED if isinstance(item, str) else {"scrubbed": True}
            else:
                out[key] = scrub(item, replacements)
        return out
    return value


def capture(agent: str, timeout: float, weather: bool) -> list[dict[str, Any]]:
    workdir = Path(tempfile.mkdtemp(prefix=f"capture-{agent}-"))
    try:
        with CaptureServer(model=MODEL) as server:
            endpoint = agents.Endpoint(server.root_url, PLACEHOLDER_KEY, MODEL)
            run = agents.invocation(agent, endpoint, workdir, PROMPT, weather=weather)
            done = run.run(timeout)
            print(done.summary() if done.returncode else f"{agent}: exit 0, {done.seconds:.1f} s")
            replacements = {
                str(workdir / "project"): PROJECT,
                re.sub("[^A-Za-z0-9]", "-", str(workdir / "project")): "-project",
                str(workdir / "home"): HOME,
                str(workdir): WORK,
                sys.executable: "python",
                server.root_url: "http://127.0.0.1:8080",
            }
            seen: set[str] = set()
            records = []
            for request in server.requests:
                if request.method != "POST" or api_of(request.path) is None:
                    continue
                body = scrub(request.body, replacements)
                key = json.dumps(body, sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                path = re.sub(r"^.*?(/v1/)", r"\1", request.path)
                auth = "x-api-key" if "x-api-key" in request.headers else "bearer"
                headers = scrub_headers(scrub(request.headers, replacements))
                records.append(
                    {
                        "method": request.method,
                        "path": path,
                        "auth": auth,
                        "headers": headers,
                        "body": body,
                    }
                )
            return records
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("agent", nargs="*", choices=[[], *agents.AGENTS], default=[])
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    for agent in args.agent or agents.AGENTS:
        folder = DATA / agent
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        variants = {"default": capture(agent, args.timeout, weather=False)}
        variants["weather"] = capture(agent, args.timeout, weather=True)
        for variant, records in variants.items():
            for number, record in enumerate(records):
                name = f"{variant}-{number:02d}-{api_of(record['path'])}.json"
                (folder / name).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
                size = len(json.dumps(record["body"]))
                print(f"{agent}: {folder / name} ({size} bytes)")


if __name__ == "__main__":
    main()
