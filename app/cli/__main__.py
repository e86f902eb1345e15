"""``python -m app.cli``: the same as the ``agentstream`` console script."""

from __future__ import annotations

from app.cli.commands import main

raise SystemExit(main())
