"""Persistence: SQLAlchemy models, the async database handle, repositories and migrations.

``Database`` (``session.py``) owns the engine; the repositories (``repositories.py``) are the only
code that speaks SQL and return frozen records, never ORM objects; ``migrate.py`` runs Alembic.
"""
