"""Load and soak against a live `areno serve` app: nothing dropped, memory steady (CPU, loopback).

Workload (fixed seed): the embedded tiny Gemma 4 checkpoint (text, image, audio and video) served
the way `areno serve --max-running-prompts 4` serves it (`run_server` on a local Ray instance,
bound to 127.0.0.1), driven by the official `openai` AsyncOpenAI client with retries off.
Requests mix streaming and non-streaming, and text / image (a PNG written with Pillow) / audio (a
WAV written with soundfile, sent as `input_audio`) / video (an MP4 written with PyAV); each asks
for `--max-tokens` greedy tokens.

- burst: `--requests` requests at once. Each must end answered (200, a complete answer) or
  refused with 429 / 503; a dropped connection, a timeout, a broken stream or any other status
  is a failure. Latency percentiles per modality, requests/s, counts by status, and the
  engine's queue depth (the Generator replica's `areno_engine_waiting` / `_running` gauges on
  Ray's Prometheus endpoint, and its `stats()` sampled every 0.25 s) are printed.
- soak: `--soak-concurrency` clients send requests back to back for `--soak-seconds`, while the
  resident memory of the app's processes (Serve replicas, proxy, controller) is sampled every
  `--sample-every` seconds: start / end / max and the slope (least squares) are printed.

Prints tables and writes JSON (default benchmarks/results/load.json). Exits non-zero when any
request failed.

    python benchmarks/load.py [--requests 200] [--soak-seconds 600] [--soak-concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import random
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai
import psutil
from engine_workloads import stop_on_terminate

from areno.engine.config import EngineConfig
from areno.media.samples import write_audio, write_image, write_video
from areno.models.tiny import DEFAULT_FAMILY, tiny_checkpoint
from areno.serve.app import APP_NAME, run_server
from areno.serve.config import ServeConfig

MODALITIES = ("text", "image", "audio", "video")
REFUSED = (429, 503)
MiB = 1024 * 1024


@dataclass
class Result:
    """One request's end: `outcome` is "200", "429", "503" or a failure kind."""

    modality: str
    stream: bool
    outcome: str
    latency_s: float
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.outcome not in ("200", *map(str, REFUSED))


@dataclass
class QueueSamples:
    """Queue depth of the Generator replica over a phase: from its stats() and from /metrics."""

    stats: list[tuple[float, int, int]] = field(default_factory=list)  # (t, waiting, running)
    metrics: list[tuple[float, float, float]] = field(default_factory=list)


# --- requests ----------------------------------------------------------------------------------


def write_media(root: Path) -> dict[str, str]:
    audio = write_audio(root / "tone.wav", seconds=1.0)
    return {
        "image": str(write_image(root / "image.png", 128, 96)),
        "audio_b64": base64.b64encode(audio.read_bytes()).decode(),
        "video": str(write_video(root / "clip.mp4", seconds=2.0, fps=4.0)),
    }


def content(modality: str, media: dict[str, str], i: int) -> Any:
    question = {"type": "text", "text": f"Request {i}: what is in it?"}
    if modality == "text":
        return f"Request {i}: say something short."
    if modality == "audio":
        part = {"type": "input_audio", "input_audio": {"data": media["audio_b64"], "format": "wav"}}
    else:
        part = {"type": f"{modality}_url", f"{modality}_url": {"url": media[modality]}}
    return [part, question]


async def send(
    client: openai.AsyncOpenAI,
    model: str,
    modality: str,
    stream: bool,
    media: dict[str, str],
    i: int,
    max_tokens: int,
) -> Result:
    start = time.perf_counter()
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content(modality, media, i)}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }

    def result(outcome: str, detail: str = "") -> Result:
        return Result(modality, stream, outcome, time.perf_counter() - start, detail)

    try:
        if not stream:
            response = await client.chat.completions.create(**kwargs)
            finished = response.choices[0].finish_reason is not None
            return result("200" if finished else "incomplete")
        finish = None
        chunks = await client.chat.completions.create(**kwargs, stream=True)
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return result("200" if finish else "incomplete", "stream ended without a finish")
    except openai.APIStatusError as error:
        code = error.status_code
        return result(str(code) if code in REFUSED else f"http_{code}", str(error)[:200])
    except openai.APITimeoutError as error:
        return result("timeout", str(error)[:200])
    except openai.APIConnectionError as error:
        return result("connection", str(error)[:200])
    except openai.APIError as error:  # an error event inside a started stream
        return result("stream_error", str(error)[:200])


