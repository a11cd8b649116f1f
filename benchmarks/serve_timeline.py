"""Where a served request's time goes, hop by hop: HTTP -> Serve's proxy -> Ingress -> (with
media: MediaDecoder -> Processor) -> Generator replica -> engine -> back, for a text, an image
and a video request, beside the same request run by a `Generator` in this process.

Workload (fixed seed): one tiny checkpoint (`--family`, default Qwen3.5) or `--model-path`,
greedy, non-streamed chat requests of `--tokens` tokens (`min_tokens` = `max_tokens`), one at a
time; each request's question and media are its own (no prompt is found in the prefix cache, no
item in the decoder's cache): a 224 x 224 PNG, a 2 s, 4 fps 224 x 224 MP4, read from local
paths. The first
request of each kind to reach the new server is timed apart (`first`: what start-up left
unwarmed). The served times come from the server's own
`Server-Timing` header (areno/serve/timing.py) and the client's wall time (httpx); the
in-process engine and the served app take turns in each of `--rounds` rounds. Every figure is a
median over the requests, in milliseconds. Prints the table and writes JSON (default
benchmarks/results/serve_timeline.json).

    python benchmarks/serve_timeline.py [--family qwen3_5] [--requests 40] [--rounds 4]
    python benchmarks/serve_timeline.py --model-path CKPT --kv-cache-gib 4     # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from engine_workloads import stop_on_terminate, write_results  # noqa: E402

from areno.engine.config import EngineConfig  # noqa: E402
from areno.engine.generator import Generator  # noqa: E402
from areno.engine.sampling import SamplingParams  # noqa: E402
from areno.media import MediaDecoder, MediaPolicy  # noqa: E402
from areno.media.samples import write_image, write_video  # noqa: E402
from areno.models.tiny import tiny_checkpoint  # noqa: E402
from areno.processing import Processor  # noqa: E402
from areno.serve.timing import parse_header  # noqa: E402

KINDS = ("text", "image", "video")


class Media:
    """Request i's image or video: a file of its own in `root`, written before it is timed."""

    def __init__(self, root: str):
        self.root = root

    def path(self, kind: str, i: int) -> str:
        if kind == "image":
            return str(write_image(os.path.join(self.root, f"{i}.png"), 224, 224, seed=i))
        return str(write_video(os.path.join(self.root, f"{i}.mp4"), 2.0, 4.0, 224, 224, seed=i))


def messages(kind: str, media: Media, i: int) -> list[dict]:
    question = f"Question number {i}: what do you make of it?"
    if kind == "text":
        return [{"role": "user", "content": question}]
    part = {"type": f"{kind}_url", f"{kind}_url": {"url": media.path(kind, i)}}
    return [{"role": "user", "content": [part, {"type": "text", "text": question}]}]


class InProcess:
    """The same request run by the serving parts in this process: decode, encode, generate."""

    def __init__(self, path: str, engine: EngineConfig, tokens: int):
        import torch

        torch.set_num_threads(max(1, int(engine.num_cpus_per_rank)))  # the replica's CPUs
        self.processor = Processor(path)
        policy = MediaPolicy.for_training()
        self.decoder = MediaDecoder(policy, self.processor.decode_options())
        self.generator = Generator.from_config(path, engine)
        self.params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens)
        self.loop = asyncio.new_event_loop()

    def ask(self, kind: str, media: Media, i: int) -> dict[str, float]:
        chat = messages(kind, media, i)
        start = time.perf_counter()
        media = self.decoder.decode_many(self.processor.media_refs(chat))
        inputs = self.processor.encode(chat, media)
        encoded = time.perf_counter()
        output = self.loop.run_until_complete(self.generator.generate_all(inputs, self.params))
        done = time.perf_counter()
        assert len(output.samples[0].token_ids) == self.params.max_tokens
        timings = output.timings
        return {
            "prompt": (encoded - start) * 1e3,
            "generate": (done - encoded) * 1e3,
            "engine-queue": timings.queue_s * 1e3,
            "engine-prefill": timings.prefill_s * 1e3,
            "engine-decode": timings.decode_s * 1e3,
            "total": (done - start) * 1e3,
        }

    def close(self) -> None:
        self.generator.shutdown()
        self.loop.close()


class Served:
    """`areno serve` of the checkpoint in one Ray on loopback, asked with httpx."""

    def __init__(self, path: str, engine: EngineConfig, tokens: int, media_dir: str):
        import httpx
        import ray
        from ray import serve

        from areno.serve.app import APP_NAME, build_app
        from areno.serve.config import ServeConfig

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(
            model_path=path, port=port, engine=engine, allowed_local_media_paths=(media_dir,)
        )
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.model, self.tokens = config.model_name, tokens
        self.client = httpx.Client(timeout=600)
        # Ready as `areno serve` says it is: /health 200 (the first requests sent).
        while self.client.get(f"http://127.0.0.1:{port}/health").status_code != 200:
            time.sleep(0.1)

    def ask(self, kind: str, media: Media, i: int) -> dict[str, float]:
        body = {
            "model": self.model,
            "messages": messages(kind, media, i),
            "max_tokens": self.tokens,
            "min_tokens": self.tokens,
            "temperature": 0,
        }
        start = time.perf_counter()
        response = self.client.post(self.url, json=body)
        wall = (time.perf_counter() - start) * 1e3
        response.raise_for_status()
        assert response.json()["usage"]["completion_tokens"] == self.tokens
        timing = parse_header(response.headers["server-timing"])
        return timing | {"client": wall}

    def close(self) -> None:
        import ray
        from ray import serve

        self.client.close()
        serve.shutdown()
        ray.shutdown()


