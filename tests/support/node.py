"""Driving the service with the real Node clients: the AI SDK's chat client and AG-UI's HttpAgent.

The clients are npm packages pinned in tests/node/package.json (and package-lock.json), which
``scripts/test.sh`` installs into tests/node/node_modules (``npm ci``). A test runs a script under
tests/node (``tests/node/cases/*.mjs``, helpers in ``tests/node/lib/``) with ``run_node``: the
script reads its parameters from the environment (``AGENTSTREAM_BASE``, ``AGENTSTREAM_KEY``, and
whatever else the test passes) and prints its answer as one line of JSON, the last line on stdout
(``emit``/``main`` in tests/node/lib/io.mjs), which ``run_node`` returns parsed.

- ``NODE_DIR``: tests/node, the scripts' working directory.
- ``node_available()``: whether ``node`` is on PATH.
- ``require_node()``: fails (never skips) when node or the installed packages are missing, telling
  to run scripts/test.sh. A test that needs the clients calls it first (or uses a fixture that
  does): on CI a missing install must be a failure, not a silently skipped test.
- ``run_node(script, env, timeout=60)``: runs ``node <script>`` and returns its JSON answer; a
  non-zero exit, a timeout or an answer that is not JSON fails the test with the stderr tail.

Validating AG-UI events in Python, with the ag-ui-validate package (``ag_ui_validate``, a test
extra; its pytest plugin is off, ``-p no:ag_ui_validate`` in pyproject's addopts, as it only
imports itself in every xdist worker — the functions are imported where they are used)::

    from ag_ui_validate.pytest_plugin import assert_valid_agui, validate_agui

    assert_valid_agui(events, max_warnings=0)  # AssertionError listing each finding, else None

    report = validate_agui(events)  # ag_ui_validate.types.Report
    assert (report.summary.errors, report.summary.warnings) == (0, 0), report.diagnostics
    assert report.internal_errors == []

``events`` is a list of event dicts (or of JSON strings, or one JSONL string), in stream order.
``assert_valid_agui`` alone (``max_warnings=None``) fails on errors only, so ``max_warnings=0`` is
what makes warnings fail too. A diagnostic (``ag_ui_validate.types.Diagnostic``) has ``rule``
(e.g. ``"AGUI001"``: first event not RUN_STARTED), ``severity`` (error/warning/info), ``message``,
``event_index`` (-1 for the stream as a whole), ``spec_url``. Info findings count in neither:
AGUI902 (no event carries a ``timestamp``) is one. ``validate_agui(events, features=[...],
severity_overrides={"AGUI105": "off"})`` declares features and changes a rule's severity. The
engine underneath is ``ag_ui_validate.create_validator(ValidatorOptions())`` with ``.feed(event)``
per event, ``.finalize()``, ``.report()``; it never raises on its input.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

NODE_DIR = Path(__file__).resolve().parent.parent / "node"
"""tests/node: package.json, package-lock.json, node_modules, lib/ and cases/."""

_STDERR_TAIL = 4000
_DROPPED_ENV = ("SUPPRESS_TRANSFORMATION_WARNINGS",)
"""Inherited variables a script must not see unless a test passes them: this one silences the
'[ag-ui]' warnings that tests/node/lib/agui.mjs records."""


def node_available() -> bool:
    """Whether a ``node`` executable is on PATH."""
    return shutil.which("node") is not None


def require_node() -> None:
    """Fails the test, with what to do, when node or the pinned packages are not installed."""
    if not node_available():
        pytest.fail("node is not installed: run `bash scripts/test.sh` (it installs nodejs and npm)")
    stamp = NODE_DIR / "node_modules" / ".package-lock.json"
    if not stamp.is_file():
        pytest.fail(
            f"the Node clients are not installed in {NODE_DIR / 'node_modules'}: run `bash scripts/test.sh` "
            "(or `npm ci` in tests/node)"
        )


def _script_path(script: Path | str) -> Path:
    path = Path(script)
    if not path.is_absolute():
        for candidate in (NODE_DIR / path, NODE_DIR / "cases" / path):
            if candidate.is_file():
                return candidate
    if not path.is_file():
        raise AssertionError(f"no such Node script: {script} (looked in {NODE_DIR} and its cases/)")
    return path.resolve()


def run_node(script: Path | str, env: dict[str, str], timeout: float = 60) -> Any:
    """Runs ``node <script>`` in tests/node and returns the JSON of its last non-empty stdout line.

    ``script`` is a path, or a name relative to tests/node or tests/node/cases. ``env`` is added to
    this process's environment. The script runs in a process group of its own, killed whole when
    it outlives ``timeout`` seconds. Fails the test (AssertionError, with the exit code and the
    tail of stderr) when the script exits non-zero, times out, or prints no JSON line last.
    """
    require_node()
    path = _script_path(script)
    full_env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    full_env.update(env)
    proc = subprocess.Popen(
        ["node", str(path)],
        cwd=NODE_DIR,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout_b, stderr_b = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout_b, stderr_b = proc.communicate()
        raise AssertionError(
            f"node {path.name} did not finish within {timeout} s\n--- stderr (tail) ---\n"
            f"{_tail(stderr_b)}\n--- stdout (tail) ---\n{_tail(stdout_b)}"
        ) from None
    finally:
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    if proc.returncode != 0:
        raise AssertionError(
            f"node {path.name} exited with code {proc.returncode}\n--- stderr (tail) ---\n{_tail(stderr_b)}"
        )
    lines = [line for line in stdout_b.decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        raise AssertionError(f"node {path.name} printed nothing on stdout\n--- stderr ---\n{_tail(stderr_b)}")
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise AssertionError(
            f"node {path.name}: the last stdout line is not JSON ({e}): {lines[-1][:500]!r}\n"
            f"--- stderr (tail) ---\n{_tail(stderr_b)}"
        ) from None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(data: bytes) -> str:
    text = data.decode("utf-8", "replace")
    return text if len(text) <= _STDERR_TAIL else "…" + text[-_STDERR_TAIL:]
