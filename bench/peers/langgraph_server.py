"""The LangGraph API server (``langgraph dev``, in-memory runtime) driven through its HTTP API.

Starts ``langgraph dev`` on 127.0.0.1 serving bench/peers/lg_app (the prebuilt ReAct agent against
the fake LLM), then runs the job sequentially: create a thread, ``POST /threads/{id}/runs/stream``
with ``stream_mode=messages-tuple``, read the SSE response to its end. Reports wall time per run and
bytes on the wire per answer token, then stops the server (by its pid). ``LangGraphServer`` (the
server as a context manager) is what bench/capacity_bench.py's knee starts too.
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


class LangGraphServer:
    """``langgraph dev`` on 127.0.0.1 serving lg_app against the LLM at ``llm_url``, as a context
    manager: ``base`` is its URL once ready; stopped (its own session, by pid) on exit.

    ``jobs``: runs it executes at once (``--n-jobs-per-worker``; ``langgraph dev`` defaults to 1,
    bench/capacity_bench.py's knee gives it as many as the load has users). ``langgraph`` is the
    CLI's path (default: next to this interpreter, the peers' venv); ``cpus``: the CPUs it may run
    on (``taskset``), or None.
    """

    def __init__(
        self,
        llm_url: str,
        *,
        jobs: int | None = None,
        langgraph: str | None = None,
        log_dir: str | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        self.llm_url = llm_url
        self.jobs = jobs
        self.langgraph = langgraph or str(Path(sys.executable).parent / "langgraph")
        self.log_path = Path(log_dir or os.environ.get("BENCH_OUT", "/tmp")) / "langgraph-dev.log"
        self.cpus = cpus
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LangGraphServer:
        env = {
            **os.environ,
            "BENCH_LLM_URL": self.llm_url,
            "LANGSMITH_TRACING": "false",
            "LANGCHAIN_TRACING_V2": "false",
            "LANGGRAPH_CLI_NO_ANALYTICS": "1",
        }
        command = [self.langgraph, "dev", "--no-browser", "--no-reload", "--host", "127.0.0.1"]
        command += ["--port", str(self.port)]
        if self.jobs is not None:
            command += ["--n-jobs-per-worker", str(self.jobs)]
        if self.cpus:
            command = ["taskset", "-c", ",".join(map(str, sorted(self.cpus))), *command]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            command,
            cwd=APP,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 90
            while True:
                try:
                    if httpx.get(f"{self.base}/ok", timeout=1).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"langgraph dev did not start; see {self.log_path}")
                time.sleep(0.3)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        # Our child and its workers only: it runs in its own session.
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="the fake LLM's base URL")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--max-seconds", type=float, default=120)
    args = parser.parse_args()
    expected = expected_answer(args.tokens)
    walls: list[float] = []
    sizes: list[int] = []
    with LangGraphServer(args.url) as server, httpx.Client(base_url=server.base, timeout=60) as client:
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


if __name__ == "__main__":
    main()
