"""Where the real Redis and PostgreSQL of the tests are (set by scripts/test.sh, loopback defaults)."""

from __future__ import annotations

import os

REDIS_URL = os.environ.get("AGENTSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_ADMIN_URL = os.environ.get("AGENTSTREAM_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
