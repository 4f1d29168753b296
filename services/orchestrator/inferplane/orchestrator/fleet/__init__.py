"""The fleet: nodes, their accelerators, and liveness from heartbeats (pure domain)."""
