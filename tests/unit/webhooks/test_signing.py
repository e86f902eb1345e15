"""Standard Webhooks signatures (FACES.md N-07), checked with the ``standardwebhooks`` package."""

from __future__ import annotations

import base64
import time

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from app.settings import Settings, webhook_key
from app.webhooks.signing import signature, webhook_headers

BODY = b'{"run_id":"run_1","status":"completed","answer":"caf\xc3\xa9"}'


def test_a_whsec_secret_signs_what_the_standard_webhooks_library_verifies() -> None:
    secret = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    now = int(time.time())

    headers = webhook_headers(webhook_key(secret), "wh_abc", now, BODY)

    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
    assert headers["webhook-id"] == "wh_abc" and headers["webhook-timestamp"] == str(now)
    assert headers["webhook-signature"].startswith("v1,")
    assert Webhook(secret).verify(BODY, headers) == {
        "run_id": "run_1",
        "status": "completed",
        "answer": "café",
    }


def test_a_plain_secret_is_the_key_as_utf8_bytes() -> None:
    now = int(time.time())
    headers = webhook_headers(webhook_key("plain secret"), "wh_1", now, BODY)

    Webhook(b"plain secret").verify(BODY, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(b"another secret").verify(BODY, headers)


def test_a_changed_body_id_or_timestamp_does_not_verify() -> None:
    key = b"k" * 32
    now = int(time.time())
    headers = webhook_headers(key, "wh_1", now, BODY)
    for changed in (
        {**headers, "webhook-id": "wh_2"},
        {**headers, "webhook-timestamp": str(now - 1)},
    ):
        with pytest.raises(WebhookVerificationError):
            Webhook(key).verify(BODY, changed)
    with pytest.raises(WebhookVerificationError):
        Webhook(key).verify(BODY + b" ", headers)
    # The signed content is exactly "{id}.{timestamp}.{body}".
    assert signature(key, "wh_1", now, BODY) == Webhook(key).sign("wh_1", _at(now), BODY)


def test_without_a_secret_deliveries_carry_their_id_and_time_unsigned() -> None:
    assert webhook_headers(None, "wh_1", 1700000000, BODY) == {
        "webhook-id": "wh_1",
        "webhook-timestamp": "1700000000",
    }


def test_webhook_secret_settings() -> None:
    raw = b"\x00\x01binary key\xff"
    assert Settings(_env_file=None).webhook_signing_key() is None  # type: ignore[call-arg]
    assert Settings(_env_file=None, webhook_secret="").webhook_signing_key() is None  # type: ignore[call-arg]
    whsec = "whsec_" + base64.b64encode(raw).decode()
    assert Settings(_env_file=None, webhook_secret=whsec).webhook_signing_key() == raw  # type: ignore[call-arg]
    assert Settings(_env_file=None, webhook_secret="text").webhook_signing_key() == b"text"  # type: ignore[call-arg]
    for bad in ("whsec_not*base64", "whsec_"):
        with pytest.raises(ValueError, match="WEBHOOK_SECRET"):
            Settings(_env_file=None, webhook_secret=bad)  # type: ignore[call-arg]
    # A secret is never shown.
    assert "s3cr3t" not in repr(Settings(_env_file=None, webhook_secret="s3cr3t"))  # type: ignore[call-arg]


def _at(timestamp: int):  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    return datetime.fromtimestamp(timestamp, UTC)
