"""The AI SDK face across a worker's death (FACES.md V-04, V-05; RUNS.md R-03): the worker that
serves a useChat response is SIGKILLed mid-answer; the chat resumes against another worker, which
carries the run on, and ends with the message a fresh read gives, the answer exactly once."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.service.workers_support import (
    Cluster,
    fake_llm_serving,
    new_redis_prefix,
    redis_keys,
)
from tests.support.fake_agents import EchoAgentBehaviour
from tests.support.node import require_node, run_node
from tests.support.server import wait_until

HEADERS = {"Authorization": "Bearer key-alice"}


@pytest.fixture
def two_workers(migrated_database_url: str, tmp_path: Path) -> Iterator[Cluster]:
    require_node()
    with fake_llm_serving() as llm, redis_keys(new_redis_prefix()) as prefix:
        llm.agent.inner = EchoAgentBehaviour(60, delay_s=0.04)
        cluster = Cluster(migrated_database_url, llm, prefix, tmp_path)
        try:
            roles = {"API_KEYS": "alice:key-alice", "RUN_LEASE_S": "2"}
            cluster.start_roles({"a": roles, "b": roles})
            yield cluster
        finally:
            cluster.close()


def answer_deltas(b: httpx.Client, question: str) -> list[dict[str, Any]]:
    items = b.get("/api/conversations").json()["items"]
    conv = next((c for c in items if c["title"] == question), None)
    run_id = b.get(f"/api/conversations/{conv['id']}").json()["active_run_id"] if conv else None
    if run_id is None:
        return []
    events: list[dict[str, Any]] = b.get(f"/api/runs/{run_id}/events").json()
    return [e for e in events if e["event"] == "answer" and e["data"]["status"] == "delta"]


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_chat_whose_worker_is_killed_mid_answer_resumes_on_another_and_ends_whole(
    two_workers: Cluster,
) -> None:
    a, b = two_workers.role("a"), two_workers.role("b")
    chat, question = f"chat-{secrets.token_hex(4)}", "tell me about comets"
    env = {
        "AGENTSTREAM_BASE": a.base_url,
        "AGENTSTREAM_KEY": "key-alice",
        "SCENARIO": "resumeCut",
        "CHAT_ID": chat,
        "TEXT": question,
        "RESUME_BASE": b.base_url,
    }
    with (
        ThreadPoolExecutor(max_workers=1) as pool,
        httpx.Client(base_url=b.base_url, headers=HEADERS) as http,
    ):
        following = pool.submit(run_node, "aisdk_chat.mjs", env, 90)
        wait_until(lambda: answer_deltas(http, question), timeout=30, what="the answer to start streaming")
        a.kill()
        result = following.result(timeout=100)

        assert result["cut"]["status"] == "error"  # the killed worker's response broke off
        assert result["status"] == "ready" and result["messages"] == result["server"]
        message = result["messages"][-1]
        run = http.get(f"/api/runs/{message['id']}").json()
        assert (run["status"], run["attempt"]) == ("completed", 2), run
        texts = [p for p in message["parts"] if p["type"] == "text"]
        assert texts == [{"type": "text", "text": run["answer"], "state": "done"}]  # once, not doubled
        assert run["answer"] == two_workers.llm.agent.answer
        phases = [p["data"]["phase"] for p in message["parts"] if p["type"] == "data-agentstream-phase"]
        assert "resumed" in phases
        assert message["metadata"]["usage"] == run["usage"]
