#!/usr/bin/env bash
# Install AgentStream into .venv and start it on its embedded defaults: the built-in demo model,
# SQLite under ./data, the in-process bus. Then open http://127.0.0.1:8000/ .
# Any setting can be given in the environment or a .env file (see .env.example).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e .
exec .venv/bin/agentstream serve --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" "$@"
