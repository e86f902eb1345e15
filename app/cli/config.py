"""Where the CLI finds its server: ``AGENTSTREAM_URL`` / ``AGENTSTREAM_KEY`` (environment or ``.env``).

Kept apart from ``app.settings.Settings``, which configures the server, not its clients.
"""

from __future__ import annotations

from pydantic import SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_URL = "http://127.0.0.1:8000"


class CliSettings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore")

    agentstream_url: str = DEFAULT_URL
    agentstream_key: SecretStr | None = None

    @field_validator("agentstream_url", mode="before")
    @classmethod
    def _empty_is_default(cls, v: object) -> object:
        return DEFAULT_URL if isinstance(v, str) and not v.strip() else v

    @field_validator("agentstream_key", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v
