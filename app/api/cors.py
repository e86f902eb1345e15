"""CORS (FACES.md J-04): a web app on another origin may call every route and face, streams included.

Starlette's ``CORSMiddleware``, outermost: preflights are answered before any route (a browser
sends no credentials with them, so they must not meet authentication), and refusals (401, 413,
404...) and unexpected 500s carry its headers too, which lets the app read why. With listed
origins credentials are allowed (the origin is echoed, never ``*``); with ``*`` any origin may
call, without credentials (and only a service that authenticates: app.settings refuses ``*`` in
single-user mode). Any request header is allowed: the requested ones are echoed (``Authorization``,
``Content-Type``, ``Last-Event-ID``, and what clients add, such as the OpenAI SDK's
``x-stainless-*`` or a tracer's ``traceparent``).
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from app.api.errors import InternalErrors
from app.settings import Settings

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
EXPOSED_HEADERS = (
    "WWW-Authenticate",  # why a token was refused (J-03)
    "Retry-After",
    "x-should-retry",  # the OpenAI SDK reads it on /v1
    "x-vercel-ai-ui-message-stream",  # the AI SDK face's stream marker
)
MAX_AGE_S = 600


def add_cors(app: FastAPI, settings: Settings) -> None:
    """Adds the middleware if ``CORS_ALLOW_ORIGINS`` names any origin (unset: no cross-origin access)."""
    origins = settings.cors_origins()
    if not origins:
        return
    # Just inside CORS: an unexpected 500 is answered here, with its headers (Starlette's own
    # answer to it comes from outside every middleware).
    app.add_middleware(InternalErrors)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_credentials=origins != ["*"],
        allow_methods=METHODS,
        allow_headers=["*"],
        expose_headers=EXPOSED_HEADERS,
        max_age=MAX_AGE_S,
    )
