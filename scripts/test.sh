#!/usr/bin/env bash
# Install what the tests need, make sure Redis, PostgreSQL and Chromium are there (starting our own
# on loopback when none is running, and stopping what we started), then run linters, the type
# checker and the whole test suite.  Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
STATE=$(mktemp -d)
STARTED=()

cleanup() {
  for what in "${STARTED[@]:-}"; do
    case "$what" in
      redis) redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true ;;
      cluster) for port in "${CLUSTER_PORTS[@]}"; do
                 redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
               done ;;
      postgres) su postgres -s /bin/sh -c "pg_ctl -D '$STATE/pg' -m fast stop" >/dev/null 2>&1 \
                  || pg_ctl -D "$STATE/pg" -m fast stop >/dev/null 2>&1 || true ;;
    esac
  done
  rm -rf "$STATE" 2>/dev/null || true
}
trap cleanup EXIT

APT_UPDATED=0
apt_install() {
  command -v apt-get >/dev/null || { echo "need $* but apt-get is not available" >&2; return 1; }
  if [ "$APT_UPDATED" = 0 ]; then apt-get update -qq >/dev/null; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# --- Python environment ----------------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"

# --- Node clients (tests/node: the AI SDK's chat client and AG-UI's HttpAgent, pinned) ----------
# `npm ci` from package-lock.json when node_modules was never installed here, or the lock (or
# package.json) changed since the last install (the stamp is written only after one succeeded).
# ai@7 declares node>=22 but runs on the Node 20 here: tests/node/.npmrc keeps engine-strict off.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then apt_install nodejs npm; fi
NODE_STAMP=tests/node/node_modules/.agentstream-installed
if [ ! -f "$NODE_STAMP" ] || [ tests/node/package-lock.json -nt "$NODE_STAMP" ] \
   || [ tests/node/package.json -nt "$NODE_STAMP" ]; then
  (cd tests/node && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  touch "$NODE_STAMP"
fi

# --- Redis -----------------------------------------------------------------------------------
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
REDIS_PORT=6379
if [ -n "${AGENTSTREAM_TEST_REDIS:-}" ]; then :
elif command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then
  export AGENTSTREAM_TEST_REDIS="redis://127.0.0.1:6379/0"
else
  command -v redis-server >/dev/null || apt_install redis-server
  REDIS_PORT=6399
  redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
    --dir "$STATE" --logfile "$STATE/redis.log" >/dev/null
  STARTED+=(redis)
  for _ in $(seq 100); do redis-cli -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
  export AGENTSTREAM_TEST_REDIS="redis://127.0.0.1:$REDIS_PORT/0"
fi

# --- Redis Cluster: three masters with a replica each, on loopback (RUNS.md S-01) ---------------
CLUSTER_PORTS=()
if [ -n "${AGENTSTREAM_TEST_REDIS_CLUSTER:-}" ]; then :
else
  command -v redis-server >/dev/null || apt_install redis-server
  base=7301
  while :; do  # six free ports in a row (and their cluster bus ports, 10000 above)
    busy=0
    for i in 0 1 2 3 4 5; do
      if port_open $((base + i)) || port_open $((base + i + 10000)); then busy=1; fi
    done
    [ "$busy" = 0 ] && break
    base=$((base + 10))
  done
  for i in 0 1 2 3 4 5; do
    port=$((base + i))
    CLUSTER_PORTS+=("$port")
    mkdir -p "$STATE/cluster-$port"
    redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --cluster-enabled yes \
      --cluster-config-file "$STATE/cluster-$port/nodes.conf" --cluster-node-timeout 2000 \
      --repl-diskless-sync-delay 0 --repl-ping-replica-period 1 \
      --save "" --appendonly no --dir "$STATE/cluster-$port" --logfile "$STATE/cluster-$port/redis.log" >/dev/null
  done
  STARTED+=(cluster)
  for port in "${CLUSTER_PORTS[@]}"; do
    for _ in $(seq 100); do redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
  done
  redis-cli --cluster create $(for port in "${CLUSTER_PORTS[@]}"; do printf '127.0.0.1:%s ' "$port"; done) \
    --cluster-replicas 1 --cluster-yes >"$STATE/cluster-create.log" 2>&1
  cluster_whole() {  # every slot served, every replica in sync (CLUSTER SLOTS lists it only then)
    redis-cli -p "$base" cluster info 2>/dev/null | grep -q "cluster_state:ok" || return 1
    for port in "${CLUSTER_PORTS[@]}"; do
      redis-cli -p "$port" info replication 2>/dev/null | tr -d '\r' | awk -F: '
        $1 == "role" && $2 == "master" { ok = 1 }
        $1 == "master_link_status" { up = ($2 == "up") }
        $1 == "slave_repl_offset" { synced = ($2 > 0) }
        END { exit !(ok || (up && synced)) }' || return 1
    done
  }
  for _ in $(seq 300); do cluster_whole && break; sleep 0.1; done
  export AGENTSTREAM_TEST_REDIS_CLUSTER="redis://127.0.0.1:$base"
fi

# --- PostgreSQL ------------------------------------------------------------------------------
pg_trust_ok() { .venv/bin/python - "$1" <<'PYEOF'
import asyncio, sys
import asyncpg
async def main():
    conn = await asyncpg.connect(sys.argv[1], timeout=3)
    await conn.close()
try:
    asyncio.run(main())
except Exception:
    sys.exit(1)
PYEOF
}
if [ -n "${AGENTSTREAM_TEST_POSTGRES:-}" ]; then :
elif port_open 5432 && pg_trust_ok "postgresql://postgres@127.0.0.1:5432/postgres"; then
  export AGENTSTREAM_TEST_POSTGRES="postgresql://postgres@127.0.0.1:5432"
else
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then apt_install postgresql; fi
  PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  export PATH="$PGBIN:$PATH"
  PG_PORT=5439
  mkdir -p "$STATE/pg"
  if [ "$(id -u)" = 0 ]; then
    chown -R postgres "$STATE"; chmod 755 "$STATE"
    RUN_PG=(su postgres -s /bin/sh -c)
  else
    RUN_PG=(sh -c)
  fi
  "${RUN_PG[@]}" "initdb -D '$STATE/pg' -A trust -U postgres >/dev/null"
  "${RUN_PG[@]}" "pg_ctl -D '$STATE/pg' -l '$STATE/pg.log' -o \"-p $PG_PORT -k '$STATE' -c listen_addresses=127.0.0.1\" -w start >/dev/null"
  STARTED+=(postgres)
  export AGENTSTREAM_TEST_POSTGRES="postgresql://postgres@127.0.0.1:$PG_PORT"
fi

# --- Chromium for the browser tests (Debian's build; never a downloaded one) -------------------
if [ ! -x /usr/bin/chromium ]; then apt_install chromium || echo "warning: chromium could not be installed" >&2; fi
# docker-compose validates docker-compose.yml offline (no Docker engine is needed for `config`).
if ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; then
  apt_install docker-compose || echo "warning: docker-compose could not be installed" >&2
fi

# --- checks and tests ------------------------------------------------------------------------
echo "== ruff"
.venv/bin/ruff check app tests bench
echo "== mypy"
.venv/bin/mypy app
echo "== pytest"
# In parallel, on AGENTSTREAM_TEST_WORKERS pytest-xdist workers (4 by default: the tests wait on
# sockets and processes much of the time, and 4 keep 2 cores busy), each with its own databases,
# Redis keys and ports; a module's tests run on one worker, the browser tests all on one (one
# Chromium), in the order they are collected (tests/support/scheduling.py). Arguments come after
# these and win: `bash scripts/test.sh -n 0` runs the tests one after another, in this process.
# Bytecode is written even under PYTHONDONTWRITEBYTECODE: pytest keeps the test modules it rewrites
# there, which every worker, and every run after this one, would otherwise rewrite again.
set +e
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -W error::DeprecationWarning:app -p no:cacheprovider \
  -n "${AGENTSTREAM_TEST_WORKERS:-4}" --dist loadscope --no-loadscope-reorder "$@"
rc=$?
set -e
exit $rc
