"""What the edge's field guard (lua/field_guard.lua: 400 for request-body keys the API does not
know) adds per request: Envoy CPU and latency with and without it, on bodies of four shapes.

    .venv/bin/python bench/field_guard_cost.py [--requests 600] [--rounds 12]

Two Envoys (one worker each) hold the part of the edge's chain that matters here:
json_to_metadata (which buffers the body in the real chain too) → [field guard] → a direct
200, so the difference between them is the guard alone: its route match, copying the body
into Lua and scanning it. Both get the same sequential requests over one keep-alive
connection, alternating rounds so machine noise hits both alike. Envoy's CPU comes from
/proc schedstat (every thread, ns resolution) per round; the added CPU is the median of the
rounds' differences (each pair ran back to back); latency is the client's median.

Bodies: a short chat; an agent's turn (40 messages with tool calls and tool results, 8 tools
with JSON schemas, ~16 KB); a 1 MiB user message; a completions prompt of 100,000 token ids.
Last line: `field_guard_added_cpu_us_agent_chat: X` (goal: well under 1 ms; a generation
costs the platform milliseconds).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from inferplane.edge import EdgeConfig, Endpoint, EnvoyProcess, build_http_filters
from inferplane.runtime.processes.ports import free_port

_HCM = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    "HttpConnectionManager"
)


def cpu_seconds(pid: int) -> float:
    """CPU time (s) of every thread of `pid` (schedstat: nanoseconds, not 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def bootstrap(with_guard: bool) -> tuple[str, int, int]:
    """A static bootstrap (YAML), its listener port and its admin port."""
    port, admin = free_port(), free_port()
    config = EdgeConfig(router_endpoints=(Endpoint("127.0.0.1", 1),), auth_endpoint="127.0.0.1:2")
    keep = {"envoy.filters.http.json_to_metadata", "envoy.filters.http.router"}
    if with_guard:
        keep.add("inferplane.field_guard")
    filters = [f for f in build_http_filters(config) if f["name"] in keep]
    hcm = {
        "@type": _HCM,
        "stat_prefix": "bench",
        "http_filters": filters,
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "direct_response": {"status": 200, "body": {"inline_string": "{}"}},
                        }
                    ],
                }
            ]
        },
    }
    listener = {
        "name": "bench",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "per_connection_buffer_limit_bytes": config.max_request_bytes,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }
    doc = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [listener]},
    }
    return yaml.safe_dump(doc), port, admin


def bodies() -> dict[str, tuple[str, bytes]]:
    """name → (path, JSON body)."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "A city name, e.g. Paris"},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "units": {"type": "string", "enum": ["metric", "imperial"]},
        },
        "required": ["city"],
    }
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}}
        for i in range(8)
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 20}]
    for turn in range(13):
        messages.append({"role": "user", "content": f"Step {turn}: check the weather. " * 8})
        name = f"tool_{turn % 8}"
        call = {
            "id": f"functions.{name}:{turn}",
            "type": "function",
            "function": {"name": name, "arguments": '{"city": "Paris"}'},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": '{"t": 21} ' * 40})
    agent = {
        "model": "kimi",
        "messages": messages,
        "tools": tools,
        "tool_choice": "auto",
        "temperature": 0.6,
        "max_tokens": 512,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    small = {"model": "kimi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    long = {"model": "kimi", "messages": [{"role": "user", "content": "x" * (1 << 20)}]}
    ids = {"model": "kimi", "prompt": list(range(100_000)), "max_tokens": 1}
    encode = json.dumps
    return {
        "small_chat": ("/v1/chat/completions", encode(small).encode()),
        "agent_chat": ("/v1/chat/completions", encode(agent).encode()),
        "long_message": ("/v1/chat/completions", encode(long).encode()),
        "token_ids": ("/v1/completions", encode(ids).encode()),
    }


def run_round(
    conn: http.client.HTTPConnection, path: str, body: bytes, n: int, pid: int
) -> tuple[float, list[float]]:
    """(Envoy CPU seconds, per-request wall seconds) for `n` sequential requests."""
    headers = {"content-type": "application/json"}
    times = []
    before = cpu_seconds(pid)
    for _ in range(n):
        start = time.perf_counter()
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        times.append(time.perf_counter() - start)
        if response.status != 200:
            raise RuntimeError(f"{path}: status {response.status}")
    return cpu_seconds(pid) - before, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600, help="per body and envoy")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        envoys, conns = {}, {}
        try:
            for name, guard in (("without", False), ("with", True)):
                text, port, admin = bootstrap(guard)
                envoy = EnvoyProcess(
                    text,
                    data_dir=Path(tmp) / name,
                    admin_url=f"http://127.0.0.1:{admin}",
                    concurrency=1,
                    log_level="error",
                )
                envoy.start()
                envoys[name] = envoy
                conns[name] = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            typo = b'{"model": "kimi", "messages": [], "temprature": 0.2}'
            conns["with"].request("POST", "/v1/chat/completions", body=typo)
            rejected = conns["with"].getresponse()
            assert rejected.status == 400, rejected.status
            rejected.read()
            print(
                f"{'body':<14} {'bytes':>9} {'CPU µs/req':>22} {'p50 latency µs':>24}\n"
                f"{'':<14} {'':>9} {'without':>7} {'with':>7} {'added':>6} "
                f"{'without':>7} {'with':>7} {'added':>8}"
            )
            added_cpu: dict[str, float] = {}
            for name, (path, body) in bodies().items():
                per = max(10, args.requests // args.rounds)
                if len(body) > 100_000:
                    per = max(10, per // 8)
                cpu: dict[str, list[float]] = {"without": [], "with": []}
                times: dict[str, list[float]] = {"without": [], "with": []}
                for label in cpu:  # warm-up
                    run_round(conns[label], path, body, 5, envoys[label].pid or 0)
                for _ in range(args.rounds):
                    for label in cpu:
                        spent, wall = run_round(
                            conns[label], path, body, per, envoys[label].pid or 0
                        )
                        cpu[label].append(spent / per * 1e6)
                        times[label] += wall
                a, b = (statistics.median(cpu[k]) for k in ("without", "with"))
                # Paired by round: both Envoys ran back to back, under the same machine load.
                added = statistics.median(
                    y - x for x, y in zip(cpu["without"], cpu["with"], strict=True)
                )
                la, lb = (statistics.median(times[k]) * 1e6 for k in ("without", "with"))
                added_cpu[name] = added
                print(
                    f"{name:<14} {len(body):>9} {a:>7.0f} {b:>7.0f} {added:>6.0f} "
                    f"{la:>7.0f} {lb:>7.0f} {lb - la:>8.0f}"
                )
        finally:
            for conn in conns.values():
                conn.close()
            for envoy in envoys.values():
                envoy.stop()
    # The agent turn last: the figure the goal is about.
    for name in sorted(added_cpu, key=lambda n: n == "agent_chat"):
        print(f"field_guard_added_cpu_us_{name}: {added_cpu[name]:.0f}")


if __name__ == "__main__":
    main()
