"""`inferplane keys ...`: manage API keys over gRPC with an admin key.

The typer app `app` is mounted by the top-level CLI as `inferplane keys`. It talks to the auth
service directly (`--address`, default 127.0.0.1:50051) through the SDK (`inferplane.sdk`) with
an admin key (`--admin-key` or env `INFERPLANE_ADMIN_KEY`; the generated bootstrap key is in
`<data_dir>/bootstrap-admin-key`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from google.protobuf import timestamp_pb2
from rich.console import Console
from rich.table import Table

from inferplane.api.auth.v1 import auth_pb2
from inferplane.sdk import Client, ConfigError, InferplaneError, Keys

app = typer.Typer(
    help="Manage inferplane API keys (needs an admin key).",
    no_args_is_help=True,
    add_completion=False,
)

Address = Annotated[
    str,
    typer.Option("--address", envvar="INFERPLANE_AUTH_ADDRESS", help="Auth service host:port."),
]
AdminKey = Annotated[
    str,
    typer.Option(
        "--admin-key",
        envvar="INFERPLANE_ADMIN_KEY",
        help="An API key with the admin scope.",
        show_default=False,
    ),
]
DEFAULT_ADDRESS = "127.0.0.1:50051"
_STATE_NAMES = {
    auth_pb2.ApiKey.STATE_ACTIVE: "active",
    auth_pb2.ApiKey.STATE_REVOKED: "revoked",
    auth_pb2.ApiKey.STATE_EXPIRED: "expired",
}


@contextlib.contextmanager
def admin_client(address: str, admin_key: str, *, timeout: float = 30.0) -> Iterator[Client]:
    """The SDK's client of auth at `address` as the operator (`operator_security`) with the
    admin key, for the `keys` and `usage` commands (`timeout`: each call's deadline, seconds):
    no key or no operator identity → a one-line error, exit 2; failed calls → `error: CODE:
    details` (the gRPC code), exit 1."""
    if not admin_key:
        typer.echo(
            "error: no admin key; pass --admin-key or set INFERPLANE_ADMIN_KEY "
            "(the generated one is in <data_dir>/bootstrap-admin-key)",
            err=True,
        )
        raise typer.Exit(2)
    try:
        client = Client(auth=address, admin_key=admin_key, timeout=timeout)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    with client:
        try:
            yield client
        except InferplaneError as exc:
            typer.echo(f"error: {exc.grpc_code.name}: {exc.message}", err=True)
            raise typer.Exit(1) from None


@contextlib.contextmanager
def _keys(address: str, admin_key: str) -> Iterator[Keys]:
    with admin_client(address, admin_key) as client:
        yield client.keys


def _when(value: timestamp_pb2.Timestamp) -> str:
    if not value.ByteSize():  # unset (the epoch itself never occurs here)
        return "-"
    return value.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%d %H:%MZ")


def _table(keys: list[auth_pb2.ApiKey], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("ID", no_wrap=True, min_width=16)  # what revoke/rotate take
    for column in ("NAME", "TENANT", "SCOPES", "MODELS", "TIER", "REGION", "PREFIX", "STATE"):
        table.add_column(column, overflow="fold")
    for column in ("CREATED", "LAST USED", "EXPIRES"):
        table.add_column(column)
    for k in keys:
        table.add_row(
            k.name.removeprefix("api-keys/"),
            k.display_name or "-",
            k.tenant,
            ",".join(k.scopes),
            ",".join(k.allowed_models) or "all",
            k.tier,
            (k.home_region or "-") + (" (pinned)" if k.region_pinned else ""),
            k.key_prefix + "…",
            _STATE_NAMES.get(k.state, "?"),
            _when(k.create_time),
            _when(k.last_used_time),
            _when(k.expire_time),
        )
    return table


def _show_secret(console: Console, key: auth_pb2.ApiKey, secret: str, what: str) -> None:
    console.print(f"[bold]{what}[/bold] of {key.name} (shown once; store it now):")
    # Plain echo: rich could wrap or style the secret when the terminal is narrow.
    typer.echo(secret)


@app.command()
def create(
    display_name: Annotated[str, typer.Option("--name", help="A label for the key.")] = "",
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to.")] = "default",
    scope: Annotated[
        list[str] | None, typer.Option(help="Scope (inference, admin); repeatable.")
    ] = None,
    model: Annotated[
        list[str] | None, typer.Option(help="Allowed model; repeatable; none = all.")
    ] = None,
    expires_in_days: Annotated[
        float | None, typer.Option(help="Days until the key expires; default never.")
    ] = None,
    tier: Annotated[str, typer.Option(help="standard or priority.")] = "standard",
    rpm: Annotated[int, typer.Option(help="Requests per minute; 0 = unlimited.")] = 0,
    tpm: Annotated[int, typer.Option(help="Tokens per minute; 0 = unlimited.")] = 0,
    max_concurrent: Annotated[int, typer.Option(help="Requests in flight; 0 = unlimited.")] = 0,
    region_pinned: Annotated[
        bool,
        typer.Option(
            help="Pin the key to the region of this auth (data residency: never served "
            "elsewhere; needs an auth with --region)."
        ),
    ] = False,
    address: Address = DEFAULT_ADDRESS,
    admin_key: AdminKey = "",
) -> None:
    """Create a key and print its secret (the only time it is shown)."""
    key = auth_pb2.ApiKey(
        display_name=display_name,
        tenant=tenant,
        scopes=scope or ["inference"],
        allowed_models=model or [],
        tier=tier,
        limits=auth_pb2.Limits(
            requests_per_minute=rpm, tokens_per_minute=tpm, max_concurrent_requests=max_concurrent
        ),
        region_pinned=region_pinned,
    )
    if expires_in_days is not None:
        key.expire_time.FromDatetime(datetime.now(UTC) + timedelta(days=expires_in_days))
    console = Console()
    with _keys(address, admin_key) as client:
        created = client.create(key)
    console.print(_table([created.api_key], "Created"))
    _show_secret(console, created.api_key, created.secret, "Secret")


@app.command("list")
def list_keys(
    tenant: Annotated[str, typer.Option(help="Only this tenant's keys.")] = "",
    show_all: Annotated[
        bool, typer.Option("--all", help="Include revoked and expired keys.")
    ] = False,
    address: Address = DEFAULT_ADDRESS,
    admin_key: AdminKey = "",
) -> None:
    """List keys, newest first."""
    with _keys(address, admin_key) as client:
        keys = list(client.list(tenant=tenant, show_inactive=show_all, page_size=500))
    Console().print(_table(keys, f"{len(keys)} API key(s)"))


@app.command()
def revoke(
    key: Annotated[str, typer.Argument(help="Key id or api-keys/{id}.")],
    address: Address = DEFAULT_ADDRESS,
    admin_key: AdminKey = "",
) -> None:
    """Revoke a key: it stops working at once (other auth instances within the cache TTL)."""
    with _keys(address, admin_key) as client:
        revoked = client.revoke(key)
    Console().print(_table([revoked], "Revoked"))


@app.command()
def rotate(
    key: Annotated[str, typer.Argument(help="Key id or api-keys/{id}.")],
    grace_seconds: Annotated[int, typer.Option(help="How long the old secret keeps working.")] = 0,
    address: Address = DEFAULT_ADDRESS,
    admin_key: AdminKey = "",
) -> None:
    """Issue a new secret for a key; the old one works for --grace-seconds more."""
    console = Console()
    with _keys(address, admin_key) as client:
        rotated = client.rotate(key, grace_period_seconds=grace_seconds)
    console.print(_table([rotated.api_key], "Rotated"))
    _show_secret(console, rotated.api_key, rotated.secret, "New secret")
