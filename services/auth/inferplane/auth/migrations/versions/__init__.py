"""Revisions of the auth database (Alembic loads them by file name, not as modules)."""
