"""`python -m inferplane.auth [--port N] [--data-dir DIR] [--config FILE]`: the auth service."""

import sys

from inferplane.grpc_core import use_service_defaults


def main() -> None:
    """Parses settings once and serves until SIGTERM."""
    use_service_defaults()  # before grpc is imported: its core reads the setting once
    from inferplane.auth.app import build_app
    from inferplane.auth.settings import load_auth_settings
    from inferplane.runtime import run

    run(build_app, load_auth_settings(sys.argv[1:]))


if __name__ == "__main__":
    main()
