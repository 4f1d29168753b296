"""`python -m inferplane.orchestrator [--port N] [--config FILE]` starts the orchestrator."""

import sys

from inferplane.grpc_core import use_service_defaults


def main() -> None:
    """Parses settings once and serves until SIGTERM."""
    use_service_defaults()  # before grpc is imported: its core reads the setting once
    from inferplane.orchestrator.app import build_app
    from inferplane.orchestrator.settings import OrchestratorSettings
    from inferplane.runtime import load_settings, run

    run(build_app, load_settings(OrchestratorSettings, service="orchestrator", argv=sys.argv[1:]))


if __name__ == "__main__":
    main()
