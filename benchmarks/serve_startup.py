"""Seconds from `areno serve` to a healthy server: a first start on an empty compile cache,
then starts of the same command that find it warm (areno/engine/compile_cache.py).

Each start is the command a user runs, in a fresh Ray of its own: `areno serve --model-path M
--decode-compile D --prefill-compile D --port P`, with ARENO_COMPILE_CACHE pointing at a
directory the benchmark owns (empty before the first start). Timed from the command's launch to
the first 200 of GET /health; the Generator replica's start-up phases (its processor and
warm-up prompts, its engine imports, then the engine's load, cache, compile, warm-up) are read
from the banner `areno serve` prints, and a timeline of the start's milestones (Ray up,
Serve up, the replicas asked for, the Generator replica's first line, its engine up, the app
running) from when the output lines arrive. Default: the tiny Qwen3.5 on CPU with Inductor; on a
GPU machine pass a 2B-shaped checkpoint and `--device cuda`. Prints a table and writes JSON
(default benchmarks/results/serve_startup.json).

    python benchmarks/serve_startup.py [--model-path CKPT] [--warm-starts 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
from engine_workloads import stop_on_terminate

START_UP_LINE = re.compile(r"engine start-up: (.*)")
PHASE = re.compile(r"([a-z-]+) ([0-9.]+) s")
# Milestones of a start, by the first output line that matches (Ray forwards the replicas' lines
# to the driver's output, a fraction of a second late): seconds from the command's launch.
MILESTONES = {
    "ray up": re.compile(r"Started a local Ray instance"),
    "serve up": re.compile(r"Started Serve in namespace"),
    "replicas asked": re.compile(r"Adding 1 replica to Deployment\(name='GeneratorServer'"),
    # its first line: on a start it is transformers' "Loading weights", after the imports
    "generator prints": re.compile(r"ServeReplica:[^ ]*GeneratorServer"),
    "engine up": re.compile(r"ServeReplica:[^ ]*GeneratorServer.*start-up: "),
    "app running": START_UP_LINE,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def start_once(args: argparse.Namespace, cache: Path, timeout: float) -> dict:
    """One `areno serve` start: seconds to /health 200, the banner's start-up phases."""
    port = _free_port()
    command = [
        sys.executable, "-m", "areno.cli", "serve", "--model-path", args.model_path,
        "--device", args.device, "--decode-compile", args.compile,
        "--prefill-compile", args.compile, "--max-running-prompts", str(args.max_running_prompts),
        "--port", str(port),
    ]  # fmt: skip
    env = dict(os.environ, ARENO_COMPILE_CACHE=str(cache))
    env.pop("RAY_ADDRESS", None)
    started = time.perf_counter()
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    arrived: list[float] = []  # each line's seconds from the launch

    def read() -> None:
        for line in process.stdout:
            arrived.append(time.perf_counter() - started)
            lines.append(line)
            if args.echo:
                print(f"[{arrived[-1]:7.1f} s] {line}", end="", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not _healthy(port):
            if process.poll() is not None:
                raise RuntimeError("areno serve exited:\n" + "".join(lines[-40:]))
            if time.perf_counter() - started > timeout:
                raise RuntimeError(f"not healthy within {timeout} s:\n" + "".join(lines[-40:]))
            time.sleep(0.25)
        healthy = time.perf_counter() - started
        deadline = time.monotonic() + 120
        while not any(START_UP_LINE.search(line) for line in lines):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("no start-up line in the banner:\n" + "".join(lines[-40:]))
            time.sleep(0.25)
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    line = next(m.group(1) for m in map(START_UP_LINE.search, lines) if m)
    phases = {name: float(seconds) for name, seconds in PHASE.findall(line.split("(total")[0])}
    # The compile's seconds by forward, where the line gives them ("; compiles: decode step 3.1 s").
    by_forward = line.split("; compiles: ")[1] if "; compiles: " in line else ""
    compiles = {
        name.strip(): float(s) for name, s in re.findall(r"([a-z ]+) ([0-9.]+) s", by_forward)
    }
    timeline = {}
    for name, pattern in MILESTONES.items():
        seconds = next(
            # strict=False: the reader may be between its two appends
            (t for t, text in zip(arrived, lines, strict=False) if pattern.search(text)),
            None,
        )
        if seconds is not None:
            timeline[name] = round(seconds, 2)
    return {
        "healthy_s": round(healthy, 2),
        "phases_s": phases,
        "compiles_s": compiles,
        "timeline_s": timeline,
        "start_up": line.strip(),
    }


def main() -> None:
    stop_on_terminate()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="a checkpoint (default: the tiny Qwen3.5)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", default="inductor", choices=["inductor", "off"])
    parser.add_argument("--max-running-prompts", type=int, default=8)
    parser.add_argument("--warm-starts", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--echo", action="store_true", help="print the server's lines as they arrive, timed"
    )
    parser.add_argument("--out", default="benchmarks/results/serve_startup.json")
    args = parser.parse_args()
    if not args.model_path:
        from areno.models.tiny import tiny_checkpoint

        args.model_path = str(tiny_checkpoint("qwen3_5"))

    cache = Path(tempfile.mkdtemp(prefix="areno-compile-cache-"))
    rows = []
    try:
        for index in range(1 + args.warm_starts):
            label = "first start (empty cache)" if index == 0 else f"start {index + 1} (warm)"
            result = start_once(args, cache, args.timeout)
            rows.append({"start": label, **result})
            print(f"{label}: healthy after {result['healthy_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    names = list(dict.fromkeys(name for row in rows for name in row["phases_s"]))
    header = f"{'start':<28}{'to /health 200':>16}" + "".join(f"{n:>10}" for n in names)
    print(header)
    for row in rows:
        cells = "".join(f"{row['phases_s'].get(n, 0.0):>9.1f}s" for n in names)
        print(f"{row['start']:<28}{row['healthy_s']:>15.1f}s{cells}")
    print(f"\n{'seconds from the command to':<28}" + "".join(f"{n:>18}" for n in MILESTONES))
    for row in rows:
        marks = row["timeline_s"]
        cells = "".join(f"{marks[n]:>15.1f}s" if n in marks else f"{'-':>16}" for n in MILESTONES)
        print(f"{row['start']:<28}{cells}")
    report = {
        "benchmark": "serve_startup",
        "model_path": args.model_path,
        "device": args.device,
        "compile": args.compile,
        "meta": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
