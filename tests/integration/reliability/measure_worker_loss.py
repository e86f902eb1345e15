"""Time how long a lost worker's run takes to end, for docs/reliability.md.

The behaviour is tested in tests/integration/service/test_workers_cluster.py (SIGKILL: another
worker closes the run; SIGTERM: the run finishes within the grace or is closed when it runs
out). This script replays those scenarios with the same helpers and prints the times a client
sees::

    .venv/bin/python -m tests.integration.reliability.measure_worker_loss [--rounds 3]

It needs the test PostgreSQL and Redis (``tests.support.services``), starts four uvicorn workers
and takes 10-25 seconds a round (mostly starting the workers).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import asyncpg

from app.db.migrate import upgrade_database
from tests.integration.service.workers_support import (
    Api,
    Cluster,
    FakeLLM,
    GatedAgent,
    fake_llm_serving,
    new_redis_prefix,
    redis_keys,
    thinking,
)
from tests.support.services import POSTGRES_SERVER_URL

ROLES = {
    "survivor": {},
    "killed": {"RUN_LEASE_S": "1"},
    "long-grace": {"SHUTDOWN_GRACE_S": "15"},
    "short-grace": {"SHUTDOWN_GRACE_S": "1"},
}
"""The workers of test_workers_cluster.py (RUN_LEASE_S is 2 unless said)."""


async def _admin(statement: str) -> None:
    conn = await asyncpg.connect(f"{POSTGRES_SERVER_URL}/agentstream_test", timeout=5)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


def sigkill_round(cluster: Cluster, llm: FakeLLM, survivor: Api) -> str:
    llm.play(GatedAgent(tokens=400, delay_s=0.01))
    victim = cluster.roles["killed"]
    api = Api(victim.base_url)
    try:
        conv = api.create_conversation()
        api.start_run(conv, "a long answer")
        with survivor.stream(conv) as stream:
            stream.read(count=30)
            victim.kill()
            killed = time.monotonic()
            done = stream.read()[-1]
            took = time.monotonic() - killed
    finally:
        api.close()
    status = done.data["status"]
    return f"SIGKILL mid-answer: done ({status}) through the other worker {took:.2f}s after the kill"


def sigterm_round(cluster: Cluster, llm: FakeLLM, survivor: Api, role: str) -> str:
    agent = llm.play(GatedAgent(tokens=20))
    worker = cluster.roles[role]
    assert worker.proc is not None
    api = Api(worker.base_url)
    try:
        conv = api.create_conversation()
        agent.close_gate()
        api.start_run(conv, "question")
        with api.stream(conv) as stream:
            received = stream.read(until=thinking)
            worker.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            received += stream.read()
            stream_ended = time.monotonic() - sent
        with survivor.stream(conv, last_event_id=received[-1].id) as stream:
            if role == "long-grace":
                agent.gate.set()
            done = stream.read()[-1]
            done_after = time.monotonic() - sent
        worker.proc.wait(timeout=30)
        exited = time.monotonic() - sent
    finally:
        api.close()
    return (
        f"SIGTERM ({role}): its stream ended after {stream_ended:.2f}s, done ({done.data['status']}) "
        f"after {done_after:.2f}s, the process exited after {exited:.2f}s"
    )


def measure_round() -> list[str]:
    name = f"agentstream_test_{secrets.token_hex(6)}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    url = f"{POSTGRES_SERVER_URL}/{name}".replace("postgresql://", "postgresql+asyncpg://", 1)
    try:
        upgrade_database(url)
        with fake_llm_serving() as llm, redis_keys(new_redis_prefix()) as prefix:
            cluster = Cluster(url, llm, prefix, Path(tempfile.mkdtemp(prefix="worker-loss-")))
            try:
                cluster.start_roles(ROLES)
                survivor = Api(cluster.roles["survivor"].base_url)
                try:
                    return [
                        sigkill_round(cluster, llm, survivor),
                        sigterm_round(cluster, llm, survivor, "long-grace"),
                        sigterm_round(cluster, llm, survivor, "short-grace"),
                    ]
                finally:
                    survivor.close()
            finally:
                cluster.close()
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    for round_number in range(1, args.rounds + 1):
        for line in measure_round():
            print(f"round {round_number}: {line}", flush=True)


if __name__ == "__main__":
    main()
