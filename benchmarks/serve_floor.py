"""What Ray Serve's own hops cost on this machine: the floor under `benchmarks/serve_latency.py`.

A throwaway app with the topology of an AReno text request (HTTP -> Ingress -> one handle call to a
second deployment) whose deployments do no work: FastAPI Ingress, an echo deployment. Measured
two ways, each in a fresh Ray:
- proxy:          through Serve's HTTP proxy (how `areno serve` runs): proxy -> Ingress -> echo.
- direct-ingress: Ray Serve's experimental RAY_SERVE_ENABLE_DIRECT_INGRESS=1, the request sent to
                  the port the Ingress replica itself listens on (taken from a port range; the
                  proxy still runs beside it).
Sequential requests with one keep-alive httpx client over loopback; fixed request bodies. Prints
a table and writes JSON (default benchmarks/results/serve_floor.json).

    python benchmarks/serve_floor.py [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine_workloads import stop_on_terminate

WARM_UP = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_floor_app():
    """The echo app: FastAPI Ingress -> one handle call -> Echo. Its classes are made here, not at
    module level, so that Ray ships them by value (replicas cannot import this script)."""
    from fastapi import FastAPI
    from ray import serve

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0})  # fits beside an app holding the CPUs
    class Echo:
        async def __call__(self, body: dict) -> dict:
            return body

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Ingress:
        def __init__(self, echo):
            self.echo = echo

        @api.post("/v1/echo")
        async def echo_route(self, body: dict) -> dict:
            return await self.echo.remote(body)

    return Ingress.bind(Echo.bind())


def time_echo(url: str, num_requests: int) -> list[float]:
    """Milliseconds of `num_requests` sequential echo requests (after a warm-up)."""
    import httpx2 as httpx

    latencies = []
    with httpx.Client(timeout=30) as client:
        for i in range(WARM_UP + num_requests):
            start = time.perf_counter()
            response = client.post(url, json={"i": i, "text": "what is this?"})
            response.raise_for_status()
            if i >= WARM_UP:
                latencies.append(1000 * (time.perf_counter() - start))
    return latencies


def child(mode: str, num_requests: int) -> dict:
    """Run in a process of its own: start Ray and the app, time the requests, stop both."""
    import ray
    from ray import serve

    proxy_port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
        serve.run(build_floor_app(), name="floor", route_prefix="/")
        port = proxy_port
        if mode == "direct-ingress":
            port = int(os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
        latencies = time_echo(f"http://127.0.0.1:{port}/v1/echo", num_requests)
    finally:
        serve.shutdown()
        ray.shutdown()
    ordered = sorted(latencies)
    return {
        "p50_ms": statistics.median(ordered),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "p99_ms": ordered[int(0.99 * (len(ordered) - 1))],
    }


def main() -> None:
    stop_on_terminate()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--out", default="benchmarks/results/serve_floor.json")
    parser.add_argument("--child", choices=["proxy", "direct-ingress"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.requests)))
        return
    rows = {}
    for mode in ("proxy", "direct-ingress"):
        env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
        env.pop("RAY_ADDRESS", None)
        if mode == "direct-ingress":
            port = _free_port()
            env.update(
                RAY_SERVE_ENABLE_DIRECT_INGRESS="1",
                # NOTE: Serve refused a range of one port; the replica takes the lowest free one.
                RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(port),
                RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(port + 1),
            )
        command = [sys.executable, __file__, "--child", mode, "--requests", str(args.requests)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nServe's own hops, {args.requests} sequential requests (HTTP -> Ingress -> echo)")
    print(f"{'path':<16} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    for mode, r in rows.items():
        print(f"{mode:<16} {r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} {r['p99_ms']:>8.2f}")
    report = {
        "meta": {"machine": platform.platform(), "cpus": os.cpu_count(), "requests": args.requests},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
