"""Revisions of the orchestrator database (Alembic loads them by file name, not as modules)."""
