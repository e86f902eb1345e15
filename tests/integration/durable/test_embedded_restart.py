"""The embedded default is durable too (RUNS.md R-09): one process on SQLite with the in-process
bus, killed with SIGKILL mid-run and started again, carries the run on to the end; its client, back
with its cursor, has every event of both attempts once, as the database keeps them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.durable.support import (
    PlanAgent,
    check_carried_on,
    mcp_servers,
    read_until_reached,
    send_hold,
)
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    FakeLLM,
    SseEvent,
    clients_fixture,
    fake_llm_serving,
    thinking,
    worker_env,
)
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.timeout(60, func_only=True), pytest.mark.slow]


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with fake_llm_serving() as fake:
        yield fake


# During a model call: tests/integration/service/test_workers_sqlite.py.
@pytest.mark.parametrize("point", ["tool", "synthesis"])
def test_a_killed_single_process_started_again_carries_its_run_on(
    point: str, llm: FakeLLM, sqlite_migrated_template: Path, tmp_path: Path, clients: Callable[..., Api]
) -> None:
    database = tmp_path / "agentstream.db"
    database.write_bytes(sqlite_migrated_template.read_bytes())
    journal = tmp_path / "mcp.journal"
    env = worker_env(
        f"sqlite+aiosqlite:///{database}",
        llm.base_url,
        MCP_SERVERS=mcp_servers(journal),
        RUN_LEASE_S="30",  # the successor does not wait for it: the dead process was of this host
    )
    agent = llm.play(PlanAgent(hold=point))  # type: ignore[arg-type]
    hold = send_hold(journal)
    if point == "tool":
        hold.touch()
    first = ServerProcess(env).start(tmp_path / "first.log")
    successor: ServerProcess | None = None
    try:
        api = clients(first.base_url)
        conv = api.create_conversation(completion_check=False)
        run_id = api.start_run(conv, "work through the plan")
        with api.stream(conv) as stream:
            received = read_until_reached(stream, agent, journal, run_id, point)
            first.kill()
        agent.release.set()
        hold.unlink(missing_ok=True)

        successor = ServerProcess(env).start(tmp_path / "successor.log")
        again = clients(successor.base_url)
        with again.stream(conv, last_event_id=received[-1].id) as stream:
            received += stream.read()
        check_carried_on(again, run_id, received, agent, journal, point)
    finally:
        agent.release.set()
        hold.unlink(missing_ok=True)
        first.kill()
        if successor is not None:
            successor.stop()
