"""The A2A SDK loads with the first A2A request, not with the app: every worker (and every test's
uvicorn process) would otherwise spend some 0.6 s importing its server modules and protobuf types."""

from __future__ import annotations

import subprocess
import sys

from tests.support.server import ROOT

SDK_MODULES = "import sys, app.main; print(*sorted(m for m in sys.modules if m.startswith('a2a')))"


def test_importing_the_app_loads_no_part_of_the_a2a_sdk() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", SDK_MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert loaded == []
