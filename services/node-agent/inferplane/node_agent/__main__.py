"""`python -m inferplane.node_agent [--port N] [--config FILE]` starts the node-agent service."""

import sys

from inferplane.grpc_core import use_service_defaults


def main() -> None:
    """Parses settings once and serves until SIGTERM."""
    use_service_defaults()  # before grpc is imported: its core reads the setting once
    from inferplane.node_agent.app import build_app
    from inferplane.node_agent.settings import NodeAgentSettings
    from inferplane.runtime import load_settings, run

    run(build_app, load_settings(NodeAgentSettings, service="node_agent", argv=sys.argv[1:]))


if __name__ == "__main__":
    main()
