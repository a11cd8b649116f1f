"""What the sampler costs a step: the engine's `sample` against an earlier tree's, in one run.

A batch of --rows rows over a --vocab vocabulary (Qwen3's 151,936 by default), random logits of
a fixed seed, each configuration timed as the median of --repeats calls (after two warm-ups,
the device synchronized around each call), for both samplers on the same logits:
- greedy:            every row greedy (both take the argmax alone).
- sampled:           temperature 1, no seeds.
- seeded:            temperature 1, every row with a seed of its own: a GRPO rollout's rows.
- seeded, top-p 0.9: the same, filtered.
- seeded, top-k 20, top-p 0.8: filtered as Qwen's model cards advise.
- seeded, min-p 0.05: filtered by min-p alone.

"before" is `areno/engine/sample/sampler.py` at --before (a git revision; default: the last
commit whose sampler drew a seeded row's noise from a torch generator of its own), loaded
beside this tree's package. Such a sampler takes one generator a row (created once, as the
engine kept them) and races exponential noise; "now" (and a --before that takes keys) takes
each row's key (`row_keys`, counted in the time) and, on CPU, inverts the row's cumulative sum
at the key's uniform number, on a GPU races the tokens with noise hashed from it
(`areno/engine/kernels/race.py`). The logits are standard normal times --logit-scale: at 3 a
152k-token row's best 1,024 tokens hold about 0.7 of its mass (flatter than a trained model's),
at 8 nearly all.

    python benchmarks/sampler_step.py [--device cuda] [--rows 1 64 256] [--logit-scale 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine_workloads import synchronize, write_results

from areno.engine.sample import sampler as now
from areno.engine.sampling import SamplingParams

SEED = 0
BEFORE = "177295f"
CONFIGS = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "sampled": lambda i: SamplingParams(temperature=1.0),
    "seeded": lambda i: SamplingParams(temperature=1.0, seed=1000 + i),
    "seeded, top-p 0.9": lambda i: SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i),
    "seeded, top-k 20, top-p 0.8": lambda i: SamplingParams(
        temperature=1.0, top_k=20, top_p=0.8, seed=1000 + i
    ),
    "seeded, min-p 0.05": lambda i: SamplingParams(temperature=1.0, min_p=0.05, seed=1000 + i),
}


def load_before(revision: str, directory: Path):
    """The sampler module at `revision` (or in the file of that name), imported under another
    name (its imports resolve to this tree's package)."""
    if Path(revision).is_file():
        return _import(Path(revision))
    source = subprocess.run(
        ["git", "show", f"{revision}:areno/engine/sample/sampler.py"],
        check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
    ).stdout  # fmt: skip
    path = directory / "sampler_before.py"
    path.write_text(source)
    return _import(path)


def _import(path: Path):
    spec = importlib.util.spec_from_file_location("sampler_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def timed(call, device: torch.device, repeats: int) -> float:
    """The median milliseconds of `call()` over `repeats` calls, after two warm-ups."""
    times = []
    for i in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(
    before, rows: int, vocab: int, config: str, device: torch.device, repeats: int, scale: float
) -> dict:
    params = [CONFIGS[config](i) for i in range(rows)]
    generator = torch.Generator(device=device).manual_seed(SEED)
    logits_BV = torch.randn(rows, vocab, generator=generator, device=device) * scale
    seeds = [p.seed for p in params]
    draws = iter(range(10**9))

    tensors_now = now.SamplingTensors.from_params(params, device)

    def call_now():
        keys_B = None
        if not tensors_now.all_greedy:
            keys_B = now.row_keys(seeds, [next(draws)] * rows, device)
        now.sample(logits_BV, tensors_now, keys_B)

    tensors_before = before.SamplingTensors.from_params(params, device)
    if hasattr(before, "row_keys"):  # a sampler that takes keys, as now

        def call_before():
            keys_B = None
            if not tensors_before.all_greedy:
                keys_B = before.row_keys(seeds, [next(draws)] * rows, device)
            before.sample(logits_BV, tensors_before, keys_B)

    else:
        generators = [
            None if p.seed is None or p.is_greedy else before.generator_for(p.seed, device)
            for p in params
        ]

        def call_before():
            before.sample(logits_BV, tensors_before, generators)

    return {
        "before_ms": timed(call_before, device, repeats),
        "now_ms": timed(call_now, device, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 128])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--logit-scale", type=float, default=3.0)
    parser.add_argument("--before", default=BEFORE, help="a git revision, or a sampler.py")
    parser.add_argument("--out", default="benchmarks/results/sampler_step.json")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as directory:
        before = load_before(args.before, Path(directory))
        results = []
        print(f"{'rows':>5} {'config':<28} {'before ms':>10} {'now ms':>8} {'speed-up':>8}")
        for rows in args.rows:
            for config in args.configs:
                row = {"rows": rows, "config": config}
                row |= measure(
                    before, rows, args.vocab, config, device, args.repeats, args.logit_scale
                )
                row["speedup"] = row["before_ms"] / row["now_ms"]
                results.append(row)
                print(
                    f"{rows:>5} {config:<28} {row['before_ms']:>10.3f} {row['now_ms']:>8.3f}"
                    f" {row['speedup']:>7.2f}x"
                )
    meta = {
        "vocab": args.vocab,
        "repeats": args.repeats,
        "before": args.before,
        "seed": SEED,
        "logit_scale": args.logit_scale,
    }
    write_results(args.out, meta, {"results": results})


if __name__ == "__main__":
    main()
