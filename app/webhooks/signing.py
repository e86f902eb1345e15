"""Standard Webhooks signatures (https://www.standardwebhooks.com, FACES.md N-07).

Every delivery carries ``webhook-id`` (the delivery's id, the same on every attempt: a receiver
drops what it has seen) and ``webhook-timestamp`` (the attempt's time, in seconds). With
``WEBHOOK_SECRET`` it carries ``webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``
too, the key being the secret's (``Settings.webhook_signing_key``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac


def signature(key: bytes, delivery_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value of ``body`` sent as ``delivery_id`` at ``timestamp``."""
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")


def webhook_headers(key: bytes | None, delivery_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt (unsigned without a key)."""
    headers = {"webhook-id": delivery_id, "webhook-timestamp": str(timestamp)}
    if key is not None:
        headers["webhook-signature"] = signature(key, delivery_id, timestamp, body)
    return headers
