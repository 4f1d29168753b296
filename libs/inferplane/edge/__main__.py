"""`python -m inferplane.edge render`: writes (and optionally validates) a static edge bootstrap;
`render-node`: the node-local Envoy's (the Gateway API path, `NodeEnvoyConfig`); `global`: the
global tier's in front of the regions' edges (`GlobalTierConfig`, docs/regions.md).

    python -m inferplane.edge render --router 127.0.0.1:50052 --auth 127.0.0.1:50051 \
        --telemetry 127.0.0.1:50055 --replica 127.0.0.1:50061 --listen-port 8080 \
        --admin-port 9901 --validate -o deploy/envoy/edge.example.yaml
    python -m inferplane.edge render-node --listen-port 8000 --tls-dir /etc/inferplane/tls
    python -m inferplane.edge global --region eu=10.0.1.5:8080,10.0.1.6:8080 \
        --region us=10.1.1.5:8080 --fallback us=eu --default-region eu --listen-port 8443 \
        --admin-port 9903 --validate -o global.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inferplane.edge._bootstrap import render_static_bootstrap
from inferplane.edge._config import EdgeConfig, Endpoint
from inferplane.edge._errors import EdgeError
from inferplane.edge._global import UPSTREAM_PROTOCOLS, GlobalTierConfig, render_global_bootstrap
from inferplane.edge._node import NodeEnvoyConfig, render_node_bootstrap
from inferplane.edge._process import validate_bootstrap

#: The local stack's default ports (services/*/settings.py).
EXAMPLE_ARGS = (
    "--router", "127.0.0.1:50052",
    "--auth", "127.0.0.1:50051",
    "--telemetry", "127.0.0.1:50055",
    "--replica", "127.0.0.1:50061",
    "--listen-port", "8080",
    "--admin-port", "9901",
)  # fmt: skip


def config_from_args(args: argparse.Namespace) -> EdgeConfig:
    return EdgeConfig(
        router_endpoints=tuple(Endpoint.parse(r) for r in args.router),
        auth_endpoint=Endpoint.parse(args.auth),
        telemetry_endpoint=Endpoint.parse(args.telemetry) if args.telemetry else None,
        replica_endpoints=tuple(Endpoint.parse(r) for r in args.replica),
        listen_host=args.listen_host,
        listen_port=args.listen_port,
        admin_port=args.admin_port,
        tls_cert_path=args.tls_cert,
        tls_key_path=args.tls_key,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m inferplane.edge")
    sub = p.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="write a static Envoy bootstrap for the edge")
    render.add_argument("--router", action="append", required=True, help="HOST:PORT, repeatable")
    render.add_argument("--auth", required=True, help="HOST:PORT of the auth service")
    render.add_argument(
        "--telemetry", default="", help="HOST:PORT of telemetry (the edge overhead log)"
    )
    render.add_argument(
        "--replica",
        action="append",
        default=[],
        help="HOST:PORT of a replica process (repeatable; the picker chooses among them)",
    )
    render.add_argument("--listen-host", default="127.0.0.1")
    render.add_argument("--listen-port", type=int, default=8080)
    render.add_argument("--admin-port", type=int, default=9901)
    render.add_argument("--tls-cert", default="", help="PEM certificate chain: serve HTTPS")
    render.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    render.add_argument("--format", choices=("yaml", "json"), default="yaml")
    render.add_argument(
        "--validate", action="store_true", help="check it with envoy --mode validate"
    )
    render.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    glob = sub.add_parser(
        "global", help="write the global tier's bootstrap (Envoy in front of the regions)"
    )
    glob.add_argument(
        "--region",
        action="append",
        required=True,
        metavar="NAME=HOST:PORT[,HOST:PORT]",
        help="a region and its edges (repeatable; the listed order is the default fallback order)",
    )
    glob.add_argument(
        "--fallback",
        action="append",
        default=[],
        metavar="NAME=OTHER[,OTHER]",
        help="the regions NAME's keys fail over to, in order (default: every other region)",
    )
    glob.add_argument("--default-region", default="", help="home of keys naming no region")
    glob.add_argument("--listen-host", default="127.0.0.1")
    glob.add_argument("--listen-port", type=int, default=8080)
    glob.add_argument("--admin-port", type=int, default=9901)
    glob.add_argument("--upstream-protocol", choices=UPSTREAM_PROTOCOLS, default="h2c")
    glob.add_argument("--tls-cert", default="", help="PEM certificate chain: serve HTTPS")
    glob.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    glob.add_argument("--format", choices=("yaml", "json"), default="yaml")
    glob.add_argument("--validate", action="store_true", help="check it with envoy --mode validate")
    glob.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    node = sub.add_parser(
        "render-node", help="write the node-local Envoy's bootstrap (Gateway API path)"
    )
    node.add_argument("--listen-host", default="0.0.0.0")
    node.add_argument("--listen-port", type=int, default=8000, help="the pool's targetPort")
    node.add_argument("--admin-port", type=int, default=9902)
    node.add_argument(
        "--tls-dir", default="", help="ca.crt + node-agent.crt/.key (empty: plaintext h2c)"
    )
    node.add_argument("--format", choices=("yaml", "json"), default="yaml")
    node.add_argument("--validate", action="store_true", help="check it with envoy --mode validate")
    node.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    return p


def _pairs(values: list[str], flag: str) -> dict[str, list[str]]:
    """`NAME=A,B` values → {NAME: [A, B]} (an empty right side: no items).

    Raises: ValueError naming `flag` for a value without `=` or a name given twice.
    """
    result: dict[str, list[str]] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name:
            raise ValueError(f"{flag} {value!r} is not NAME=ITEM[,ITEM]")
        if name in result:
            raise ValueError(f"{flag} names {name!r} twice")
        result[name] = [item for item in rest.split(",") if item]
    return result


def global_config_from_args(args: argparse.Namespace) -> GlobalTierConfig:
    return GlobalTierConfig(
        regions=_pairs(args.region, "--region"),
        fallbacks=_pairs(args.fallback, "--fallback"),
        default_region=args.default_region,
        listen_host=args.listen_host,
        listen_port=args.listen_port,
        admin_port=args.admin_port,
        upstream_protocol=args.upstream_protocol,
        tls_cert_path=args.tls_cert,
        tls_key_path=args.tls_key,
    )


def _render(args: argparse.Namespace) -> str:
    if args.command == "global":
        return render_global_bootstrap(global_config_from_args(args), fmt=args.format)
    if args.command == "render-node":
        config = NodeEnvoyConfig(
            listen_host=args.listen_host,
            listen_port=args.listen_port,
            admin_port=args.admin_port,
            upstream_tls_dir=args.tls_dir,
        )
        return render_node_bootstrap(config, fmt=args.format)
    return render_static_bootstrap(config_from_args(args), fmt=args.format)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        text = _render(args)
        if args.validate:
            validate_bootstrap(text)
    except (EdgeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
