"""Push notification configs as A2A gives them (FACES.md N-06), checked before they are stored.

The deliveries themselves are the webhooks' outbox's (``app.webhooks``): a config is stored with
its task (``PushConfigRepo``), and each status change of the run owes it one ``StreamResponse``.
Its URL is checked as every webhook URL is (http or https, no credentials, ``WEBHOOK_ALLOWED_HOSTS``,
no loopback, private or link-local address unless ``WEBHOOK_ALLOW_PRIVATE``): a refused one is
``InvalidParamsError`` and nothing is stored, as are a token or credentials that could not be
sent in a header (anything but printable ASCII, or spaces around it): every attempt to deliver
would fail.
"""

from __future__ import annotations

import uuid

from a2a.types.a2a_pb2 import AuthenticationInfo, TaskPushNotificationConfig
from a2a.utils.errors import InvalidParamsError

from app.container import Services
from app.db.repositories.push_configs import NewPushConfig, PushConfigRecord
from app.webhooks import WebhookRefusedError

MAX_CONFIG_ID = 200
MAX_SECRET_CHARS = 4096


def _has_controls(text: str) -> bool:
    return any(ord(c) < 32 or c == "\x7f" for c in text)


def _checked(text: str, what: str, limit: int) -> str:
    if len(text) > limit:
        raise InvalidParamsError(f"{what} may have at most {limit} characters")
    if _has_controls(text):
        raise InvalidParamsError(f"{what} must not contain control characters")
    return text


def _header_value(text: str, what: str, limit: int) -> str:
    """What goes into a delivery's header as it is: printable ASCII, no space at either end."""
    _checked(text, what, limit)
    if not text.isascii() or text != text.strip(" "):
        raise InvalidParamsError(f"{what} is sent in a header: printable ASCII only, no space at either end")
    return text


def is_config_id(value: str) -> bool:
    """Whether ``value`` could name a stored config (anything else names none)."""
    return 0 < len(value) <= MAX_CONFIG_ID and not _has_controls(value)


async def checked_push_config(services: Services, config: TaskPushNotificationConfig) -> NewPushConfig:
    if not config.url:
        raise InvalidParamsError("a push notification config needs a url")
    config_id = _checked(config.id, "the config's id", MAX_CONFIG_ID) or uuid.uuid4().hex
    token = _header_value(config.token, "token", MAX_SECRET_CHARS) or None
    authentication = None
    if config.HasField("authentication") and config.authentication.scheme:
        authentication = {
            "scheme": _header_value(config.authentication.scheme, "authentication.scheme", 100),
            "credentials": _header_value(
                config.authentication.credentials, "authentication.credentials", MAX_SECRET_CHARS
            ),
        }
    try:  # last: it may look the host up
        await services.webhooks.policy.check(config.url)
    except WebhookRefusedError as exc:
        raise InvalidParamsError(f"push notification url refused: {exc}") from None
    return NewPushConfig(config_id=config_id, url=config.url, token=token, authentication=authentication)


def push_config_of(record: PushConfigRecord) -> TaskPushNotificationConfig:
    config = TaskPushNotificationConfig(
        id=record.config_id, task_id=record.run_id, url=record.url, token=record.token or ""
    )
    if record.authentication:
        config.authentication.CopyFrom(
            AuthenticationInfo(
                scheme=str(record.authentication.get("scheme") or ""),
                credentials=str(record.authentication.get("credentials") or ""),
            )
        )
    return config
