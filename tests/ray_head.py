"""A Ray head for tests that launch `areno train` / `ray job submit` as a user would: one per
module, started with `ray start --block` and stopped by its process id (its whole session), on
loopback only. Test folders import the `ray_head` fixture into their conftest.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayHead:
    address: str  # for RAY_ADDRESS
    dashboard: str  # for `ray job submit --address`
    temp_dir: Path
    env: dict

    def run(self, *args: str, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs
        )


def ray_env() -> dict:
    return dict(
        os.environ,
        RAY_AUTH_MODE="disabled",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.1",
        RAY_DEDUP_LOGS="0",
        PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}",
    )


@pytest.fixture(scope="module")
def ray_head():
    env = ray_env()
    temp_dir = Path(tempfile.mkdtemp(prefix="areno-ray-", dir="/tmp"))
    port, dashboard_port = _free_port(), _free_port()
    process = subprocess.Popen(
        [
            str(VENV_BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{dashboard}/api/version", timeout=1).read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("ray start --head did not come up") from None
            time.sleep(0.5)
    env = dict(env, RAY_ADDRESS=f"127.0.0.1:{port}")
    try:
        yield RayHead(f"127.0.0.1:{port}", dashboard, temp_dir, env)
    finally:
        # `ray start --block` stops the processes of its session when it is terminated.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
