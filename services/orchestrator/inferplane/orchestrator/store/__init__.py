"""Persistence of the desired state (deployments, nodes, placements) behind `StateStore`."""
