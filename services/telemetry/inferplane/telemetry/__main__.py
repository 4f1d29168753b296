"""`python -m inferplane.telemetry [--port N] [--config FILE]` starts the telemetry service."""

import sys

from inferplane.grpc_core import use_service_defaults


def main() -> None:
    """Parses settings once and serves until SIGTERM."""
    use_service_defaults()  # before grpc is imported: its core reads the setting once
    from inferplane.runtime import load_settings, run
    from inferplane.telemetry.app import build_app
    from inferplane.telemetry.settings import TelemetrySettings

    run(build_app, load_settings(TelemetrySettings, service="telemetry", argv=sys.argv[1:]))


if __name__ == "__main__":
    main()