# --- server and what is sampled from it ---------------------------------------------------------


def start_server(port: int, max_running_prompts: int) -> ServeConfig:
    """`areno serve --max-running-prompts N` on a local Ray instance (loopback only)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    config = ServeConfig(
        model_path=str(tiny_checkpoint(DEFAULT_FAMILY)),
        port=port,
        engine=EngineConfig(max_running_prompts=max_running_prompts),
    )
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    run_server(config, block=False)
    return config


def app_processes() -> dict[str, psutil.Process]:
    """The app's Serve replicas, proxy and controller: the raylet's children, by title."""
    import ray

    node = ray._private.worker._global_node
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    found = {}
    for process in raylet.children():
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        for marker in (f"ServeReplica:{APP_NAME}:", "ProxyActor", "ServeController"):
            if marker in title:
                # The title names the running method too ("ServeController.listen_for_change").
                name = title.split()[0].removeprefix("ray::").split(".")[0]
                found[f"{name}[{process.pid}]"] = process
    return found


def rss_sample(processes: dict[str, psutil.Process]) -> dict[str, int]:
    sample = {}
    for name, process in processes.items():
        try:
            sample[name] = process.memory_info().rss
        except psutil.Error:
            continue
    return sample


def metrics_url() -> str | None:
    import ray

    port = getattr(ray._private.worker._global_node, "metrics_export_port", None)
    return f"http://127.0.0.1:{port}/metrics" if port else None


def scrape_queue(url: str) -> tuple[float, float] | None:
    """areno_engine_waiting / _running summed over replicas from Ray's Prometheus endpoint."""
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return None
    values = {"waiting": 0.0, "running": 0.0}
    seen = False
    for line in text.splitlines():
        for key in values:
            if line.startswith(f"ray_areno_engine_{key}{{") or line.startswith(
                f"ray_areno_engine_{key} "
            ):
                values[key] += float(line.rsplit(" ", 1)[1])
                seen = True
    return (values["waiting"], values["running"]) if seen else None


async def sample_queue(samples: QueueSamples, stop: asyncio.Event, url: str | None) -> None:
    from ray import serve

    handle = serve.get_deployment_handle("GeneratorServer", APP_NAME)
    start, last_scrape = time.monotonic(), 0.0
    while not stop.is_set():
        now = time.monotonic()
        stats = await handle.stats.remote()
        samples.stats.append((now - start, stats["num_waiting"], stats["num_running"]))
        if url and now - last_scrape >= 2.0:
            last_scrape = now
            scraped = await asyncio.to_thread(scrape_queue, url)
            if scraped is not None:
                samples.metrics.append((now - start, *scraped))
        with contextlib.suppress(asyncio.TimeoutError):  # the sampling period elapsed
            await asyncio.wait_for(stop.wait(), timeout=0.25)


# --- phases ------------------------------------------------------------------------------------


async def burst(client, model: str, media: dict, args, rng: random.Random, url: str | None):
    plan = [(rng.choice(MODALITIES), rng.random() < 0.5) for _ in range(args.requests)]
    samples, stop = QueueSamples(), asyncio.Event()
    sampler = asyncio.create_task(sample_queue(samples, stop, url))
    start = time.perf_counter()
    results = await asyncio.gather(
        *(send(client, model, m, s, media, i, args.max_tokens) for i, (m, s) in enumerate(plan))
    )
    wall_s = time.perf_counter() - start
    stop.set()
    await sampler
    return list(results), wall_s, samples


