"""A worker killed with SIGKILL at any point of a run (RUNS.md R-03 to R-06, R-10): another worker
carries the run on from its last checkpoint and it completes; its client gets every event of both
attempts once, as the database keeps them; the tool with a side effect runs once; the answer is
the one streamed after the resume.

Two stacks, each a module-scoped set of uvicorn worker processes on Redis: SQLite (one file, WAL)
and PostgreSQL. A survivor, B, streams every run; each test kills a worker of its own, V, which ran
the run (the POST went to V). The other victims, idle, may carry the run on as well as B: any
worker may.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.db.migrate import upgrade_database
from tests.integration.conftest import PostgresServer, run_in_thread
from tests.integration.durable.support import (
    KILL_POINTS,
    PlanAgent,
    check_carried_on,
    mcp_servers,
    read_until_reached,
    send_hold,
)
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    Api,
    Cluster,
    SseEvent,
    clients_fixture,
    fake_llm_serving,
    new_redis_prefix,
    redis_keys,
    thinking,
)
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.timeout(60, func_only=True), pytest.mark.slow, pytest.mark.redis]

VICTIMS = {point: {} for point in KILL_POINTS}


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def stack(
    request: pytest.FixtureRequest, sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, Path]]:
    """The survivor "b" and one victim per kill point (started in the background), on one database
    of this module, with the journal of their MCP tools."""
    folder = tmp_path_factory.mktemp(f"kill-{request.param}")
    journal = folder / "mcp.journal"
    created: str | None = None
    if request.param == "sqlite":
        path = folder / "agentstream.db"
        path.write_bytes(sqlite_migrated_template.read_bytes())
        url = f"sqlite+aiosqlite:///{path}"
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        created = f"agentstream_test_{secrets.token_hex(6)}"
        server.create_database(created)
        url = server.async_url(created)
        run_in_thread(lambda: upgrade_database(url))
    try:
        with fake_llm_serving() as llm, redis_keys(new_redis_prefix()) as prefix:
            cluster = Cluster(url, llm, prefix, folder)
            settings = {"MCP_SERVERS": mcp_servers(journal), "RUN_LEASE_S": "2"}
            try:
                cluster.start_roles({"b": settings})
                cluster.start_roles_in_background({role: settings for role in VICTIMS})
                yield cluster, journal
            finally:
                cluster.close()
    finally:
        if created is not None:
            request.getfixturevalue("postgres_server").drop_database(created)


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_run_whose_worker_is_killed_is_carried_on_and_completes(
    point: str, stack: tuple[Cluster, Path], clients: Callable[..., Api]
) -> None:
    cluster, journal = stack
    agent = cluster.llm.play(PlanAgent(hold=point))  # type: ignore[arg-type]
    hold = send_hold(journal)
    if point == "tool":
        hold.touch()
    victim: ServerProcess = cluster.role(point)
    v, b = clients(victim.base_url), clients(cluster.role("b").base_url)
    conv = v.create_conversation(completion_check=False)
    try:
        run_id = v.start_run(conv, "work through the plan")
        with b.stream(conv) as stream:
            received = read_until_reached(stream, agent, journal, run_id, point)
            victim.kill()
            agent.release.set()
            hold.unlink(missing_ok=True)
            received += stream.read()
    finally:
        agent.release.set()
        hold.unlink(missing_ok=True)
    check_carried_on(b, run_id, received, agent, journal, point)
