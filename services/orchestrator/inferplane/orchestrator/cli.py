"""`inferplane deployments ...`: the model catalogue over gRPC.

The typer app `app` is mounted by the top-level CLI as `inferplane deployments`. It talks to the
orchestrator directly (`--address`, env `INFERPLANE_ORCHESTRATOR_ADDRESS`, default
127.0.0.1:50053) through the SDK (`inferplane.sdk`).

`create --file deployment.yaml` reads a `Deployment` in the proto's field names plus
`deployment_id` (`update --file` the same, setting only the fields the file names;
`--force --force-reason "..."` on both overrides a failed verdict of the compatibility matrix,
which `compat list` and `compat forced` show):

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
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
import yaml
from google.protobuf import json_format, timestamp_pb2
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


@app.command()
def status(
    name: Annotated[str, typer.Argument(help="Deployment id or alias.")],
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Print a deployment's phase and its release: stage, candidate revision, canary share and
    the gates' verdicts (conformance, performance, canary) with their numbers."""
    with _deployments(address) as client:
        d = client.get(name)
    console = Console(width=160)
    st = d.status
    target = f" -> {st.target_revision}" if st.target_revision else ""
    console.print(
        f"{d.name}: {st.phase} ({st.ready_replicas}/{d.replicas} ready), revision "
        f"{st.current_revision}{target}: {st.message}",
        markup=False,
    )
    release = st.release
    if not release.stage:
        console.print("release: none yet (a deployment's first revision runs no gates)")
        return
    share = f", canary {release.canary_percent}% of live traffic" if release.canary_percent else ""
    console.print(
        f"release of {release.candidate_revision}: {release.stage}{share}: {release.message}",
        markup=False,
    )
    table = Table(title="gate verdicts (in the order they ran)", title_justify="left")
    for column in ("GATE", "RESULT", "SECONDS", "DECIDED", "REASON"):
        table.add_column(column, overflow="fold")
    for v in release.verdicts:
        table.add_row(
            v.gate,
            v.result,
            f"{v.seconds:.1f}",
            _time(v.decide_time) if v.HasField("decide_time") else "-",
            v.reason,
        )
    console.print(table)


Force = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Go ahead although the compatibility matrix holds a failed verdict (audited; "
        "needs --force-reason).",
    ),
]
ForceReason = Annotated[
    str, typer.Option("--force-reason", help="Why the failed verdict is overridden.")
]


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
    force: Force = False,
    force_reason: ForceReason = "",
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Create a deployment from a YAML file and print where its replicas go."""
    deployment_id, message = _read_deployment(file)
    with _deployments(address) as client:
        created = client.create(
            deployment_id,
            message,
            validate_only=validate_only,
            force=force,
            force_reason=force_reason,
        )
        verb = "valid (nothing created)" if validate_only else "created"
        typer.echo(
            f"{created.name} {verb}: revision {created.status.current_revision}, "
            f"{created.status.phase}: {created.status.message}"
        )
        if not validate_only:
            for line in client.explain(created.name):
                typer.echo(line)


def _paths(data: dict[str, object], prefix: str = "") -> list[str]:
    """The update mask a YAML file means: every field it sets (nested profile/rollout/
    autoscaling fields one by one), ids and names left out."""
    paths = []
    for key, value in data.items():
        if not prefix and key in ("deployment_id", "name"):
            continue
        if isinstance(value, dict) and not prefix:
            paths.extend(_paths(value, f"{key}."))
        else:
            paths.append(f"{prefix}{key}")
    return paths


@app.command()
def update(
    file: Annotated[Path, typer.Option("--file", "-f", help="The fields to set, as YAML.")],
    force: Force = False,
    force_reason: ForceReason = "",
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Set the fields a YAML file names (deployment_id plus e.g. profile.engine_version); a
    profile change is a new revision, rolled out."""
    deployment_id, message = _read_deployment(file)
    message.name = deployment_id
    paths = _paths(yaml.safe_load(file.read_text()) or {})
    if not paths:
        typer.echo(f"error: {file} sets no field", err=True)
        raise typer.Exit(2)
    with _deployments(address) as client:
        updated = client.update(message, paths, force=force, force_reason=force_reason)
    typer.echo(
        f"{updated.name} updated ({', '.join(paths)}): {updated.status.phase}: "
        f"{updated.status.message}"
    )


compat = typer.Typer(
    help="The compatibility matrix: release verdicts per engine version, weights, chat "
    "template and parsers; and the changes that overrode a failed one (issue 30).",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(compat, name="compat")


def _time(stamp: timestamp_pb2.Timestamp) -> str:
    return stamp.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if stamp.seconds else "-"


@compat.command("list")
def compat_list(
    deployment: Annotated[
        str, typer.Option("--deployment", help="Only verdicts measured on it.")
    ] = "",
    engine_version: Annotated[
        str, typer.Option("--engine-version", help="Only this engine version.")
    ] = "",
    verdict: Annotated[
        str, typer.Option("--verdict", help="qualified, failed or unqualified.")
    ] = "",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per entry.")] = False,
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Each combination's current verdict, newest first."""
    with _deployments(address) as client:
        entries = list(
            client.list_compatibility(
                deployment=deployment, engine_version=engine_version, verdict=verdict
            )
        )
    if as_json:
        for e in entries:
            typer.echo(json.dumps(json_format.MessageToDict(e), sort_keys=True))
        return
    table = Table(title="compatibility (newest first)", title_justify="left")
    for column in ("ENGINE", "WEIGHTS", "CHAT TEMPLATE", "PARSERS", "VERDICT", "MEASURED ON"):
        table.add_column(column, overflow="fold")
    table.add_column("REASON / TIME", overflow="fold")
    for e in entries:
        a = e.artifacts
        failing = [g for g in e.gates if g.result != "passed"]
        reason = f"{failing[0].gate}: {failing[0].reason}" if failing else ""
        table.add_row(
            f"{a.engine} {a.engine_version}",
            a.model_digest,
            a.chat_template_digest,
            a.parser,
            e.verdict,
            f"{e.deployment}@{e.revision}",
            f"{reason} ({_time(e.update_time)})" if reason else _time(e.update_time),
        )
    Console(width=200).print(table)


@compat.command("forced")
def compat_forced(
    deployment: Annotated[str, typer.Option("--deployment", help="Only this deployment.")] = "",
    limit: Annotated[int, typer.Option("--limit", help="Most recent changes to show.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per change.")] = False,
    address: Address = DEFAULT_ADDRESS,
) -> None:
    """Creates and updates that overrode a failed verdict: who, why, what; newest first."""
    with _deployments(address) as client:
        changes = client.list_forced_changes(deployment, page_size=limit)
    if as_json:
        for c in changes:
            typer.echo(json.dumps(json_format.MessageToDict(c), sort_keys=True))
        return
    table = Table(title="forced changes (newest first)", title_justify="left")
    for column in ("TIME", "DEPLOYMENT", "ACTOR", "REASON", "OVERRIDDEN"):
        table.add_column(column, overflow="fold")
    for c in changes:
        table.add_row(
            _time(c.create_time), f"{c.deployment}@{c.revision}", c.actor, c.reason, c.overridden
        )
    Console(width=200).print(table)


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