async def soak(client, model: str, media: dict, args, rng: random.Random):
    results: list[Result] = []
    memory: list[tuple[float, dict[str, int]]] = []
    deadline = time.monotonic() + args.soak_seconds
    counter = iter(range(10**9))

    async def client_loop(seed: int) -> None:
        local = random.Random(seed)
        while time.monotonic() < deadline:
            modality, stream = local.choice(MODALITIES), local.random() < 0.5
            results.append(
                await send(client, model, modality, stream, media, next(counter), args.max_tokens)
            )

    async def memory_loop() -> None:
        start = time.monotonic()
        while True:
            memory.append((time.monotonic() - start, rss_sample(app_processes())))
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(args.sample_every, max(deadline - time.monotonic(), 0)))

    seeds = [rng.randrange(2**31) for _ in range(args.soak_concurrency)]
    await asyncio.gather(memory_loop(), *(client_loop(seed) for seed in seeds))
    return results, memory


# --- reporting ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def summarize(results: list[Result], wall_s: float) -> dict[str, Any]:
    by_modality = {}
    for modality in MODALITIES:
        mine = [r for r in results if r.modality == modality]
        answered = [r.latency_s * 1e3 for r in mine if r.outcome == "200"]
        outcomes: dict[str, int] = {}
        for r in mine:
            outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
        by_modality[modality] = {
            "requests": len(mine),
            "outcomes": outcomes,
            "p50_ms": percentile(answered, 0.5),
            "p90_ms": percentile(answered, 0.9),
            "p99_ms": percentile(answered, 0.99),
        }
    outcomes = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    failures = [asdict(r) for r in results if r.failed]
    return {
        "requests": len(results),
        "wall_s": wall_s,
        "answered_per_s": outcomes.get("200", 0) / max(wall_s, 1e-9),
        "outcomes": outcomes,
        "num_failures": len(failures),
        "failures": failures[:20],
        "by_modality": by_modality,
    }


