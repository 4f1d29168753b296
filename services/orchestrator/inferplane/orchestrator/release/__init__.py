"""Reconcile loop and rolling releases: desired placements → node-agent replicas."""
