#!/usr/bin/env bash
# Creates bench/.venv-peers: the peer frameworks the benchmarks compare against, plus the plotting and
# profiling tools. None of this is a dependency of the project. Idempotent: a second run only checks.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="$here/.venv-peers"
python="${PYTHON:-python3}"
packages=(
    "langgraph"
    "langchain-openai"
    "openai-agents"
    "langgraph-cli[inmem]"
    "matplotlib"
    "py-spy"
    "pyinstrument"
    "orjson"
    "httpx"
)
if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
fi
if ! "$venv/bin/python" -c "import langgraph, langchain_openai, agents, matplotlib, pyinstrument" 2>/dev/null \
    || [[ ! -x "$venv/bin/langgraph" ]] || [[ ! -x "$venv/bin/py-spy" ]]; then
    "$venv/bin/pip" install --quiet "${packages[@]}"
fi
"$venv/bin/python" - <<'PY'
from importlib.metadata import version
for name in ("langgraph", "langchain-openai", "openai-agents", "langgraph-api", "langgraph-cli",
             "langgraph-runtime-inmem", "openai", "matplotlib", "pyinstrument", "py-spy"):
    try:
        print(f"{name}=={version(name)}")
    except Exception:
        print(f"{name}: not installed")
PY
