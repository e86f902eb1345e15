"""A PostgreSQL database of a benchmark's own on 127.0.0.1: made for one run, dropped after it.

``BENCH_POSTGRES_URL`` names the server (default ``postgresql://postgres@127.0.0.1:5432``, trust
auth); the database is created through its ``postgres`` database and dropped with ``FORCE``.
"""

from __future__ import annotations

import os
import uuid

POSTGRES_URL = os.environ.get("BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432")


class ScratchDatabase:
    """``name`` and the service's ``url`` for it; ``await create()`` then ``await drop()``."""

    def __init__(self) -> None:
        self.name = "agentstream_bench_" + uuid.uuid4().hex[:10]
        self.url = f"{POSTGRES_URL.replace('postgresql://', 'postgresql+asyncpg://')}/{self.name}"

    async def create(self) -> None:
        await _admin(f"CREATE DATABASE {self.name}")

    async def drop(self) -> None:
        await _admin(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")


async def _admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(f"{POSTGRES_URL}/postgres", timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()
