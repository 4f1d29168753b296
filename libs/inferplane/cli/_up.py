"""`inferplane up` and `inferplane status`."""

from __future__ import annotations

import json
import signal
import ssl
import threading
import time
import urllib.request
from pathlib import Path
from typing import Annotated

import grpc
import typer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.table import Table

from inferplane.api.nodeagent.v1 import nodeagent_pb2, nodeagent_pb2_grpc
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import (
    EMBED_MODEL_NAME,
    MODEL_NAME,
    QWEN3_MODEL_NAME,
    SPEECH_MODEL_NAME,
    UP_SAMPLING_DEFAULTS,
    Stack,
    StackConfig,
    StackError,
)
from inferplane.runtime import InferplaneError
from inferplane.runtime.security.identity import ADMIN, PeerSecurity
from inferplane.runtime.tracing import DEFAULT_SAMPLING_RATIO
from inferplane.sdk import Client

DEFAULT_DATA_DIR = Path(".state")

DataDir = Annotated[Path, typer.Option(help="Where state, logs and the auth database live.")]


def up(
    data_dir: DataDir = DEFAULT_DATA_DIR,
    port: Annotated[int, typer.Option(help="The OpenAI-compatible HTTP port (Envoy).")] = 8080,
    grpc_base_port: Annotated[
        int, typer.Option(help="Services listen on this port and the next four.")
    ] = 50051,
    envoy_admin_port: Annotated[int, typer.Option(help="Envoy's admin port.")] = 9901,
    console_port: Annotated[
        int, typer.Option(help="The web console's own port (browsers use the edge's /console/).")
    ] = 8090,
    tls: Annotated[
        bool,
        typer.Option(
            help="Serve HTTPS on --port with a certificate from a local CA kept in "
            "<data-dir>/pki (created once, then reused); clients trust its ca.crt."
        ),
    ] = False,
    plaintext: Annotated[
        bool,
        typer.Option(
            help="Development only: the services talk plaintext gRPC, without identities "
            "(by default they use mutual TLS from the local CA in <data-dir>/pki)."
        ),
    ] = False,
    embeddings: Annotated[
        bool, typer.Option(help="Also serve the embed-tiny embedding model (/v1/embeddings).")
    ] = True,
    speech: Annotated[
        bool,
        typer.Option(help="Also serve the whisper-tiny speech model (/v1/audio/transcriptions)."),
    ] = True,
    qwen3: Annotated[
        bool,
        typer.Option(help="Also serve qwen3-tiny, the Qwen3 chat family beside kimi-tiny's Kimi."),
    ] = True,
    max_model_len: Annotated[
        int,
        typer.Option(
            help="The chat models' context length in tokens (prompt + completion), at most "
            "their position limit; the default holds a coding agent's prompt."
        ),
    ] = kimi_tiny.MAX_MODEL_LEN,
    otlp_traces_endpoint: Annotated[
        str,
        typer.Option(
            help="An OpenTelemetry collector (OTLP/gRPC host:port) every service, replica and "
            "the edge send their spans to (docs/tracing.md); empty: no tracing."
        ),
    ] = "",
    trace_sampling_ratio: Annotated[
        float, typer.Option(help="Share (0..1) of requests traced, with a collector.")
    ] = DEFAULT_SAMPLING_RATIO,
) -> None:
    """Run the whole stack locally on the fixture model until Ctrl-C or SIGTERM."""
    console = Console()
    config = StackConfig(
        data_dir=data_dir.resolve(),
        http_port=port,
        grpc_base_port=grpc_base_port,
        envoy_admin_port=envoy_admin_port,
        console_port=console_port,
        tls=tls,
        plaintext=plaintext,
        embeddings=embeddings,
        speech=speech,
        qwen3=qwen3,
        max_model_len=max_model_len,
        sampling_defaults=UP_SAMPLING_DEFAULTS,
        otlp_traces_endpoint=otlp_traces_endpoint,
        trace_sampling_ratio=trace_sampling_ratio,
    )
    stack = Stack(config)
    stop = threading.Event()
    starting = True

    def on_signal(*_: object) -> None:
        # During start-up, interrupt it (start() stops what it started); afterwards, leave the
        # serving loop; repeated signals while stopping change nothing.
        if starting and not stop.is_set():
            stop.set()
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        with console.status("starting inferplane...") as status:

            def progress(message: str) -> None:
                console.log(message)
                status.update(message + "...")

            started_at = time.monotonic()
            stack.start(progress)
            key = stack.create_api_key("inferplane up")
            starting = False
    except StackError as exc:
        console.print(f"[red]inferplane up failed:[/red] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        stack.stop()  # start() already did unless the signal came just after it returned
        console.print("interrupted during start-up; nothing is left running.")
        raise typer.Exit(130) from None
    console.log(f"started in {time.monotonic() - started_at:.0f} s")
    header, examples = _banner(config, key)
    console.print(header)
    # Plain text: rich would wrap the commands (breaking copy-paste) and read [..] as markup.
    console.print(examples, markup=False, highlight=False, soft_wrap=True)
    try:
        while not stop.wait(1.0):
            dead = stack.dead_component()
            if dead:
                console.print(f"[red]{dead}[/red]\nstopping.")
                stop.set()
    finally:
        with console.status("stopping..."):
            stack.stop(lambda m: console.log(m))
        console.print("inferplane stopped; nothing is left running.")


def _banner(config: StackConfig, key: str) -> tuple[str, str]:
    url = config.base_url
    # The fixture model only answers the phrasings it was trained on (kimi_tiny.CASES).
    body = json.dumps(kimi_tiny.WEATHER.request(), separators=(",", ":"))
    models = [MODEL_NAME] + [
        name
        for name, on in (
            (QWEN3_MODEL_NAME, config.qwen3),
            (EMBED_MODEL_NAME, config.embeddings),
            (SPEECH_MODEL_NAME, config.speech),
        )
        if on
    ]
    header = f"""
[bold green]inferplane is up[/bold green]  endpoint: [bold]{url}[/bold]
models: {", ".join(models)} (chat context {config.max_model_len:,} tokens)
API key (shown once): [bold]{key}[/bold]
web console: [bold]{config.console_url}[/bold] (the admin key, or a key with the console scope)
logs: {config.data_dir / "logs"}   status: inferplane status --data-dir {config.data_dir}"""
    ca = config.ca_path
    # Clients must trust the local CA explicitly (curl --cacert, httpx verify=...).
    curl_ca = f" --cacert {ca}" if ca else ""
    http_client = ""
    if ca:
        header += f"\nTLS: clients must trust the local CA [bold]{ca}[/bold]"
        verify = f"ssl.create_default_context(cafile={str(ca)!r})"
        http_client = f",\n    http_client=httpx.Client(verify={verify})"
    imports = "import ssl, httpx\n" if ca else ""
    admin_key_file = config.data_dir / "auth" / "bootstrap-admin-key"
    if admin_key_file.exists():
        # Its path only: scrollback and screen recordings outlive the session, and the admin
        # key mints keys; the inference key above is the one meant for copy-paste.
        header += f"\nadmin key (for `inferplane keys`): in {admin_key_file}, readable by you only"
    embed_example = ""
    if config.embeddings:
        embed_example = f"""
curl{curl_ca} {url}/embeddings -H "Authorization: Bearer {key}" \\
  -H "Content-Type: application/json" -d '{{"model":"{EMBED_MODEL_NAME}","input":["hello"]}}'
"""
    speech_example = ""
    if config.speech:
        speech_example = f"""
curl{curl_ca} {url}/audio/transcriptions -H "Authorization: Bearer {key}" \\
  -F model={SPEECH_MODEL_NAME} -F file=@speech.wav -F response_format=text
"""
    return (
        header,
        f"""
curl{curl_ca} {url}/models -H "Authorization: Bearer {key}"

curl{curl_ca} {url}/chat/completions -H "Authorization: Bearer {key}" \\
  -H "Content-Type: application/json" -d '{body}'

python - <<'PY'
{imports}from openai import OpenAI
client = OpenAI(base_url="{url}", api_key="{key}"{http_client})
stream = client.chat.completions.create(model="{MODEL_NAME}", stream=True,
    messages=[{{"role": "user", "content": "Tell me something about Paris."}}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None
PY
{embed_example}{speech_example}
Ctrl-C stops everything.""",
    )


def status(data_dir: DataDir = DEFAULT_DATA_DIR) -> None:
    """Show each service, deployment and replica of the local stack with its health."""
    console = Console()
    state_file = data_dir / "stack.json"
    if not state_file.exists():
        console.print(f"no stack is running from {data_dir.resolve()} (no stack.json)")
        raise typer.Exit(1)
    state = json.loads(state_file.read_text())
    tls_dir = state.get("tls_dir", "")
    security = PeerSecurity(Path(tls_dir), ADMIN) if tls_dir else PeerSecurity.plaintext(ADMIN)
    table = Table(title=f"inferplane at {state['base_url']}")
    for column in ("component", "address", "health"):
        table.add_column(column)
    healthy = True
    for name, port in state["ports"].items():
        health = _health(security, f"127.0.0.1:{port}")
        healthy &= health == "SERVING"
        table.add_row(name, f"127.0.0.1:{port}", health)
    edge = _envoy_ready(state["envoy_admin_port"])
    healthy &= edge == "LIVE"
    table.add_row("envoy", f"127.0.0.1:{state['http_port']}", edge)
    if state.get("console_url"):
        console_health = _console_health(state["console_url"], state.get("ca_path", ""))
        healthy &= console_health == "SERVING"
        table.add_row("console", state["console_url"], console_health)
    try:
        with Client(
            orchestrator=f"127.0.0.1:{state['ports']['orchestrator']}", security=security, timeout=5
        ) as client:
            deployments = list(client.deployments.list())
        for deployment in deployments:
            # Progressing is a rollout in flight (the serving replicas still serve).
            healthy &= deployment.status.phase in ("Available", "Progressing")
            table.add_row(
                f"deployment {deployment.name.removeprefix('deployments/')}",
                f"revision {deployment.status.current_revision[:8]}",
                f"{deployment.status.phase}: {deployment.status.message}",
            )
    except InferplaneError as exc:
        healthy = False
        table.add_row("deployments", "-", f"unknown ({exc.reason})")
    try:
        with security.channel(f"127.0.0.1:{state['ports']['node_agent']}") as channel:
            replicas = (
                nodeagent_pb2_grpc.NodeAgentServiceStub(channel)
                .ListReplicas(nodeagent_pb2.ListReplicasRequest(), timeout=5)
                .replicas
            )
        for replica in replicas:
            state_name = nodeagent_pb2.Replica.State.Name(replica.state).removeprefix("STATE_")
            # STARTING and DRAINING are the two halves of a rolling release.
            healthy &= state_name in ("READY", "STARTING", "DRAINING")
            table.add_row(
                f"replica {replica.name}",
                replica.spec.served_model_name,
                f"{state_name} (restarts {replica.restart_count})",
            )
    except grpc.RpcError as exc:
        healthy = False
        table.add_row("replicas", "-", f"unknown ({exc.code().name})")
    console.print(table)
    if not healthy:
        raise typer.Exit(1)


def _health(security: PeerSecurity, address: str) -> str:
    try:
        with security.channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
    except grpc.RpcError as exc:
        return f"DOWN ({exc.code().name})"


def _console_health(console_url: str, ca_path: str) -> str:
    """The web console's health page, through the edge (as a browser reaches it)."""
    context = ssl.create_default_context(cafile=ca_path) if ca_path else None
    try:
        with urllib.request.urlopen(console_url + "healthz", timeout=2, context=context) as r:
            return "SERVING" if r.status == 200 else f"HTTP {r.status}"
    except OSError as exc:
        return f"DOWN ({exc})"


def _envoy_ready(admin_port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=2) as r:
            return str(r.read().decode().strip())
    except OSError as exc:
        return f"DOWN ({exc})"
