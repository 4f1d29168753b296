"""`python -m inferplane.router [--port N] [--config FILE]` starts the router service."""

import sys

from inferplane.grpc_core import use_service_defaults


def main() -> None:
    """Parses settings once and serves until SIGTERM."""
    use_service_defaults()  # before grpc is imported: its core reads the setting once
    from inferplane.router.app import build_app
    from inferplane.router.settings import RouterSettings
    from inferplane.runtime import load_settings, run

    run(build_app, load_settings(RouterSettings, service="router", argv=sys.argv[1:]))


if __name__ == "__main__":
    main()
