"""Alembic environment: migrations run over an async engine (aiosqlite or asyncpg).

The database URL is, in order: ``config.attributes["database_url"]`` (set by
``app.db.migrate``), the ``sqlalchemy.url`` option, or ``DATABASE_URL`` read through
``app.settings.Settings`` when the ``alembic`` command runs this file.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from app.db.models import Base
from app.db.session import async_database_url, create_engine

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if url:
        return str(url)
    from app.settings import Settings  # only the CLI gets here; the app always passes the URL

    return Settings().database_url


def configure_options(dialect_name: str) -> dict[str, object]:
    return {
        "target_metadata": target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        "render_as_batch": dialect_name == "sqlite",
        "compare_type": True,
    }


def run_migrations_offline() -> None:
    url = async_database_url(database_url())
    context.configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **configure_options(url.get_backend_name()),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_sync_migrations(connection: Connection) -> None:
    context.configure(connection=connection, **configure_options(connection.dialect.name))
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations() -> None:
    # Foreign keys off: a SQLite batch migration drops and recreates tables, and that drop must
    # not cascade into the child tables.
    engine = create_engine(database_url(), enforce_foreign_keys=False, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(run_sync_migrations)
    finally:
        await engine.dispose()


def run() -> None:
    # Only the CLI has an ini file; the app keeps its own logging configuration.
    if config.config_file_name is not None:
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    if context.is_offline_mode():
        run_migrations_offline()
    else:
        asyncio.run(run_async_migrations())


run()
