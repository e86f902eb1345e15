"""The ``agentstream`` command-line tool: run the server, or chat with it and follow runs live.

``main`` is the console-script entry point (``app.cli:main``); ``python -m app.cli`` runs it too.
"""

from __future__ import annotations

from app.cli.commands import main

__all__ = ["main"]
