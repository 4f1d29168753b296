"""`inferplane deployments ...`: the model catalogue over gRPC.

The typer app `app` is mounted by the top-level CLI as `inferplane deployments`. It talks to the
orchestrator directly (`--address`, env `INFERPLANE_ORCHESTRATOR_ADDRESS`, default
127.0.0.1:50053) through the SDK (`inferplane.sdk`).

`create --file deployment.yaml` reads a `Deployment` in the proto's field names plus
`deployment_id`:

```yaml
deployment_id: llama-3.3-70b
aliases: [meta-llama/Llama-3.3-70B-Instruct]
replicas: 2
profile:
  model_source: meta-llama/Llama-3.3-70B-Instruct
  precision: fp8
  parameter_count: 70600000000
  num_layers: 80
  num_kv_heads: 8
  head_dim: 128
  kv_cache_dtype: fp8
  max_model_len: 131072
  max_num_seqs: 64
  expected_context_tokens: 8192
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
import yaml
from google.protobuf import json_format
from rich.console import Console
from rich.table import Table

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.sdk import Client, ConfigError, Deployments, InferplaneError

app = typer.Typer(
    help="The model catalogue: create, list and explain deployments; their autoscaling.",
    no_args_is_help=True,
    add_completion=False,
)

DEFAULT_ADDRESS = "127.0.0.1:50053"
Address = Annotated[
    str,
    typer.Option(
        "--address", envvar="INFERPLANE_ORCHESTRATOR_ADDRESS", help="Orchestrator host:port."
    ),
]
pb = orchestrator_pb2
# The CLI's deadline per call (the SDK retries reads within it).
TIMEOUT_SECONDS = 30.0


@contextlib.contextmanager
def _deployments(address: str) -> Iterator[Deployments]:
    """The SDK's deployments client as the operator (`operator_security`); failed calls
    become `error: CODE: details` (the gRPC code) on stderr and exit code 1."""
    try:
        client = Client(orchestrator=address, timeout=TIMEOUT_SECONDS)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    with client:
        try:
            yield client.deployments
        except InferplaneError as exc:
            typer.echo(f"error: {exc.grpc_code.name}: {exc.message}", err=True)
            raise typer.Exit(1) from None


@app.command()
def explain(
    name: Annotated[str, typer.Argument(help="Deployment id or alias.")],
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Print why each replica sits where it does, or exactly why it cannot be placed."""
    with _deployments(address) as client:
        lines = client.explain(name)
    for line in lines:
        typer.echo(line)


@app.command("list")
def list_(address: Address = DEFAULT_ADDRESS) -> None:
    """List deployments with their replicas, phase and revision."""
    with _deployments(address) as client:
        deployments = list(client.list(page_size=500))
    table = Table(title="deployments", title_justify="left")
    for column in ("NAME", "ALIASES", "READY", "PHASE", "PRECISION", "TP", "REVISION"):
        table.add_column(column, overflow="fold")
    for d in deployments:
        table.add_row(
            d.name.removeprefix("deployments/"),
            ",".join(d.aliases) or "-",
            f"{d.status.ready_replicas}/{d.replicas}",
            d.status.phase,
            d.profile.precision,
            str(d.profile.tensor_parallel_size),
            d.status.current_revision,
        )
    Console(width=160).print(table)