def print_table(title: str, summary: dict[str, Any]) -> None:
    print(f"\n{title}: {summary['requests']} requests in {summary['wall_s']:.1f} s")
    header = f"{'modality':10}{'sent':>6}{'200':>6}{'429':>6}{'503':>6}{'failed':>8}"
    print(header + f"{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
    for modality, row in summary["by_modality"].items():
        o = row["outcomes"]
        failed = sum(v for k, v in o.items() if k not in ("200", "429", "503"))
        print(
            f"{modality:10}{row['requests']:>6}{o.get('200', 0):>6}{o.get('429', 0):>6}"
            f"{o.get('503', 0):>6}{failed:>8}{row['p50_ms']:>10.0f}{row['p90_ms']:>10.0f}"
            f"{row['p99_ms']:>10.0f}"
        )
    print(f"answered requests/s: {summary['answered_per_s']:.2f}; outcomes {summary['outcomes']}")
    for failure in summary["failures"]:
        print(f"  FAILED {failure['modality']} stream={failure['stream']}: {failure['outcome']}")


def queue_summary(samples: QueueSamples) -> dict[str, Any]:
    waiting = [w for _, w, _ in samples.stats]
    running = [r for _, _, r in samples.stats]
    every = max(1, len(samples.stats) // 12)
    return {
        "num_samples": len(samples.stats),
        "waiting_max": max(waiting, default=0),
        "waiting_mean": sum(waiting) / max(len(waiting), 1),
        "running_max": max(running, default=0),
        "stats_samples": [list(s) for s in samples.stats[::every]],
        "prometheus_samples": [list(s) for s in samples.metrics],
    }


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (m - mean_m) for t, m in points)
    return 60.0 * cov / var if var else 0.0


def memory_summary(memory: list[tuple[float, dict[str, int]]]) -> dict[str, Any]:
    totals = [(t, sum(sample.values()) / MiB) for t, sample in memory]
    half = totals[len(totals) // 2 :]
    return {
        "num_samples": len(totals),
        "start_mib": totals[0][1] if totals else 0.0,
        "end_mib": totals[-1][1] if totals else 0.0,
        "max_mib": max((m for _, m in totals), default=0.0),
        "slope_mib_per_min": slope_mib_per_min(totals),
        "slope_second_half_mib_per_min": slope_mib_per_min(half),
        "per_process_start_mib": {k: v / MiB for k, v in memory[0][1].items()} if memory else {},
        "per_process_end_mib": {k: v / MiB for k, v in memory[-1][1].items()} if memory else {},
        "samples": [[round(t, 1), round(m, 1)] for t, m in totals],
    }


def print_memory(summary: dict[str, Any]) -> None:
    print(
        f"app RSS (all processes): start {summary['start_mib']:.0f} MiB, end "
        f"{summary['end_mib']:.0f} MiB, max {summary['max_mib']:.0f} MiB; slope "
        f"{summary['slope_mib_per_min']:+.2f} MiB/min (second half "
        f"{summary['slope_second_half_mib_per_min']:+.2f})"
    )
    for name, start in summary["per_process_start_mib"].items():
        end = summary["per_process_end_mib"].get(name, float("nan"))
        print(f"  {name:44}{start:>8.0f} -> {end:>6.0f} MiB")


# --- main --------------------------------------------------------------------------------------


async def run_phases(args, config: ServeConfig, media: dict[str, str]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    url = metrics_url()
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{config.port}/v1",
        api_key="unused",
        max_retries=0,  # count every refusal instead of retrying it
        timeout=args.timeout,
    )
    for modality in MODALITIES:  # warm-up: first decode / encode / generate of each kind
        await send(client, config.model_name, modality, False, media, -1, args.max_tokens)
    results, wall_s, queue = await burst(client, config.model_name, media, args, rng, url)
    report = {"burst": summarize(results, wall_s) | {"queue": queue_summary(queue)}}
    print_table("burst", report["burst"])
    q = report["burst"]["queue"]
    print(
        f"queue depth (Generator stats, {q['num_samples']} samples): waiting max "
        f"{q['waiting_max']}, mean {q['waiting_mean']:.1f}; running max {q['running_max']}; "
        f"Prometheus samples (t, waiting, running): {q['prometheus_samples'][:6]}"
    )
    if args.soak_seconds > 0:
        start = time.perf_counter()
        soak_results, memory = await soak(client, config.model_name, media, args, rng)
        report["soak"] = summarize(soak_results, time.perf_counter() - start)
        report["soak"]["memory"] = memory_summary(memory)
        print_table(
            f"soak ({args.soak_concurrency} concurrent clients, {args.soak_seconds:.0f} s)",
            report["soak"],
        )
        print_memory(report["soak"]["memory"])
    await client.close()
    return report


def main() -> None:
    stop_on_terminate()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-running-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--soak-seconds", type=float, default=600.0)
    parser.add_argument("--soak-concurrency", type=int, default=8)
    parser.add_argument("--sample-every", type=float, default=5.0, help="RSS sample period, s")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/load.json")
    args = parser.parse_args()

    import ray
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        media = write_media(Path(tmp))
        try:
            config = start_server(port, args.max_running_prompts)
            report = asyncio.run(run_phases(args, config, media))
        finally:
            serve.shutdown()
            ray.shutdown()
    report["meta"] = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "model": f"tiny {DEFAULT_FAMILY}",
        "max_running_prompts": args.max_running_prompts,
        "max_queued_requests": config.queue_limit,
        "max_tokens": args.max_tokens,
        "soak_concurrency": args.soak_concurrency,
        "soak_seconds": args.soak_seconds,
        "seed": args.seed,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    failures = report["burst"]["num_failures"] + report.get("soak", {}).get("num_failures", 0)
    if failures:
        print(f"{failures} requests failed (dropped, timed out or broken)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
