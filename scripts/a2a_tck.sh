#!/usr/bin/env bash
# The official A2A TCK (a2a-tck, its 1.0 line) at level `must` against a service this script starts
# (FACES.md N-08): single-user (the TCK sends no credentials), SQLite in a temporary folder, the
# in-process bus, the offline demo model, and WEBHOOK_ALLOWED_HOSTS=127.0.0.1, so that nothing is
# ever sent off this machine (the TCK's push tests register example.com webhooks: refused); with
# WEBHOOK_ALLOW_PRIVATE on, so that the TCK's own receiver on 127.0.0.1 can be posted to.
#
#   A2A_TCK_DIR=/path/to/a2a-tck bash scripts/a2a_tck.sh [extra run_tck.py arguments]
#
# A2A_TCK_DIR is a checkout of https://github.com/a2aproject/a2a-tck at its 1.0 line (branch
# 1.0-dev; README "A2A (other agents)" names the commit it was last run at). The TCK is not on
# PyPI: the script does not fetch it. Its dependencies go into $A2A_TCK_DIR/.venv at the first run.
# Environment: A2A_TCK_PORT (default 8791), A2A_TCK_LEVEL (must), A2A_TCK_TRANSPORT
# (jsonrpc,http_json: the bindings the card declares). The TCK's reports land in
# $A2A_TCK_DIR/reports/ (compatibility.json, compatibility.html); its exit code is this script's.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

TCK=${A2A_TCK_DIR:-}
if [[ -z "$TCK" || ! -f "$TCK/run_tck.py" ]]; then
  echo "A2A_TCK_DIR must name a checkout of a2a-tck's 1.0 line (git clone -b 1.0-dev https://github.com/a2aproject/a2a-tck)" >&2
  exit 2
fi
PORT=${A2A_TCK_PORT:-8791}
LEVEL=${A2A_TCK_LEVEL:-must}
TRANSPORT=${A2A_TCK_TRANSPORT:-jsonrpc,http_json}

if [[ ! -x .venv/bin/uvicorn ]]; then
  echo "the service is not installed: run bash scripts/test.sh (or pip install -e .) first" >&2
  exit 2
fi
if [[ ! -x "$TCK/.venv/bin/python" ]]; then
  python3 -m venv "$TCK/.venv"
  "$TCK/.venv/bin/python" -m pip install -q -e "$TCK"
fi

WORK=$(mktemp -d)
SERVICE_PID=""
stop() {
  if [[ -n "$SERVICE_PID" ]] && kill -0 "$SERVICE_PID" 2>/dev/null; then
    kill -TERM "$SERVICE_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVICE_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVICE_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap stop EXIT

env -i PATH="$PATH" HOME="${HOME:-/tmp}" \
  DATABASE_URL="sqlite+aiosqlite:///$WORK/agentstream.db" \
  WEBHOOK_ALLOWED_HOSTS=127.0.0.1 WEBHOOK_ALLOW_PRIVATE=true WEBHOOK_RETRY_S=0.2 \
  DEMO_DELAY_S=0.005 SHUTDOWN_GRACE_S=1 LOG_LEVEL=WARNING \
  "$ROOT/.venv/bin/uvicorn" app.main:create_app --factory --host 127.0.0.1 --port "$PORT" \
  >"$WORK/service.log" 2>&1 &
SERVICE_PID=$!

BASE="http://127.0.0.1:$PORT"
for _ in $(seq 1 100); do
  if curl -fs "$BASE/healthz" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$SERVICE_PID" 2>/dev/null; then cat "$WORK/service.log" >&2; exit 1; fi
  sleep 0.1
done
curl -fs "$BASE/.well-known/agent-card.json" >/dev/null

set +e
# The TCK's webhook receiver listens on this machine: its URLs name 127.0.0.1, the one host taken.
(cd "$TCK" && .venv/bin/python run_tck.py --sut-host "$BASE" --level "$LEVEL" --transport "$TRANSPORT" "$@" \
  -- --webhook-host=127.0.0.1)
STATUS=$?
set -e
if [[ $STATUS -ne 0 ]]; then
  echo "--- the service's log (last 40 lines)" >&2
  tail -n 40 "$WORK/service.log" >&2
fi
exit $STATUS
