"""`areno demo` as a user runs it: only its own lines on the terminal, fewer than 40, with Ray's
and Serve's logs in the file it names; no process of it left behind."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.readme import block

REPO = Path(__file__).resolve().parents[2]
LOG_LINE = re.compile(r"^areno demo: Ray, Serve and library logs go to (\S+) ")
TITLES = ["image request", "audio request", "video request", "tools request", "streaming video"]


def _own(line: str) -> bool:
    """The demo's own lines (areno/demo.py): "areno demo: ..." or an answer block's blank line,
    "== " title or body indented by three spaces."""
    return line == "" or line.startswith(("areno demo:", "== ", "   "))


def _session(sid: int) -> list[int]:
    """Process ids of session `sid` (from /proc): the demo and every Ray process it started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == sid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
    return found


@pytest.mark.slow
def test_demo_prints_only_its_own_lines():
    # the README's quick start (tests/readme.py), after its setup (CI's own first step)
    command = block("demo").command().replace("bash scripts/setup.sh && ", "")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    process = subprocess.Popen(
        ["bash", "-c", command],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its session holds every process it starts
    )
    log_path = None
    try:
        output, _ = process.communicate(timeout=600)
        lines = output.splitlines()
        assert process.returncode == 0, output
        assert len(lines) < 40, output
        assert [line for line in lines if not _own(line)] == [], output
        match = LOG_LINE.match(lines[0])
        assert match, output
        log_path = Path(match[1])
        assert sum(str(log_path) in line for line in lines) == 1
        titles = [line[3:] for line in lines if line.startswith("== ")]
        assert [t for t in TITLES if any(title.startswith(t) for title in titles)] == TITLES
        log = log_path.read_text()
        assert "Started a local Ray instance" in log
        assert "(ServeController pid=" in log and "(ServeReplica:areno:" in log
        deadline = time.monotonic() + 30
        while _session(process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _session(process.pid) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in _session(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if log_path is not None:
            log_path.unlink(missing_ok=True)