def hops(served: dict[str, float]) -> dict[str, float]:
    """The served request's rows: the header's entries and the hops between them."""
    rows = dict(served)
    rows["outside the Ingress"] = served["client"] - served["total"]
    engine = served["engine-queue"] + served["engine-prefill"] + served["engine-decode"]
    rows["generator hop"] = served["generate"] - engine
    if "prompt" in served:
        rows["media chain hops"] = (
            served["prompt"] - served["media-decode"] - served["media-process"]
        )
    return rows


ROWS = [
    ("client", "client round trip (httpx)"),
    ("outside the Ingress", "  outside the Ingress: HTTP, Serve's proxy"),
    ("total", "  Ingress, arrival to reply"),
    ("read", "    read the body from the proxy"),
    ("parse", "    parse, check, sampling parameters"),
    ("encode", "    encode the text prompt"),
    ("prompt", "    MediaDecoder + Processor chain"),
    ("media-decode", "      decode the media"),
    ("media-process", "      processor: template, pixels, placeholders"),
    ("media chain hops", "      the chain's hops"),
    ("generate", "    Generator replica call"),
    ("engine-queue", "      engine: waiting for admission"),
    ("engine-prefill", "      engine: admitted to first token"),
    ("engine-decode", "      engine: first token to last"),
    ("generator hop", "      the hop and the replica's hand-offs"),
    ("reply", "    build and record the reply"),
]


def main() -> None:
    stop_on_terminate()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5", help="the tiny checkpoint's")
    parser.add_argument("--model-path", help="a checkpoint instead of the tiny one")
    parser.add_argument("--kv-cache-gib", type=float, help="each engine's KV pool")
    parser.add_argument("--requests", type=int, default=40, help="per kind and way")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/serve_timeline.json")
    args = parser.parse_args()
    path = args.model_path or str(tiny_checkpoint(args.family))
    engine = EngineConfig(
        max_running_prompts=8, max_context_len=2048, kv_cache_gib=args.kv_cache_gib
    )
    media_dir = tempfile.mkdtemp(prefix="serve_timeline_")
    media = Media(media_dir)
    local = InProcess(path, engine, args.tokens)
    served = None
    results = {(way, kind): [] for way in ("served", "in process") for kind in KINDS}
    first = {}
    per_round = max(args.requests // args.rounds, 1)
    try:
        served = Served(path, engine, args.tokens, media_dir)
        for kind in KINDS:  # each kind's first request to the new server, then a warm-up
            first[kind] = hops(served.ask(kind, media, 200_000))
            for i in range(1, 3):
                local.ask(kind, media, 100_000 + i)
                served.ask(kind, media, 200_000 + i)
        for r in range(args.rounds):
            for kind in KINDS:
                base = (r * len(KINDS) + KINDS.index(kind)) * 2 * per_round
                for i in range(per_round):
                    results["in process", kind].append(local.ask(kind, media, base + i))
                for i in range(per_round):
                    question = base + per_round + i
                    results["served", kind].append(hops(served.ask(kind, media, question)))
    finally:
        local.close()
        if served is not None:
            served.close()
    table = {
        f"{way}, {kind}": {name: statistics.median(row[name] for row in rows) for name in rows[0]}
        for (way, kind), rows in results.items()
    }
    table |= {f"first, {kind}": first[kind] for kind in KINDS}
    model = args.model_path or f"tiny {args.family}"
    print(f"{model}, {args.tokens} tokens a reply, {args.requests} requests a kind and way, p50 ms")
    print(f"{'':48}" + "".join(f"{kind:>9}" for kind in KINDS))
    for name, label in ROWS:
        cells = [table[f"served, {kind}"].get(name) for kind in KINDS]
        if any(cell is not None for cell in cells):
            text = "".join("        -" if c is None else f"{c:>9.2f}" for c in cells)
            print(f"{label:48}{text}")
    cells = [table[f"first, {kind}"]["client"] for kind in KINDS]
    print(f"{'the first request of its kind, client':48}" + "".join(f"{c:>9.2f}" for c in cells))
    print("in process (decode, encode, generate_all in this process):")
    for name in ("total", "prompt", "generate", "engine-queue", "engine-prefill", "engine-decode"):
        cells = [table[f"in process, {kind}"][name] for kind in KINDS]
        print(f"  {name:46}" + "".join(f"{c:>9.2f}" for c in cells))
    write_results(
        args.out,
        {
            "cpus": os.cpu_count(),
            "model": model,
            "tokens": args.tokens,
            "requests": args.requests,
            "rounds": args.rounds,
        },
        table,
    )


if __name__ == "__main__":
    main()
