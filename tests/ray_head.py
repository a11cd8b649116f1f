"""A Ray head for tests that launch `areno train` / `ray job submit` as a user would: one per
module, started with `ray start --block` and stopped by its process id (its whole session), on
loopback only. Test folders import the `ray_head` fixture into their conftest.py."""

from __future__ import annotations

import contextlib
import os
import shutil
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


# The environment of every Ray process a test starts (and of drivers that join it).
RAY_TEST_ENV = {
    "RAY_AUTH_MODE": "disabled",  # a loopback-only cluster of a test; never on a real one
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep every listener on 127.0.0.1
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    "RAY_DEDUP_LOGS": "0",
}


def free_port() -> int:
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

    def session_logs(self) -> str:
        """The text of the head's Ray log files (where trainer and worker log lines land)."""
        texts = []
        for path in self.temp_dir.rglob("*"):
            if path.is_file() and path.suffix in (".out", ".err", ".log"):
                texts.append(path.read_text(errors="replace"))
        return "\n".join(texts)


def ray_env() -> dict:
    return dict(os.environ, **RAY_TEST_ENV, PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}")


# A driver that joins the head and sees its node alive: the dashboard answering is not enough (a
# head whose raylet failed to start still serves the dashboard, and every driver then fails with
# "No node info found").
_JOIN_CHECK = "import ray; ray.init(); assert any(n['Alive'] for n in ray.nodes()); ray.shutdown()"


@pytest.fixture(scope="module")
def ray_head():
    for attempt in range(2):
        process, head = _start_head()
        if _driver_can_join(head):
            break
        stop_head(process)
        shutil.rmtree(head.temp_dir, ignore_errors=True)
        if attempt:
            raise RuntimeError("a driver could not join the test's ray head (started twice)")
    try:
        yield head
    finally:
        stop_head(process)
        shutil.rmtree(head.temp_dir, ignore_errors=True)


def _start_head() -> tuple[subprocess.Popen, RayHead]:
    env = ray_env()
    temp_dir = Path(tempfile.mkdtemp(prefix="areno-ray-", dir="/tmp"))
    port, dashboard_port = free_port(), free_port()
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
            # its job agent's own port (52365 by default) may be another Ray's on this machine
            f"--dashboard-agent-listen-port={free_port()}",
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
    return process, RayHead(f"127.0.0.1:{port}", dashboard, temp_dir, env)


def _driver_can_join(head: RayHead) -> bool:
    try:
        joined = head.run(sys.executable, "-c", _JOIN_CHECK, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return joined.returncode == 0


def stop_head(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a `ray start --block` head and every process of its session, by id.

    Terminated, `ray start --block` stops its session gracefully, which took 34 s here (most of
    it waiting on its own timeouts); whatever is still up after `grace_s` is killed. Its workers
    run in process groups of their own, so the whole tree under the head is found first."""
    tree = _descendants(process.pid)
    os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    for pid in [process.pid, *tree]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def _descendants(root: int) -> list[int]:
    """Process ids of every descendant of `root` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found
