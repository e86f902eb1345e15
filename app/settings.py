"""Every setting of the service, read from the environment or a ``.env`` file (API.md).

Nothing else in the package reads ``os.environ``. ``Settings()`` is built by ``create_app`` / the
CLI, never at import time.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.llm.models import ABILITY_NAMES
from app.llm.providers import PROFILES

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./data/agentstream.db"


def webhook_key(secret: str) -> bytes:
    """The HMAC key a ``WEBHOOK_SECRET`` names: Standard Webhooks' ``whsec_<base64>`` is the
    decoded bytes; any other text, its UTF-8 bytes."""
    if not secret.startswith("whsec_"):
        return secret.encode()
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except binascii.Error:
        raise ValueError("WEBHOOK_SECRET: after whsec_ comes the key in base64") from None
    if not key:
        raise ValueError("WEBHOOK_SECRET: the key after whsec_ is empty")
    return key


def fetchable_url(url: str) -> bool:
    """Whether the identity provider's keys may be fetched from ``url`` (FACES.md J-02): https, or
    plain http to a loopback host (``localhost``, 127.0.0.0/8, ``::1``), which nobody else can
    see or answer for."""
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname
    except ValueError:
        return False
    scheme = parts.scheme.lower()
    if scheme == "https":
        return True
    if scheme != "http" or not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+", re.IGNORECASE)
"""What a browser sends as ``Origin``: a scheme and a host (and port), no path."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore")

    # LLM
    llm_base_url: str | None = None
    llm_api_key: SecretStr | None = None
    llm_model: str = "gpt-4o-mini"
    llm_abilities: str = "tool_call,json_mode,streaming"
    llm_timeout_s: float = Field(default=60.0, gt=0)
    llm_max_retries: int = Field(default=3, ge=0, le=20)
    llm_provider: str | None = None
    """The provider profile (app.llm.providers); unset: found from LLM_BASE_URL and LLM_MODEL."""
    llm_models: SecretStr | None = None
    """JSON list of models (app.llm.models); a secret, as it holds their keys."""

    # storage and transport
    database_url: str = DEFAULT_DATABASE_URL
    redis_url: str | None = None
    redis_key_prefix: str = "agentstream"
    redis_cluster: bool = False
    """``REDIS_URL`` names a node of a Redis Cluster (RUNS.md S-01)."""

    # auth
    api_keys: SecretStr | None = None
    auth_jwt_jwks_url: str | None = None
    """The identity provider's JWK set; or ``AUTH_OIDC_ISSUER``, whose discovery document names it
    (FACES.md J-01). Either turns on JWT access tokens beside ``API_KEYS``."""
    auth_oidc_issuer: str | None = None
    auth_jwt_issuer: str | None = None
    """The tokens' ``iss``; unset: ``AUTH_OIDC_ISSUER``."""
    auth_jwt_audience: str | None = None
    """The tokens' ``aud`` must hold this (comma-separated: one of these)."""
    auth_jwt_owner_claim: str = "sub"
    auth_jwt_refetch_s: float = Field(default=30.0, ge=1, le=86400)
    """The shortest time between two fetches of the keys that tokens with an unknown ``kid`` cause
    (J-02: 30 s; not in API.md)."""
    cors_allow_origins: str | None = None
    """Origins whose pages may call the service (J-04): comma-separated, or ``*`` (then without
    credentials)."""

    # the A2A agent card (FACES.md N-01)
    a2a_agent_name: str = Field(default="AgentStream", min_length=1, max_length=200)
    a2a_agent_description: str = Field(
        default=(
            "Runs tool-using LLM agents durably: a task is a run that outlives workers, waits for a "
            "person's approval (input-required) and takes follow-ups while it works."
        ),
        min_length=1,
        max_length=2000,
    )
    public_base_url: str | None = None
    """Where clients reach the service (``https://agents.example.com``), for the URLs the agent
    card names; unset: from each request (its scheme, host and port)."""

    # engine
    react_max_iterations: int = Field(default=50, ge=1, le=1000)
    react_cycle_detection_threshold: int = Field(default=3, ge=1)
    react_completion_check_min_tools: int = Field(default=3, ge=1)
    react_self_reflection_interval: int = Field(default=6, ge=1)
    tool_selection_threshold: int = Field(default=12, ge=1)
    context_token_budget: int = Field(default=32000, ge=1000)

    # streaming and runs
    sse_ping_seconds: float = Field(default=15.0, gt=0)
    stream_retention_s: int = Field(default=600, ge=1)
    stream_linger_ms: float = Field(default=0.0, ge=0, le=1000)
    """How long an answer token waits for the next to go out with it, as one event (not in
    API.md; README "Capacity"): fewer events per token let one worker stream more runs at once,
    at up to this much more latency per token. 0: each token goes out as it comes."""
    run_lease_s: float = Field(default=30.0, gt=0)
    shutdown_grace_s: float = Field(default=20.0, ge=0)
    run_max_attempts: int = Field(default=3, ge=1, le=100)
    """Attempts of a run that may die (its worker lost) before the run fails (RUNS.md R-07)."""
    require_approval: str = ""
    """Tools whose calls wait for a person (RUNS.md A-01): comma-separated names, or ``*``."""
    approval_timeout_s: float = Field(default=86400.0, gt=0, le=366 * 86400)
    """A pending approval expires after this long (A-04)."""
    checkpoint_retention_s: float | None = Field(default=None, gt=0)
    """How long a finished run's checkpoints are kept (unset: as long as its conversation; a run
    is replayed from them, FACES.md B-06)."""
    client_tool_timeout_s: float = Field(default=3600.0, gt=0, le=366 * 86400)
    """How long a run waits for the result of a tool the client runs (FACES.md C-03)."""
    max_active_runs: int = Field(default=200, ge=1)
    """Runs one worker executes at once; beyond that they queue (RUNS.md Q-01)."""
    max_active_runs_per_owner: int | None = Field(default=None, ge=1)
    """Running runs one owner may hold across all workers (unset: unlimited; Q-01)."""
    max_queued_runs: int = Field(default=10000, ge=0)
    """Runs that may wait in the queue across the service; beyond that a start is 429 (Q-02)."""

    # run webhooks and A2A push notifications (FACES.md N-06, N-07)
    webhook_secret: SecretStr | None = None
    """Signs run webhooks as Standard Webhooks says: ``whsec_<base64 key>``, or any text (its UTF-8
    bytes are the key). Unset: deliveries go unsigned."""
    webhook_max_age_s: float = Field(default=86400.0, gt=0, le=366 * 86400)
    """A delivery is retried with backoff for this long after it was queued, then given up."""
    webhook_allow_private: bool = False
    """Take webhook URLs whose host is loopback, private, link-local, multicast or unspecified."""
    webhook_allowed_hosts: str | None = None
    """Comma-separated host names or addresses: when set, webhook URLs on other hosts are refused."""
    webhook_claim_s: float = Field(default=30.0, ge=1, le=3600)
    """A worker's claim on a delivery lasts this long, renewed while it delivers: a dead worker's
    deliveries are taken by another after it (not in API.md)."""
    webhook_retry_s: float = Field(default=1.0, gt=0, le=3600)
    """The wait before a delivery's first retry, doubled at each retry up to an hour, with jitter
    (not in API.md)."""

    # tracing (OpenTelemetry over OTLP/HTTP; off without an endpoint). The SDK reads the other
    # standard OTEL_* variables (sampler, resource attributes, batch, timeout, certificates) itself.
    otel_exporter_otlp_endpoint: str | None = None
    otel_exporter_otlp_traces_endpoint: str | None = None
    otel_exporter_otlp_protocol: str = "http/protobuf"
    otel_exporter_otlp_traces_protocol: str | None = None
    otel_exporter_otlp_headers: SecretStr | None = None
    otel_exporter_otlp_traces_headers: SecretStr | None = None
    """``key=value,...`` headers of the export requests; secrets (a backend's API key)."""
    otel_traces_exporter: str = "otlp"
    otel_sdk_disabled: bool = False
    otel_service_name: str | None = None
    """The traces' ``service.name``; unset: ``service.name`` of OTEL_RESOURCE_ATTRIBUTES, else agentstream."""
    otel_instrumentation_genai_capture_message_content: bool = False
    """Record prompts, answers, tool arguments and results on the spans (off: sizes and names only)."""

    # service
    log_format: Literal["text", "json"] = "text"
    log_level: str = "INFO"
    mcp_servers: str | None = None
    """JSON list of MCP server configs (see README)."""
    tool_rate_limit_per_minute: int = Field(default=120, ge=1)
    """Tool calls allowed per conversation per minute (a PreToolUse hook enforces it)."""
    demo_delay_s: float = Field(default=0.03, ge=0, le=5)
    """Pause between the words the demo model streams, so that a person can watch it type."""

    @field_validator(
        "llm_base_url",
        "redis_url",
        "mcp_servers",
        "llm_provider",
        "llm_models",
        "otel_exporter_otlp_endpoint",
        "otel_exporter_otlp_traces_endpoint",
        "otel_exporter_otlp_traces_protocol",
        "otel_exporter_otlp_headers",
        "otel_exporter_otlp_traces_headers",
        "otel_service_name",
        "checkpoint_retention_s",
        "auth_jwt_jwks_url",
        "auth_oidc_issuer",
        "auth_jwt_issuer",
        "public_base_url",
        "auth_jwt_audience",
        "cors_allow_origins",
        "webhook_secret",
        "webhook_allowed_hosts",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("max_active_runs_per_owner", mode="before")
    @classmethod
    def _unlimited(cls, v: object) -> object:
        """Unset, empty or ``unlimited``: no cap."""
        if isinstance(v, str) and v.strip().lower() in ("", "unlimited", "none"):
            return None
        return v

    @field_validator("llm_provider")
    @classmethod
    def _known_provider(cls, v: str | None) -> str | None:
        if v is not None and v.strip().lower() not in PROFILES:
            raise ValueError(f"unknown provider {v!r}; one of: {', '.join(sorted(PROFILES))}")
        return v

    @field_validator("a2a_agent_name", "a2a_agent_description", mode="before")
    @classmethod
    def _card_default(cls, v: object, info: ValidationInfo) -> object:
        """Empty (as in .env.example): the default."""
        if isinstance(v, str) and not v.strip() and info.field_name is not None:
            return cls.model_fields[info.field_name].default
        return v

    @field_validator("public_base_url")
    @classmethod
    def _base_url(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = v.strip().rstrip("/")
        if not re.fullmatch(r"https?://[^/?#\s]+(/[^?#\s]*)?", v, re.IGNORECASE):
            raise ValueError("PUBLIC_BASE_URL must be an http(s) URL such as https://agents.example.com")
        return v

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, v: str | None) -> str | None:
        for origin in (v or "").split(","):
            origin = origin.strip().rstrip("/")
            if origin and origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"CORS_ALLOW_ORIGINS: {origin!r} is not an origin (scheme://host[:port], no path)"
                )
        return v

    @field_validator("webhook_secret")
    @classmethod
    def _webhook_secret(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            webhook_key(v.get_secret_value())  # a whsec_ secret must hold base64
        return v

    @model_validator(mode="after")
    def _sign_in_complete(self) -> Settings:
        """Access tokens are checked for issuer and audience (FACES.md J-02): a start without
        them would take tokens the provider issued for any other API."""
        provider = self.auth_jwt_jwks_url or self.auth_oidc_issuer
        if not provider:
            if self.auth_jwt_issuer or self.auth_jwt_audience:
                raise ValueError(
                    "AUTH_JWT_ISSUER and AUTH_JWT_AUDIENCE need AUTH_JWT_JWKS_URL or AUTH_OIDC_ISSUER"
                )
            return self
        for name, url in (
            ("AUTH_JWT_JWKS_URL", self.auth_jwt_jwks_url),
            ("AUTH_OIDC_ISSUER", self.auth_oidc_issuer),
        ):
            if url is not None and not re.match(r"https?://[^/?#\s]+", url):
                raise ValueError(f"{name} must be an http(s) URL")
            if url is not None and not fetchable_url(url):
                # Whoever is on the path of plain http could hand out keys of their own.
                raise ValueError(
                    f"{name} must be an https URL: the signing keys must not come over plain http "
                    "(http is taken for loopback hosts only: localhost, 127.0.0.0/8, ::1)"
                )
        if not self.jwt_issuer:
            raise ValueError("access tokens need their issuer: set AUTH_JWT_ISSUER (or AUTH_OIDC_ISSUER)")
        if not self.jwt_audiences():
            raise ValueError(
                "access tokens need their audience: set AUTH_JWT_AUDIENCE to this API's identifier "
                "as the identity provider puts it in the tokens' aud"
            )
        if not self.auth_jwt_owner_claim.strip():
            raise ValueError("AUTH_JWT_OWNER_CLAIM must name a claim")
        return self

    @model_validator(mode="after")
    def _no_open_single_user(self) -> Settings:
        """``CORS_ALLOW_ORIGINS=*`` on a service that authenticates nobody would let any web page
        a user opens drive it, with its tools, in their name (FACES.md J-04)."""
        if "*" in self.cors_origins() and not self.sign_in and not self.owner_keys():
            raise ValueError(
                "CORS_ALLOW_ORIGINS=* needs API_KEYS or sign-in (AUTH_JWT_JWKS_URL / AUTH_OIDC_ISSUER): "
                "without them the service is single-user and any website could call it; "
                "name the origins of your web app instead"
            )
        return self

    @property
    def sign_in(self) -> bool:
        """JWT access tokens from an identity provider are accepted (FACES.md J-01)."""
        return bool(self.auth_jwt_jwks_url or self.auth_oidc_issuer)

    @property
    def jwt_issuer(self) -> str | None:
        return self.auth_jwt_issuer or self.auth_oidc_issuer

    def jwt_audiences(self) -> list[str]:
        return [a.strip() for a in (self.auth_jwt_audience or "").split(",") if a.strip()]

    def cors_origins(self) -> list[str]:
        """``CORS_ALLOW_ORIGINS`` as origins a browser sends (no trailing ``/``); ``["*"]``: any."""
        origins = [o.strip().rstrip("/") for o in (self.cors_allow_origins or "").split(",")]
        return ["*"] if "*" in origins else [o for o in origins if o]

    @property
    def abilities(self) -> dict[str, bool]:
        names = {a.strip() for a in self.llm_abilities.split(",") if a.strip()}
        return {a: a in names for a in ABILITY_NAMES}

    def owner_keys(self) -> dict[str, str]:
        """``{key: owner}`` from ``API_KEYS`` (``owner:key,...``); empty means single-user mode."""
        if self.api_keys is None:
            return {}
        out: dict[str, str] = {}
        for item in self.api_keys.get_secret_value().split(","):
            item = item.strip()
            if not item:
                continue
            owner, sep, key = item.partition(":")
            if not sep or not owner.strip() or not key.strip():
                raise ValueError("API_KEYS entries must look like owner:key")
            out[key.strip()] = owner.strip()
        return out

    def webhook_hosts(self) -> list[str]:
        """``WEBHOOK_ALLOWED_HOSTS`` as lower-case names and addresses; empty: any public host."""
        hosts = (h.strip().lower().rstrip(".") for h in (self.webhook_allowed_hosts or "").split(","))
        return [h for h in hosts if h]

    def webhook_signing_key(self) -> bytes | None:
        """The HMAC key of ``WEBHOOK_SECRET`` (None: deliveries are not signed)."""
        return webhook_key(self.webhook_secret.get_secret_value()) if self.webhook_secret else None

    def approval_tools(self) -> list[str]:
        """``REQUIRE_APPROVAL`` as a list of tool names (``["*"]`` for every tool)."""
        return [name.strip() for name in self.require_approval.split(",") if name.strip()]
