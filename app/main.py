"""``create_app(settings)``: builds the FastAPI app; its lifespan wires database, bus, LLM and run manager.

Nothing is created at import time, so tests can build as many apps as they like.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from app import __version__
from app.api.cors import add_cors
from app.api.errors import install_error_handlers
from app.api.faces.a2a import routes as a2a_face
from app.api.faces.agui import routes as ag_ui_face
from app.api.faces.aisdk import routes as ai_sdk_face
from app.api.limits import BodySizeLimit
from app.api.routes import (
    approvals,
    branches,
    conversations,
    health,
    openai_compat,
    runs,
    stream,
    tool_results,
    tools,
)
from app.api.routes import models as model_routes
from app.auth import build_authenticator
from app.container import Services
from app.db.migrate import upgrade_database
from app.db.repositories import ConversationRepo, EventRepo, RunRepo
from app.db.repositories.approvals import ApprovalRepo
from app.db.repositories.follow_ups import FollowUpRepo
from app.db.repositories.notes import NoteRepo
from app.db.repositories.queue import RunQueue
from app.db.session import Database
from app.engine.hooks import AuditHook, AuditRecord, HookRegistry, ToolRateLimit
from app.llm.factory import build_models
from app.observability import Metrics, configure_logging
from app.runs.follow_ups import DurableInterruptQueue, FollowUpHints, MemoryFollowUpHints
from app.runs.instrumented import InstrumentedLLM
from app.runs.manager import RunManager
from app.runs.workers import new_worker_id
from app.settings import Settings
from app.streaming.bus import EventBus
from app.streaming.memory import MemoryEventBus
from app.tools.builtins import default_registry
from app.tools.mcp import connect_mcp_tools
from app.tracing import build_tracing, tracing_on
from app.tracing.http import ServerSpans
from app.webhooks import build_webhooks

log = logging.getLogger("app.main")

WEB_DIR = Path(str(resources.files("app") / "web"))


def _audit_logger() -> Any:
    audit_log = logging.getLogger("app.audit")

    async def record(entry: AuditRecord) -> None:
        audit_log.info(
            "tool call",
            extra={
                "run_id": entry.run_id,
                "conversation_id": entry.conversation_id,
                "tool": entry.tool_name,
                "outcome": entry.outcome,
                "elapsed": round(entry.elapsed, 4),
            },
        )

    return record


async def build_services(settings: Settings) -> Services:
    metrics = Metrics()
    auth = build_authenticator(settings, metrics)
    # First: bad LLM_MODELS or OTEL_* settings stop the start before anything is opened.
    tracing = build_tracing(settings)
    models = build_models(
        settings, wrap=lambda spec, llm: InstrumentedLLM(llm, metrics, spec.name, tracing.chat_spans(spec))
    )
    await asyncio.to_thread(upgrade_database, settings.database_url)
    # A transaction idle past the run lease is a stalled worker's: the server ends it.
    db = Database(settings.database_url, stalled_transaction_s=settings.run_lease_s)
    conversations_repo = ConversationRepo(db.sessionmaker)
    worker_id = new_worker_id()
    # Runs that wait or end store what their webhooks and push configs are owed in the same
    # transaction (FACES.md N-06, N-07): the repositories are given the outbox's notices.
    webhooks = build_webhooks(
        settings, db.sessionmaker, metrics=metrics, worker_id=worker_id, default_model=models.default
    )
    runs_repo = RunRepo(db.sessionmaker, webhooks.notices)
    events_repo = EventRepo(db.sessionmaker)

    redis_client: Any = None
    bus: EventBus
    if settings.redis_url:
        from app.streaming.redis_signals import RedisCancelSignal, RedisFollowUpHints

        prefix = settings.redis_key_prefix
        cluster = settings.redis_cluster
        if cluster:
            from redis.asyncio.cluster import RedisCluster

            from app.streaming.redis_cluster_bus import RedisClusterEventBus

            redis_client = RedisCluster.from_url(settings.redis_url)
            bus = RedisClusterEventBus(settings.redis_url, prefix)
        else:
            from redis.asyncio import Redis

            from app.streaming.redis_bus import RedisEventBus

            redis_client = Redis.from_url(settings.redis_url)
            bus = RedisEventBus(settings.redis_url, prefix)
        hints: FollowUpHints = RedisFollowUpHints(redis_client, prefix, cluster=cluster)
        cancel_signal: Any = RedisCancelSignal(redis_client, prefix, cluster=cluster)
        released_signal: Any = RedisCancelSignal(redis_client, prefix, name="released", cluster=cluster)
        log.info("event bus: Redis Streams" + (" on a Redis Cluster" if cluster else ""))
    else:
        from app.streaming.redis_signals import MemoryCancelSignal

        bus = MemoryEventBus(retention_s=settings.stream_retention_s)
        hints = MemoryFollowUpHints()
        cancel_signal = MemoryCancelSignal()
        released_signal = MemoryCancelSignal()
        log.info("event bus: in-process (set REDIS_URL to share runs between workers)")

    follow_ups = FollowUpRepo(db.sessionmaker)

    def interrupts(
        conversation_id: str, position: int | None = None, *, seen: object | None = None
    ) -> DurableInterruptQueue:
        return DurableInterruptQueue(follow_ups, hints, conversation_id, position=position, seen=seen)

    registry = default_registry(notes=NoteRepo(db.sessionmaker))
    mcp_tools = await connect_mcp_tools(settings.mcp_servers, registry)
    audit = _audit_logger()

    def hooks() -> HookRegistry:
        registry_ = HookRegistry()
        audit_hook = AuditHook(audit)
        registry_.add_pre(ToolRateLimit(max_calls=settings.tool_rate_limit_per_minute, per_seconds=60.0))
        registry_.add_pre(audit_hook)
        registry_.add_post(audit_hook)
        return registry_

    approvals_repo = ApprovalRepo(db.sessionmaker, webhooks.notices)
    manager = RunManager(
        approvals=approvals_repo,
        settings=settings,
        conversations=conversations_repo,
        runs=runs_repo,
        events=events_repo,
        bus=bus,
        models=models,
        tools=registry,
        interrupts=interrupts,
        follow_ups=follow_ups,
        cancel_signal=cancel_signal,
        metrics=metrics,
        worker_id=worker_id,
        hooks=hooks,
        leases=RunRepo(db.lease_sessionmaker, webhooks.notices),
        queue=RunQueue(db.sessionmaker),
        released_signal=released_signal,
        tracing=tracing,
    )
    return Services(
        settings=settings,
        db=db,
        conversations=conversations_repo,
        runs=runs_repo,
        events=events_repo,
        bus=bus,
        tools=registry,
        manager=manager,
        metrics=metrics,
        auth=auth,
        redis=redis_client,
        extras={"mcp": mcp_tools},
        models=models,
        webhooks=webhooks,
        approvals=approvals_repo,
        tracing=tracing,
    )


async def close_services(services: Services) -> None:
    try:
        await services.manager.shutdown()
    except Exception:
        log.warning("error while stopping the runs", exc_info=True)
    try:
        # After the runs: what those that ended meanwhile owe is stored; claims under way are
        # released for another worker.
        await services.webhooks.deliverer.stop()
    except Exception:
        log.warning("error while stopping the webhook deliveries", exc_info=True)
    for closer in (
        services.extras["mcp"].aclose,
        services.auth.aclose,
        services.bus.close,
        services.models.aclose,
        services.db.dispose,
        services.tracing.shutdown,  # last: the spans of runs that just stopped are sent
    ):
        try:
            await closer()
        except Exception:
            log.warning("error while closing", exc_info=True)
    if services.redis is not None:
        await services.redis.aclose()


GC_THRESHOLDS = (700, 10, 100)
"""Python's defaults but the last: a full collection after 100 middle ones instead of 10."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    configure_logging(settings.log_format, settings.log_level)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = await build_services(settings)
        app.state.services = services
        await services.manager.start()
        services.webhooks.deliverer.start()
        services.auth.start()  # the provider's keys load in the background: it may be down
        # The cycle collector's full passes stop the event loop, every stream with it: under load
        # (200 streaming runs) they came every few seconds and took 150-250 ms, most of the
        # delivery p99. What start-up made (modules, routes, schemas, pools: most of the heap)
        # lives as long as the process: frozen, full passes skip it; and they come a tenth as
        # often (reference counting frees all but cyclic garbage at once). bench/RESULTS.md.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        log.info(
            "ready", extra={"worker": services.manager.worker_id, "models": ",".join(services.models.names)}
        )
        try:
            yield
        finally:
            await close_services(services)
            gc.unfreeze()

    app = FastAPI(
        title="AgentStream",
        version=__version__,
        description="Run tool-using LLM agents and stream their work as resumable Server-Sent Events.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit)
    if tracing_on(settings):
        app.add_middleware(ServerSpans)
    add_cors(app, settings)  # last, so outermost: refusals and 413s carry its headers too
    for module in (
        health,
        tools,
        model_routes,
        conversations,
        branches,
        approvals,
        tool_results,
        runs,
        stream,
        openai_compat,
        ai_sdk_face,
        ag_ui_face,
        a2a_face,
    ):
        app.include_router(module.router)

    index = WEB_DIR / "index.html"

    @app.get("/", include_in_schema=False, response_model=None)
    async def home() -> FileResponse:
        return FileResponse(index, headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=WEB_DIR, check_dir=False), name="static")
    return app
