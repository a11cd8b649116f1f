"""AReno's GPU paths in one call: engine throughput, `areno serve` per modality, a GRPO run's step
split, and tensor parallelism. Prints one table per part and writes JSON.

Parts (`--parts`, default all that the visible GPUs allow):
- engine: `benchmarks/engine_throughput.py --workload gpu` (engine vs HF static, % of roofline).
- serve:  for each of `--families`, a random checkpoint of `areno make-tiny --size SIZE` served by
          `areno serve` (a subprocess, loopback), text and each of the family's modalities sent
          `--requests` times one at a time with the `openai` client: latency p50 / p90.
- grpo:   `areno train` on configs/color_quiz.yaml for `--steps` steps with the trainer (DeepSpeed)
          and the rollout generator sharing one GPU (0.5 GPU each): per-step rollout / reward /
          train / weight-sync seconds from the run's metrics.jsonl.
- tp:     (2+ GPUs) a Qwen3-8B-shaped model (hidden 4096, 36 layers, 32 heads, 8 kv heads, vocab
          151936; Qwen3.5 modules, all full attention) at TP=1 and TP=2: greedy tokens of the same
          prompts compared, and decode throughput at concurrency 64.

Every process it starts is stopped; traffic stays on 127.0.0.1.

    python benchmarks/gpu_e2e.py                                   # on the GPU machine
    python benchmarks/gpu_e2e.py --device cpu --size tiny --parts serve grpo --steps 1  # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from engine_workloads import stop_on_terminate

REPO = Path(__file__).resolve().parent.parent
PARTS = ("engine", "serve", "grpo", "tp")
SERVER_START_TIMEOUT_S = 900  # a 2B checkpoint loads and compiles its decode step first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, check=True, **kwargs)


def _checkpoint(family: str, size: str, root: Path) -> Path:
    out = root / f"{family}-{size}"
    if not (out / "config.json").is_file():
        _python("-m", "areno.cli", "make-tiny", str(out), "--family", family, "--size", size)
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --- engine ----------------------------------------------------------------------------------------


def run_engine(args: argparse.Namespace, work: Path) -> dict:
    out = work / "engine.json"
    _python(
        "benchmarks/engine_throughput.py",
        "--workload",
        "gpu",
        "--skip-hf-dynamic",
        "--out",
        str(out),
    )
    report = json.loads(out.read_text())
    rows = [
        {"model": m["model"], **{k: r[k] for k in ("system", "tok_s", "pct_roofline")}}
        | {"vs_hf_static": r["vs_hf_static"]}
        for m in report["models"]
        for r in m["rows"]
    ]
    print("\nengine (256 requests x 256 prompt x 128 output, concurrency 64)")
    print(f"{'model':<12} {'system':<10} {'tok/s':>9} {'vs HF static':>12} {'% roofline':>10}")
    for r in rows:
        print(
            f"{r['model']:<12} {r['system']:<10} {r['tok_s']:>9.0f} {r['vs_hf_static']:>12.2f} "
            f"{r['pct_roofline']:>10.1f}"
        )
    return {"rows": rows}


# --- serve -----------------------------------------------------------------------------------------


class Server:
    """`areno serve` in a subprocess of its own process group; stopped like Ctrl-C."""

    def __init__(self, model_path: Path, device: str, log: Path, decode_compile: str = "auto"):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # a Ray of its own, stopped with it
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "areno.cli",
                "serve",
                "--model-path",
                str(model_path),
                "--port",
                str(self.port),
                "--device",
                device,
                "--max-running-prompts",
                "8",
                "--max-context-len",
                "4096",
                "--decode-compile",
                decode_compile,
            ],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"areno serve exited with {self.proc.returncode}; see its log")
            try:
                # /health answers 200 once the engine has started (loaded, compiled, warmed up).
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"areno serve was not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def _media(work: Path) -> dict[str, str]:
    from areno.media.samples import write_audio, write_image, write_video

    return {
        "image": str(write_image(work / "cat.png", 448, 336)),
        "audio": str(write_audio(work / "tone.wav", seconds=2.0)),
        "video": str(write_video(work / "clip.mp4", seconds=2.0, fps=4.0)),
    }


def _message(modality: str, media: dict[str, str]) -> list[dict]:
    text = {"type": "text", "text": "Describe what you perceive in one sentence."}
    if modality == "text":
        return [{"role": "user", "content": text["text"]}]
    part = {"type": f"{modality}_url", f"{modality}_url": {"url": media[modality]}}
    return [{"role": "user", "content": [part, text]}]


def run_serve(args: argparse.Namespace, work: Path) -> dict:
    from openai import OpenAI

    from areno.models import adapter_for_checkpoint

    media = _media(work)
    rows = []
    for family in args.families:
        path = _checkpoint(family, args.size, work)
        modalities = ["text", *sorted(adapter_for_checkpoint(path).modalities)]
        server = Server(path, args.device, work / f"serve-{family}.log", args.serve_compile)
        try:
            ready_s = server.wait_ready(SERVER_START_TIMEOUT_S)
            client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            for modality in modalities:
                latencies, prompt_tokens = [], 0
                for _ in range(args.requests + 1):  # the first one is timed apart (warm-up)
                    start = time.perf_counter()
                    reply = client.chat.completions.create(
                        model=model,
                        messages=_message(modality, media),
                        max_tokens=16,
                        temperature=0,
                        timeout=300,
                    )
                    latencies.append(1000 * (time.perf_counter() - start))
                    prompt_tokens = reply.usage.prompt_tokens
                rows.append(
                    {
                        "family": family,
                        "modality": modality,
                        "prompt_tokens": prompt_tokens,
                        "first_ms": latencies[0],  # what the first user of the path waits
                        "p50_ms": statistics.median(latencies[1:]),
                        "p90_ms": _percentile(latencies[1:], 0.9),
                        "ready_s": ready_s,
                    }
                )
                print(f"  serve: {rows[-1]}", flush=True)  # a later family may not finish
        finally:
            server.stop()
    print(f"\nserve ({args.size} checkpoints, 16 output tokens, one request at a time)")
    print(
        f"{'family':<12} {'modality':<8} {'prompt tok':>10} {'ready s':>8} {'first ms':>9} "
        f"{'p50 ms':>8} {'p90 ms':>8}"
    )
    for r in rows:
        print(
            f"{r['family']:<12} {r['modality']:<8} {r['prompt_tokens']:>10} {r['ready_s']:>8.1f} "
            f"{r['first_ms']:>9.1f} {r['p50_ms']:>8.1f} {r['p90_ms']:>8.1f}"
        )
    return {"rows": rows}


# --- grpo ------------------------------------------------------------------------------------------


def run_grpo(args: argparse.Namespace, work: Path) -> dict:
    """One `areno train` run per `--weight-sync` transport, same seed and steps."""
    runs = {}
    for transport in args.weight_sync:
        runs[transport] = _grpo_run(args, work, transport)
    keys = ("rollout_s", "idle_s", "reward_s", "train_s", "weight_sync_s", "step_s")
    print(f"\ngrpo (qwen3_5 {args.size}, color quiz, {args.steps} steps; step 1 includes warm-up)")
    print(f"{'weight sync':<13} {'step':>4} " + " ".join(f"{k:>14}" for k in keys))
    for transport, run in runs.items():
        for r in run["steps"]:
            values = " ".join(f"{r.get(k) or float('nan'):>14.2f}" for k in keys)
            print(f"{transport:<13} {r.get('step', '?'):>4} {values}")
    return runs


def _grpo_run(args: argparse.Namespace, work: Path, transport: str) -> dict:
    from areno.train.metrics import read_metrics

    path = _checkpoint("qwen3_5", args.size, work)
    run_dir = work / f"grpo-run-{transport}"
    overrides = [f"trainer.weight_sync={transport}"]
    if args.rollout_compile != "auto":
        overrides += [
            f"rollout.engine.decode_compile={args.rollout_compile}",
            f"rollout.engine.prefill_compile={args.rollout_compile}",
        ]
    if args.device == "cuda":
        overrides += [
            "trainer.use_gpu=true",
            "trainer.num_gpus_per_worker=0.5",
            "rollout.num_gpus_per_worker=0.5",
        ]
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    start = time.perf_counter()
    _python(
        "-m",
        "areno.cli",
        "train",
        "--config",
        "configs/color_quiz.yaml",
        "--model-path",
        str(path),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(args.steps),
        "--eval-every",
        "0",
        "--save-every",
        "0",
        "--no-progress",
        "--set",
        "run.export_hf=false",
        *(arg for o in overrides for arg in ("--set", o)),
        env=env,
    )
    wall_s = time.perf_counter() - start
    steps = [r for r in read_metrics(run_dir) if "step_s" in r]
    # every phase's seconds and token counts the run records, for the step's timeline
    kept = [
        {k: v for k, v in r.items() if k == "step" or k.endswith(("_s", "tokens"))} for r in steps
    ]
    return {"wall_s": wall_s, "steps": kept}


# --- tp --------------------------------------------------------------------------------------------


def build_8b(work: Path) -> Path:
    """A Qwen3-8B-shaped Qwen3.5 checkpoint (all full attention), random bf16 weights made on the
    GPU, with the tiny Qwen3.5 tokenizer and processor."""
    import torch
    import transformers as tf

    out = work / "qwen3_5-8b-shaped"
    if (out / "config.json").is_file():
        return out
    tiny = _checkpoint("qwen3_5", "tiny", work)
    config = tf.AutoConfig.from_pretrained(tiny)
    text = config.text_config
    for name, value in {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "layer_types": ["full_attention"] * 36,
    }.items():
        setattr(text, name, value)
    config.vision_config.out_hidden_size = 4096
    with torch.device("cuda"):
        model = tf.AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tf.AutoProcessor.from_pretrained(tiny).save_pretrained(out)
    for name in ("generation_config.json",):
        if (tiny / name).is_file():
            (out / name).write_text((tiny / name).read_text())
    del model
    torch.cuda.empty_cache()
    return out


def run_tp(args: argparse.Namespace, work: Path) -> dict:
    import asyncio

    import ray
    import torch

    from areno.engine.config import EngineConfig
    from areno.engine.generator import Generator
    from areno.engine.sampling import SamplingParams
    from areno.processing.types import PromptInputs

    began = time.perf_counter()

    def progress(what: str) -> None:  # the 8B part takes minutes: say where they go
        print(f"  tp: {what} at {time.perf_counter() - began:.0f} s", flush=True)

    path = build_8b(work)
    progress("8B-shaped checkpoint ready")
    torch.manual_seed(0)
    prompts = [torch.randint(10, 2000, (128,)).tolist() for _ in range(64)]
    results = {}
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        for tp in (1, 2):
            config = EngineConfig(
                tp_size=tp,
                max_running_prompts=64,
                max_context_len=512,
                decode_compile=args.tp_compile,
            )
            generator = Generator.from_config(path, config)
            progress(f"TP={tp} engine up (loaded, decode warmed)")
            greedy = SamplingParams(
                temperature=0, max_tokens=192, ignore_eos=True, detokenize=False
            )

            async def run_all(batch, params, generator=generator):
                return await asyncio.gather(
                    *(generator.generate_all(PromptInputs(p, {}), params) for p in batch)
                )

            try:
                asyncio.run(run_all(prompts, dataclasses.replace(greedy, max_tokens=2)))
                torch.cuda.synchronize()
                start = time.perf_counter()
                outputs = asyncio.run(run_all(prompts, greedy))
                torch.cuda.synchronize()
                wall_s = time.perf_counter() - start
                progress(f"TP={tp} timed run done ({wall_s:.1f} s)")
            finally:
                generator.shutdown()
            tokens = [out.samples[0].token_ids for out in outputs]
            results[tp] = {"tok_s": sum(map(len, tokens)) / wall_s, "tokens": tokens}
    finally:
        ray.shutdown()
    pairs = list(zip(results[1]["tokens"], results[2]["tokens"], strict=True))
    same = sum(a == b for a, b in pairs)
    # Random bf16 weights give nearly flat logits: a different reduction order flips a near-tie
    # and the rest of the output follows, so the common prefix says more than equality.
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in pairs
    ]
    print("\ntp (Qwen3-8B shape, 64 requests x 128 prompt x 192 output, concurrency 64)")
    print(f"TP=1 {results[1]['tok_s']:.0f} tok/s, TP=2 {results[2]['tok_s']:.0f} tok/s")
    print(
        f"greedy outputs equal for {same} of {len(prompts)} requests; first token equal for "
        f"{sum(p > 0 for p in prefix)}; mean common prefix {statistics.mean(prefix):.1f} tokens"
    )
    return {
        "tp1_tok_s": results[1]["tok_s"],
        "tp2_tok_s": results[2]["tok_s"],
        "equal_outputs": same,
        "common_prefix": prefix,
        "requests": len(prompts),
    }


# --- main ------------------------------------------------------------------------------------------


def main() -> None:
    stop_on_terminate()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", nargs="+", choices=PARTS)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default="2b", choices=["tiny", "small", "2b"])
    parser.add_argument("--families", nargs="+", default=["qwen3_5", "gemma4"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--weight-sync",
        nargs="+",
        default=["auto"],
        choices=["auto", "object_store", "cuda_ipc"],
        help="grpo: one run per transport (trainer.weight_sync)",
    )
    compile_modes = ["auto", "off", "inductor"]  # what `areno serve --decode-compile` takes
    parser.add_argument(
        "--tp-compile",
        default="auto",
        choices=compile_modes,
        help="decode_compile of both tp engines ('off' skips two 8B compiles: minutes)",
    )
    parser.add_argument(
        "--serve-compile",
        default="auto",
        choices=compile_modes,
        help="areno serve --decode-compile for the serve part",
    )
    parser.add_argument(
        "--rollout-compile",
        default="auto",
        choices=compile_modes,
        help="grpo: the rollout engine's decode and prefill compile (off: a cold start "
        "without compiling, to time the trainer's steps)",
    )
    parser.add_argument("--work-dir", help="keeps checkpoints between runs (default: a temp dir)")
    parser.add_argument("--out", default="benchmarks/results/gpu_e2e.json")
    args = parser.parse_args()
    num_gpus = 0
    if args.device == "cuda":
        import torch

        num_gpus = torch.cuda.device_count()
    parts = args.parts or [p for p in PARTS if p != "tp" or num_gpus >= 2]
    runners = {"engine": run_engine, "serve": run_serve, "grpo": run_grpo, "tp": run_tp}
    report: dict[str, Any] = {"device": args.device, "num_gpus": num_gpus, "size": args.size}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp).resolve()  # Ray workers run elsewhere
        work.mkdir(parents=True, exist_ok=True)
        for part in parts:
            start = time.perf_counter()
            try:
                report[part] = runners[part](args, work)
            except (subprocess.CalledProcessError, RuntimeError, TimeoutError) as error:
                # One part failing must not hide the others' numbers; it is reported, not skipped.
                print(f"\n{part}: FAILED: {error}", flush=True)
                report[part] = {"failed": str(error)}
            report[part]["part_s"] = time.perf_counter() - start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
