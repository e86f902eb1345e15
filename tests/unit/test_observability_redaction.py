"""The access log never shows an API key passed as ``?access_token=`` (how browsers stream)."""

from __future__ import annotations

import logging

import pytest

from app.observability import configure_logging, redact_query


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("/s?access_token=k1&after=1-0", "/s?access_token=[redacted]&after=1-0"),
        ("/s?after=1-0&access%5Ftoken=k1", "/s?after=1-0&access%5Ftoken=[redacted]"),
        ("/s?%61ccess_token=k1", "/s?%61ccess_token=[redacted]"),
        ("/s?access_token=a&access_token=b", "/s?access_token=[redacted]&access_token=[redacted]"),
        ("/s?access_token", "/s?access_token=[redacted]"),
        ("/s?after=access_token", "/s?after=access_token"),
        ("/s", "/s"),
    ],
)
def test_the_access_token_parameter_is_hidden_however_it_is_spelled(path: str, shown: str) -> None:
    assert redact_query(path) == shown


def test_uvicorns_access_log_records_lose_the_token_once_logging_is_configured() -> None:
    configure_logging("text", "INFO")
    configure_logging("json", "INFO")  # idempotent: one filter, not two
    access = logging.getLogger("uvicorn.access")
    record = access.makeRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:1", "GET", "/api/conversations/c/stream?access_token=secret-k", "1.1", 200),
        None,
    )

    for log_filter in access.filters:
        assert log_filter.filter(record)  # type: ignore[union-attr]

    assert "secret-k" not in record.getMessage()
    assert "access_token=[redacted]" in record.getMessage()
    assert len(access.filters) == len({type(f) for f in access.filters})
