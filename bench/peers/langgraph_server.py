"""The LangGraph API server (``langgraph dev``, in-memory runtime) driven through its HTTP API.

Starts ``langgraph dev`` on 127.0.0.1 serving bench/peers/lg_app (the prebuilt ReAct agent against
the fake LLM), then runs the job sequentially: create a thread, ``POST /threads/{id}/runs/stream``
with ``stream_mode=messages-tuple``, read the SSE response to its end. Reports wall time per run and
bytes on the wire per answer token, then stops the server (by its pid).
Run: ``bench/.venv-peers/bin/python -m bench.peers.langgraph_server --url LLM_URL``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.measure import QUESTION, emit, expected_answer, percentile

APP = Path(__file__).resolve().parent / "lg_app"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(client: httpx.Client) -> tuple[str, int, int]:
    """(answer, tool results, bytes received) of one run."""
    thread = client.post("/threads", json={}).json()["thread_id"]
    body = {
        "assistant_id": "agent",
        "input": {"messages": [{"role": "user", "content": QUESTION}]},
        "stream_mode": ["messages-tuple"],
    }
    parts: list[str] = []
    tools = 0
    received = 0
    with client.stream("POST", f"/threads/{thread}/runs/stream", json=body) as response:
        response.raise_for_status()
        received += sum(len(k) + len(v) + 4 for k, v in response.headers.raw) + 17
        event = ""
        buffer = b""
        for raw in response.iter_raw():
            received += len(raw)
            buffer += raw
            while b"\n" in buffer:
                line_bytes, buffer = buffer.split(b"\n", 1)
                line = line_bytes.decode().rstrip("\r")
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "messages":
                    message, meta = json.loads(line[6:])
                    if message.get("type") == "tool":
                        tools += 1
                    elif message.get("type") == "AIMessageChunk" and meta.get("langgraph_node") == "agent":
                        if isinstance(message.get("content"), str):
                            parts.append(message["content"])
    return "".join(parts), tools, received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="the fake LLM's base URL")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--max-seconds", type=float, default=120)
    args = parser.parse_args()
    port = free_port()
    env = {
        **os.environ,
        "BENCH_LLM_URL": args.url,
        "LANGSMITH_TRACING": "false",
        "LANGCHAIN_TRACING_V2": "false",
        "LANGGRAPH_CLI_NO_ANALYTICS": "1",
    }
    langgraph = str(Path(sys.executable).parent / "langgraph")
    log = open(Path(os.environ.get("BENCH_OUT", "/tmp")) / "langgraph-dev.log", "wb")
    server = subprocess.Popen(
        [langgraph, "dev", "--no-browser", "--no-reload", "--host", "127.0.0.1", "--port", str(port)],
        cwd=APP,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/ok", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("langgraph dev did not start; see langgraph-dev.log")
            time.sleep(0.3)
        expected = expected_answer(args.tokens)
        walls: list[float] = []
        sizes: list[int] = []
        with httpx.Client(base_url=base, timeout=60) as client:
            stop = time.monotonic() + args.max_seconds
            for i in range(args.warmup + args.runs):
                t0 = time.perf_counter()
                answer, tools, received = one_run(client)
                wall = time.perf_counter() - t0
                if answer != expected or tools != args.k:
                    raise SystemExit(f"langgraph dev run was wrong: {tools} tools, {answer[:60]!r}")
                if i >= args.warmup:
                    walls.append(wall)
                    sizes.append(received)
                if time.monotonic() > stop:
                    break
        emit(
            {
                "subject": "LangGraph API server (langgraph dev, in-memory)",
                "runs": len(walls),
                "wall_ms_mean": 1000 * statistics.fmean(walls),
                "wall_ms_p50": 1000 * statistics.median(walls),
                "wall_ms_p99": 1000 * percentile(walls, 0.99),
                "stream_bytes_per_token": statistics.fmean(sizes) / args.tokens,
            }
        )
    finally:
        # Our child and its workers only: it runs in its own session.
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


if __name__ == "__main__":
    main()