@app.command()
def autoscale(
    name: Annotated[str, typer.Argument(help="Deployment id or alias.")],
    limit: Annotated[int, typer.Option("--limit", help="Recent decisions to show.")] = 20,
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Print a deployment's autoscaling: settings, status, signals and recent decisions."""
    with _deployments(address) as client:
        d = client.get(name)
        decisions = client.autoscaler_decisions(d.name, page_size=limit)
    console = Console(width=160)
    a, status = d.autoscaling, d.status.autoscaler
    if not a.enabled:
        console.print(f"{d.name}: autoscaling off (replicas {d.replicas}, set by the operator)")
    else:
        zero = (
            f"scale to zero after {a.idle_seconds_before_zero or 300} s idle"
            if a.scale_to_zero
            else "no scale to zero"
        )
        console.print(
            f"{d.name}: replicas {d.replicas} (bounds {d.min_replicas}..{d.max_replicas}, "
            f"{d.status.ready_replicas} ready), {zero}; desired {status.desired_replicas}, "
            f"last decision {status.last_decision or '-'}: {status.reason or '-'}"
        )
        signals = Table(title="signals", title_justify="left")
        signals.add_column("SIGNAL")
        signals.add_column("VALUE", justify="right")
        for field in pb.AutoscalerSignals.DESCRIPTOR.fields:
            value = getattr(status.signals, field.name)
            signals.add_row(field.name, f"{value:.3f}" if isinstance(value, float) else str(value))
        console.print(signals)
    table = Table(title="recent decisions (newest first)", title_justify="left")
    for column in ("TIME", "DECISION", "REPLICAS", "REASON"):
        table.add_column(column, overflow="fold")
    for decision in decisions:
        table.add_row(
            decision.time.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"),
            decision.decision,
            f"{decision.from_replicas} -> {decision.to_replicas}",
            decision.reason,
        )
    console.print(table)


def _read_deployment(path: Path) -> tuple[str, pb.Deployment]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        typer.echo(f"error: cannot read {path}: {exc}", err=True)
        raise typer.Exit(2) from None
    if not isinstance(data, dict):
        typer.echo(f"error: {path} must hold a mapping", err=True)
        raise typer.Exit(2)
    data = dict(data)
    deployment_id = str(data.pop("deployment_id", "") or "")
    name = str(data.pop("name", "") or "")
    deployment_id = deployment_id or name.removeprefix("deployments/")
    if not deployment_id:
        typer.echo(f"error: {path} needs deployment_id", err=True)
        raise typer.Exit(2)
    try:
        message = json_format.ParseDict(data, pb.Deployment())
    except json_format.ParseError as exc:
        typer.echo(f"error: {path}: {exc}", err=True)
        raise typer.Exit(2) from None
    return deployment_id, message


@app.command()
def create(
    file: Annotated[Path, typer.Option("--file", "-f", help="deployment.yaml")],
    validate_only: Annotated[
        bool, typer.Option("--validate-only", help="Check and preview; create nothing.")
    ] = False,
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Create a deployment from a YAML file and print where its replicas go."""
    deployment_id, message = _read_deployment(file)
    with _deployments(address) as client:
        created = client.create(deployment_id, message, validate_only=validate_only)
        verb = "valid (nothing created)" if validate_only else "created"
        typer.echo(
            f"{created.name} {verb}: revision {created.status.current_revision}, "
            f"{created.status.phase}: {created.status.message}"
        )
        if not validate_only:
            for line in client.explain(created.name):
                typer.echo(line)


adapters = typer.Typer(
    help="LoRA adapters on top of a base deployment: create, list, get, delete (issue 29).",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(adapters, name="adapters")


def _adapter_line(a: pb.LoraAdapter) -> str:
    base = a.base_deployment.removeprefix("deployments/")
    aliases = f" (aliases {', '.join(a.aliases)})" if a.aliases else ""
    return (
        f"{a.name}: model {base}:{a.name.removeprefix('adapters/')}{aliases}, rank {a.rank}, "
        f"{a.phase}, source {a.source}"
    )


@adapters.command("create")
def adapter_create(
    adapter_id: Annotated[str, typer.Argument(help="Adapter id: clients send {base}:{id}.")],
    base: Annotated[str, typer.Option("--base", help="Base deployment id or alias.")],
    source: Annotated[
        str, typer.Option("--source", help="Adapter folder (PEFT) under the adapter root.")
    ],
    rank: Annotated[
        int, typer.Option("--rank", help="Rank (8, 16, ..., 512); 0: from adapter_config.json.")
    ] = 0,
    alias: Annotated[
        list[str] | None, typer.Option("--alias", help="Another model name (repeatable).")
    ] = None,
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Add a LoRA adapter served by a base deployment's replicas."""
    adapter = pb.LoraAdapter(base_deployment=base, source=source, rank=rank, aliases=alias or [])
    with _deployments(address) as client:
        created = client.create_adapter(adapter_id, adapter)
    typer.echo(f"created {_adapter_line(created)}")


@adapters.command("list")
def adapter_list(
    base: Annotated[str, typer.Option("--base", help="Only this deployment's adapters.")] = "",
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """List adapters (model name, base, rank, phase, source)."""
    with _deployments(address) as client:
        found = client.list_adapters(base)
    table = Table(title="adapters", title_justify="left")
    for column in ("MODEL", "ALIASES", "RANK", "PHASE", "SOURCE"):
        table.add_column(column, overflow="fold")
    for a in found:
        base_id = a.base_deployment.removeprefix("deployments/")
        table.add_row(
            f"{base_id}:{a.name.removeprefix('adapters/')}",
            ",".join(a.aliases) or "-",
            str(a.rank),
            a.phase,
            a.source,
        )
    Console(width=160).print(table)


@adapters.command("get")
def adapter_get(
    adapter_id: Annotated[str, typer.Argument(help="Adapter id or adapters/{id}.")],
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Print one adapter."""
    with _deployments(address) as client:
        typer.echo(_adapter_line(client.get_adapter(adapter_id)))


@adapters.command("delete")
def adapter_delete(
    adapter_id: Annotated[str, typer.Argument(help="Adapter id or adapters/{id}.")],
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Delete an adapter: out of the routing table now, gone after its base's drain grace."""
    with _deployments(address) as client:
        left = client.delete_adapter(adapter_id)
    if left is None:
        typer.echo(f"adapters/{adapter_id.removeprefix('adapters/')} deleted")
    else:
        typer.echo(f"{left.name} {left.phase}: no new request; gone once requests drained")
