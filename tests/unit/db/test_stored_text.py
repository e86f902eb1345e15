"""``StoredText``: text columns take what any database can store, whatever a model or tool sent."""

from __future__ import annotations

import pytest
from sqlalchemy.dialects import postgresql, sqlite

from app.db.models import Message, Run, StoredText


@pytest.mark.parametrize("dialect", [postgresql.dialect(), sqlite.dialect()], ids=["postgres", "sqlite"])
def test_nul_and_lone_surrogates_become_replacement_characters(dialect: object) -> None:
    bound = StoredText().process_bind_param("a\x00b\ud800c\udfff é", dialect)  # type: ignore[arg-type]

    assert bound == "a\ufffdb\ufffdc\ufffd é"
    assert bound is not None and bound.encode()


def test_ordinary_text_and_null_pass_unchanged() -> None:
    text = "multi\nline ✓ 日本 \t"

    assert StoredText().process_bind_param(text, sqlite.dialect()) is text
    assert StoredText().process_bind_param(None, sqlite.dialect()) is None


def test_the_text_that_models_and_tools_produce_is_stored_as_stored_text() -> None:
    columns = [Message.__table__.c.content, Run.__table__.c.answer, Run.__table__.c.error]

    assert all(isinstance(column.type, StoredText) for column in columns)
