"""inferplane.orchestrator: the model catalogue, the fleet and the routing table."""
