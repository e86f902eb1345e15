"""Run the Alembic migrations programmatically: ``upgrade_database`` / ``downgrade_database``.

Both are blocking calls that run their own event loop; the app calls ``upgrade_database`` in a
thread at start-up (``await asyncio.to_thread(upgrade_database, url)``).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import app

# The migrations live next to the package in the source tree (the top-level ``migrations/``).
MIGRATIONS_DIR = Path(app.__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    """An Alembic config for ``url`` that needs no ini file and leaves logging alone."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Passed as an attribute, not an ini option: a password may contain '%', which ini files
    # would try to interpolate.
    config.attributes["database_url"] = url
    return config


def upgrade_database(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade_database(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)
