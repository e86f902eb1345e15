"""The publisher's tests run over both of its ways to the bus."""

from __future__ import annotations

import pytest

from tests.unit.streaming.doubles import ScriptedBus, append_nowait


@pytest.fixture(params=["send loop", "direct"])
def bus_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test of a publisher twice: every event through its send loop (the in-process bus's
    way), and with ``append_nowait`` on the bus (the Redis buses' way: idle runs send themselves)."""
    if request.param == "direct":
        monkeypatch.setattr(ScriptedBus, "append_nowait", append_nowait, raising=False)
    return str(request.param)
