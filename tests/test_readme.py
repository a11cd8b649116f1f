"""The README check: every fenced command of README.md is run, by this module or by the test
that names it (tests/readme.py). Here: the serving command and the client snippet, as written,
on a tiny checkpoint; the development commands; and the markers themselves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from areno.media.samples import write_image
from tests.ray_head import free_port, ray_head  # noqa: F401 (a fixture)
from tests.readme import REPO, TESTED_BY, block, blocks


def test_every_command_block_is_checked() -> None:
    commands = [b for b in blocks() if b.lang in ("bash", "sh", "python")]
    assert commands, "the README has no command blocks"
    unmarked = [b.line for b in commands if b.kind is None]
    assert not unmarked, f"README blocks at lines {unmarked} carry no `<!-- check: ... -->`"
    for b in commands:
        if b.kind == "test":
            path, _, name = TESTED_BY[b.name].partition("::")
            source = (REPO / path).read_text()
            assert f'block("{b.name}")' in source, (b.name, path)
            assert not name or f"def {name}(" in source, (b.name, name)
        if b.kind == "ci":
            ci = (REPO / ".ci" / "run").read_text()
            assert all(line in ci for line in b.text.strip().splitlines()), b.text


def test_the_development_commands_pass() -> None:
    """Lint and format checks as written (the whole suite is this run itself)."""
    lines = block("development").command().strip().splitlines()
    lint = [line.split("#")[0].strip() for line in lines if "ruff" in line]
    assert lint
    for command in lint:
        result = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


@pytest.fixture
def served(ray_head, tiny_path):  # noqa: F811 (the fixture above)
    """`areno serve` as the README writes it, joined to the module's Ray head, on a tiny
    checkpoint and a free port; stopped with Ctrl-C (SIGINT) as the README says."""
    port = free_port()
    command = block("serve").command().replace("\\\n", " ")
    command = command.replace("/path/to/checkpoint", str(tiny_path("qwen3_5")))
    command = re.sub(r"--port \d+", f"--port {port}", command)
    process = subprocess.Popen(
        ["bash", "-c", command],
        cwd=REPO,
        env=ray_head.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_healthy(port, process)
        yield port
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_healthy(port: int, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()[-4000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"areno serve was not healthy within {timeout} s")


def test_the_serving_command_and_the_client_snippet_run_as_written(served, tmp_path) -> None:
    image = write_image(tmp_path / "cat.jpg", 64, 48)
    code = block("client").text.replace("/data/cat.jpg", str(image))
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{served}")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prompt_tokens=" in result.stdout and "completion_tokens=" in result.stdout
