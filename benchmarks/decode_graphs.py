"""What the decode step's CUDA graphs cost as they accumulate: device memory and capture time.

A `ModelRunner` of --model's shape (random bf16 weights, --rows slots of --max-len tokens) decodes
once in every (row bucket, key-length bucket) pair, so that each pair captures its graph, as a
long-running server's steps eventually do. Reports the graphs captured, the device memory PyTorch
reserves and allocates beyond what it held before the first capture, that memory per graph, and
the mean capture time (the first decode of a new bucket, in which every decoding request
waits). Two systems, one after the other in one process:
- own-logits (the baseline): each graph's logits are its own output, allocated in the graphs'
  pool and held as long as the graph;
- shared-logits (the engine): every graph writes its logits into rows of one buffer.
Both decode the same steps; their last logits must be equal. The decode step runs uncompiled
unless --compile names a backend (the engine's default on CUDA is inductor; its compile takes
minutes for these shapes). Prints a table, writes JSON.

    python benchmarks/decode_graphs.py --model qwen3.5-2b --max-len 2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import random_model, write_results  # noqa: E402

from areno.engine.runner.cuda_graphs import KV_BUCKET, DecodeGraphs  # noqa: E402
from areno.engine.runner.model_runner import ModelRunner  # noqa: E402
from areno.processing.types import PromptInputs  # noqa: E402

_MIB = 1 << 20


class OwnLogitsGraphs(DecodeGraphs):
    """The baseline: each captured graph returns logits of its own (the buffer is ignored)."""

    def _forward(self, rows: int, kv_len: int, into: torch.Tensor | None = None) -> torch.Tensor:
        return super()._forward(rows, kv_len)


SYSTEMS = {"own-logits": OwnLogitsGraphs, "shared-logits": DecodeGraphs}


def capture_every_bucket(runner: ModelRunner) -> tuple[dict, torch.Tensor]:
    """Decode once per (rows, key length) bucket through the runner's graphs; memory and time as
    they grow, and the last step's logits."""
    graphs = runner.graphs
    torch.cuda.synchronize()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    times = []
    for kv_len in range(KV_BUCKET, runner.max_len + 1, KV_BUCKET):
        for rows in graphs.buckets:
            began = time.perf_counter()
            with torch.inference_mode():
                logits = graphs.decode(list(range(rows)), [kv_len - 1] * rows, [0] * rows)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
    num_graphs = graphs.num_captured
    grown_reserved = (torch.cuda.memory_reserved() - reserved) / _MIB
    grown_allocated = (torch.cuda.memory_allocated() - allocated) / _MIB
    result = {
        "graphs": num_graphs,
        "reserved_mib": grown_reserved,
        "allocated_mib": grown_allocated,
        "allocated_mib_per_graph": grown_allocated / max(num_graphs, 1),
        "capture_ms_mean": statistics.mean(times) * 1e3,
        "capture_ms_max": max(times) * 1e3,
    }
    return result, logits.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3.5-2b", choices=["qwen3-1.7b", "qwen3.5-2b"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--compile", default="off")
    parser.add_argument("--out", default="benchmarks/results/decode_graphs_gpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = random_model(args.model, "cuda", torch.bfloat16)
    vocab = model.config.get_text_config().vocab_size
    results, last_logits = {}, {}
    for name, graphs_class in SYSTEMS.items():
        runner = ModelRunner(model, num_slots=args.rows, max_len=args.max_len, graphs="off")
        runner.graphs = graphs_class(
            runner,
            max_rows=args.rows,
            capture=True,
            compile_backend=None if args.compile == "off" else args.compile,
        )
        runner.prefill(PromptInputs([0], {}), [0])  # allocates the cache
        results[name], last_logits[name] = capture_every_bucket(runner)
        del runner
        torch.cuda.empty_cache()
    same = torch.equal(*last_logits.values())
    print(
        f"\n{args.model}, {args.rows} rows x {args.max_len} tokens, vocab {vocab}, "
        f"compile {args.compile}; last logits equal: {same}"
    )
    print(
        f"{'system':<14} {'graphs':>6} {'reserved MiB':>13} {'allocated MiB':>14} "
        f"{'MiB/graph':>10} {'capture ms':>11}"
    )
    for name, r in results.items():
        print(
            f"{name:<14} {r['graphs']:>6} {r['reserved_mib']:>13.0f} {r['allocated_mib']:>14.0f} "
            f"{r['allocated_mib_per_graph']:>10.1f} {r['capture_ms_mean']:>11.1f}"
        )
    meta = {"model": args.model, "rows": args.rows, "max_len": args.max_len, "vocab": vocab}
    meta["compile"] = args.compile
    write_results(args.out, meta, {"results": results, "last_logits_equal": same})


if __name__ == "__main__":
    main()
