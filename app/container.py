"""``Services``: everything a request needs, built once per app by the lifespan in ``app.main``."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from app.auth import Authenticator
from app.db.repositories import ConversationRepo, EventRepo, RunRepo
from app.db.repositories.approvals import ApprovalRepo
from app.db.repositories.face_threads import FaceThreadRepo
from app.db.session import Database
from app.llm.models import ModelRegistry
from app.observability import Metrics
from app.runs.manager import RunManager
from app.settings import Settings
from app.streaming.bus import EventBus
from app.tools.registry import ToolRegistry
from app.tracing import NO_TRACING, Tracing
from app.webhooks import Webhooks


@dataclass
class Services:
    settings: Settings
    db: Database
    conversations: ConversationRepo
    runs: RunRepo
    events: EventRepo
    bus: EventBus
    tools: ToolRegistry
    manager: RunManager
    metrics: Metrics
    auth: Authenticator
    """Who calls: API keys and access tokens (app.auth)."""
    approvals: ApprovalRepo
    models: ModelRegistry
    webhooks: Webhooks
    """The outbox of run webhooks and A2A push notifications, its URL checks, the push configs and
    this worker's deliverer (app.webhooks; FACES.md N-06, N-07)."""
    redis: Any = None
    tracing: Tracing = NO_TRACING
    extras: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def threads(self) -> FaceThreadRepo:
        """The protocol faces' chats and threads (FACES.md V-02, G-02)."""
        return FaceThreadRepo(self.db.sessionmaker)
