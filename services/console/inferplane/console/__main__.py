"""`python -m inferplane.console [--port N] [--tls-dir DIR | --plaintext] ...` serves the web
console until SIGINT / SIGTERM (settings: `inferplane.console.settings.ConsoleSettings`)."""

from __future__ import annotations

import sys


def main() -> None:
    """Parses settings once and serves until a signal."""
    from aiohttp import web

    from inferplane.console.app import build_app, server_ssl
    from inferplane.console.settings import ConsoleSettings
    from inferplane.runtime import configure_logging, load_settings

    settings = load_settings(ConsoleSettings, service="console", argv=sys.argv[1:])
    configure_logging(settings.log_level, settings.json_logs)
    web.run_app(
        build_app(settings),
        host=settings.host,
        port=settings.port,
        ssl_context=server_ssl(settings),
        shutdown_timeout=settings.grace_period_seconds,
        print=None,
        access_log=None,
    )


if __name__ == "__main__":
    main()
