"""URL normalisation and engine set-up, without touching a database server."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.db.session import async_database_url, create_engine


@pytest.mark.parametrize(
    ("given", "driver"),
    [
        ("sqlite:///./data/x.db", "sqlite+aiosqlite"),
        ("sqlite+aiosqlite:///./data/x.db", "sqlite+aiosqlite"),
        ("postgres://u:p@db/app", "postgresql+asyncpg"),
        ("postgresql://u:p@db/app", "postgresql+asyncpg"),
        ("postgresql+psycopg2://u:p@db/app", "postgresql+asyncpg"),
        ("postgresql+asyncpg://u:p@db/app", "postgresql+asyncpg"),
    ],
)
def test_database_urls_get_the_async_driver(given: str, driver: str) -> None:
    url = async_database_url(given)

    assert url.drivername == driver
    # Everything but the driver is kept as given.
    assert url.render_as_string(hide_password=False).split("://", 1)[1] == given.split("://", 1)[1]


def test_a_password_with_special_characters_survives_normalisation() -> None:
    url = async_database_url("postgresql://user:p%25ss%40word@db:5433/app")

    assert (url.password, url.host, url.port) == ("p%ss@word", "db", 5433)


def test_a_sqlite_file_engine_creates_the_missing_parent_directory(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "agentstream.db"

    create_engine(f"sqlite+aiosqlite:///{path}")

    assert path.parent.is_dir()
    assert not path.exists()  # the file itself waits for the first connection


def test_an_in_memory_sqlite_engine_creates_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    create_engine("sqlite+aiosqlite:///:memory:")

    assert list(tmp_path.iterdir()) == []
