"""Structured logging (text or JSON) carrying run_id/conversation_id, and the Prometheus metrics."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote_plus

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

run_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("run_id", default=None)
conversation_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "conversation_id", default=None
)

_STD_ATTRS = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "run_id"):
            record.run_id = run_id_var.get()
        if not hasattr(record, "conversation_id"):
            record.conversation_id = conversation_id_var.get()
        # The span the line was written in (none without tracing): its trace finds the line.
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            record.trace_id = format(span.trace_id, "032x")
            record.span_id = format(span.span_id, "016x")
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STD_ATTRS and v is not None}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).strftime("%H:%M:%S.%f")[:-3]
        pairs = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{ts} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if pairs:
            line = f"{line} {pairs}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def redact_query(path: str) -> str:
    """``path`` with the value of its ``access_token`` parameter (however it is spelled) hidden."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    items = query.split("&")
    for i, item in enumerate(items):
        name, _, _ = item.partition("=")
        if unquote_plus(name) == "access_token":
            items[i] = f"{name}=[redacted]"
    return f"{base}?{'&'.join(items)}"


class _RedactAccessToken(logging.Filter):
    """uvicorn's access log prints the request line, query included; a browser's stream request
    carries its API key there (``?access_token=``), as EventSource cannot send headers."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a for a in record.args)
        return True


def configure_logging(fmt: str = "text", level: str = "INFO") -> None:
    """Install one handler on the ``app`` logger (idempotent, so many apps can be built in one process)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _RedactAccessToken) for f in access.filters):
        access.addFilter(_RedactAccessToken())
    logger = logging.getLogger("app")
    for h in list(logger.handlers):
        if getattr(h, "_agentstream", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._agentstream = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    handler.addFilter(_ContextFilter())
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


class Metrics:
    """The service's Prometheus metrics, on a registry of their own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.runs = Counter("agentstream_runs_total", "Runs finished, by status", ["status"], registry=r)
        self.runs_started = Counter("agentstream_runs_started_total", "Runs started", registry=r)
        self.active_runs = Gauge("agentstream_active_runs", "Runs executing in this process", registry=r)
        self.active_streams = Gauge("agentstream_active_streams", "Open SSE streams", registry=r)
        self.events_published = Counter(
            "agentstream_events_published_total", "Events published to the bus", registry=r
        )
        self.llm_calls = Counter(
            "agentstream_llm_calls_total",
            "LLM calls, by kind, outcome and model (LLM_MODELS' name)",
            ["kind", "outcome", "model"],
            registry=r,
        )
        self.llm_latency = Histogram(
            "agentstream_llm_latency_seconds",
            "LLM call latency (stream: until the last token), by kind and model",
            ["kind", "model"],
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.llm_tokens = Counter(
            "agentstream_llm_tokens_total",
            "Tokens the providers reported, by model and type (prompt, completion)",
            ["model", "type"],
            registry=r,
        )
        self.tool_calls = Counter(
            "agentstream_tool_calls_total", "Tool calls, by tool and outcome", ["tool", "outcome"], registry=r
        )
        # Durable runs (RUNS.md ).
        self.attempts = Counter(
            "agentstream_run_attempts_total",
            "Attempts of runs this process executed (first ones included)",
            registry=r,
        )
        self.runs_resumed = Counter(
            "agentstream_runs_resumed_total",
            "Runs this process carried on from their last checkpoint, by why their last attempt ended",
            ["cause"],
            registry=r,
        )
        self.checkpoints = Counter(
            "agentstream_checkpoints_total", "Run checkpoints written by this process", registry=r
        )
        self.handovers = Counter(
            "agentstream_run_handovers_total",
            "Runs this process released to another worker on shutdown",
            registry=r,
        )
        self.approvals_requested = Counter(
            "agentstream_approvals_requested_total",
            "Tool calls that asked for a person's approval (RUNS.md A-02)",
            registry=r,
        )
        self.approvals_decided = Counter(
            "agentstream_approvals_decided_total",
            "Approvals decided through this process, by outcome",
            ["outcome"],
            registry=r,
        )
        self.approvals_expired = Counter(
            "agentstream_approvals_expired_total",
            "Approvals this process expired because nobody decided in time (A-04)",
            registry=r,
        )
        self.client_calls = Counter(
            "agentstream_client_tool_calls_total",
            "Calls of tools the client runs that a run waited for (FACES.md C-02)",
            registry=r,
        )
        self.runs_queued = Counter(
            "agentstream_runs_queued_total",
            "Runs started through this process that queued for room (RUNS.md Q-01)",
            registry=r,
        )
        self.runs_refused = Counter(
            "agentstream_runs_refused_total",
            "Runs refused through this process because the queue was full (429 queue_full, Q-02)",
            registry=r,
        )
        self.run_room = Gauge(
            "agentstream_run_room",
            "Runs this process may still start or take over now (MAX_ACTIVE_RUNS less what it runs)",
            registry=r,
        )
        self.run_capacity = Gauge("agentstream_run_capacity", "MAX_ACTIVE_RUNS of this process", registry=r)
        self.queued_runs = Gauge(
            "agentstream_queued_runs",
            "Runs waiting in the queue, across the service (read from the database)",
            registry=r,
        )
        self.approvals_pending = Gauge(
            "agentstream_approvals_pending",
            "Approvals waiting for a decision, across the service (read from the database)",
            registry=r,
        )
        # Sign-in (FACES.md J-01..J-03).
        self.auth_failures = Counter(
            "agentstream_auth_failures_total",
            "Requests refused for their credentials (401), or for keys not loaded yet (503), by reason",
            ["reason"],
            registry=r,
        )
        self.auth_key_fetches = Counter(
            "agentstream_auth_key_fetches_total",
            "Fetches of the identity provider's signing keys (JWKS), by outcome (ok, failed)",
            ["outcome"],
            registry=r,
        )
        # Run webhooks and A2A push notifications (FACES.md N-06, N-07).
        self.webhook_deliveries = Counter(
            "agentstream_webhook_deliveries_total",
            "Delivery attempts this process made, by kind (run, a2a_push) and outcome (delivered; "
            "failed: retried later; given_up: failed past WEBHOOK_MAX_AGE_S; refused: its URL is "
            "not one the service posts to)",
            ["kind", "outcome"],
            registry=r,
        )
        self.webhook_queue = Gauge(
            "agentstream_webhook_queue_depth",
            "Deliveries neither made nor given up, across the service (read from the database)",
            registry=r,
        )
