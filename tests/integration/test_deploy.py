"""What can be tested of the deployment files without a Docker engine: the compose file validates,
and the image's start command (migrate, then serve) brings up a healthy service."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.server import free_port, wait_healthy
from tests.support.services import unavailable

ROOT = Path(__file__).resolve().parents[2]


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_compose_file_validates_and_runs_two_replicas_on_redis_and_postgres() -> None:
    compose = _compose_command()
    if compose is None:
        unavailable("docker compose / docker-compose is not installed")
        return
    result = subprocess.run(
        [*compose, "-f", "docker-compose.yml", "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert {"api-1", "api-2", "redis", "postgres"} <= set(services)
    for name in ("api-1", "api-2"):
        env = services[name]["environment"]
        assert env["REDIS_URL"].startswith("redis://redis:")
        assert env["DATABASE_URL"].startswith("postgresql+asyncpg://")


def _image_command() -> str:
    cmd_lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("CMD ")]
    assert len(cmd_lines) == 1
    argv = json.loads(cmd_lines[0][len("CMD ") :])
    assert argv[:2] == ["sh", "-c"]
    return str(argv[2])


@pytest.mark.slow
def test_image_start_command_migrates_then_serves_a_healthy_service(tmp_path: Path) -> None:
    command = _image_command()
    assert "agentstream migrate" in command
    port = free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'data' / 'db.sqlite'}",
        "REDIS_URL": "",
        "LLM_BASE_URL": "",
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "DEMO_DELAY_S": "0",
    }
    log = (tmp_path / "log").open("wb")
    proc = subprocess.Popen(
        ["sh", "-c", command], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, timeout=60)
        assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200
        assert (tmp_path / "data" / "db.sqlite").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        finally:
            log.close()
    output = (tmp_path / "log").read_text(errors="replace")
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (exit status -15).
    assert proc.returncode in (0, -signal.SIGTERM), output[-3000:]
    assert "Application shutdown complete" in output, output[-3000:]
