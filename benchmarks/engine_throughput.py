"""Generation throughput: AReno's engine vs Hugging Face `generate` on the same requests.

Workloads (fixed seed, requests in arrival order):
- cpu: 64 chat requests, encoded prompts of 32-256 tokens (template and image placeholders
       included; random corpus words fill the rest), a quarter carry one image of 64-320 px sides,
       max_tokens 16-128, EOS allowed, concurrency 16. Model: the ~30 M `areno make-tiny --size
       small` checkpoint of --family (default qwen3_5), fp32.
- gpu: 256 requests x 256 random prompt token ids x exactly 128 output tokens (EOS ignored), text
       only, concurrency 64. Models: random bf16 weights in the shapes of Qwen3-1.7B and
       Qwen3.5-2B (3 linear : 1 full attention layers), built in memory on CUDA.
Systems:
- engine:     AReno's engine with `concurrency` requests in flight (see `run_engine`).
- hf-static / hf-dynamic: `model.generate`, greedy, on left-padded batches of `concurrency`
              requests with a static / dynamic KV cache; each batch generates up to its largest
              max_tokens. Image requests share the padded batch with text ones: the per-token media
              tensors are left-padded like the ids, the rest concatenated along the item axis.
Output tokens are useful tokens only: a request counts min(max_tokens, tokens up to and including
its first EOS), never batch padding. The roofline assumes decode reads every weight once per step:
concurrency * copy bandwidth / weight bytes tokens/s. The byte floor is the whole run's least
time (`engine_workloads.ByteFloor`): every decode step reads the weights, the cached keys and
values and the linear-attention states, every prompt costs its parameter FLOPs at the measured
matrix-product rate; `% floor` is each row's share of it. Prints a table per model and
concurrency and writes JSON (default benchmarks/results/engine_throughput_<workload>.json).

    python benchmarks/engine_throughput.py --workload cpu [--family gemma4] [--threads 1]
    python benchmarks/engine_throughput.py --workload gpu [--model qwen3-1.7b qwen3.5-2b]
    python benchmarks/engine_throughput.py --workload gpu --model qwen3-8b --concurrency 64 256

`--decode-compile`, `--cpu-linear`, `--kernels` (the engine's Triton kernels or their PyTorch
references, `areno/engine/kernels/`), `--overlap-steps`, `--prefill-compile`,
`--fuse-projections` and `--one-row-gemv` (the `EngineConfig` fields of those names) each take
several values, giving one engine row per combination.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import time
from typing import Any

import torch
from engine_workloads import (
    MODELS,
    ByteFloor,
    GcPauses,
    copy_bandwidth_gb_s,
    load_small,
    make_random_id_workload,
    make_workload,
    matmul_tflops,
    random_model,
    synchronize,
    weight_bytes,
    write_results,
)
from hf_baseline import run_hf_generate
from torch._dynamo.utils import counters as dynamo_counters

from areno.engine.config import COMPILE_MODES, EngineConfig
from areno.engine.generator import Generator
from areno.engine.kernels import references_only
from areno.engine.kv.block_manager import blocks_for
from areno.engine.parallel.kv_pool import pool_gib
from areno.engine.sampling import SamplingParams
from areno.media import MediaDecoder, MediaPolicy
from areno.models.tiny import TINY_FAMILIES

# The engine's on/off options (auto: on CUDA) a run takes several values of, one row each.
SWITCHES = (
    "overlap_steps",
    "fuse_projections",
    "one_row_gemv",
    "pad_lone_prefills",
    "whole_prompts_as_parts",
)

WORKLOADS = {
    "cpu": {
        "num_requests": 64,
        "prompt_len_range": (32, 256),
        "max_tokens_range": (16, 128),
        "image_fraction": 0.25,
        "concurrency": 16,
        "models": ["small"],
        "device": "cpu",
        "dtype": "float32",
    },
    "gpu": {
        "num_requests": 256,
        "prompt_len": 256,
        "max_tokens": 128,
        "concurrency": 64,
        "models": ["qwen3-1.7b", "qwen3.5-2b"],
        "device": "cuda",
        "dtype": "bfloat16",
    },
}


# --- AReno engine ---------------------------------------------------------------------------------


def run_requests(generator: Generator, requests: list[dict]) -> list:
    """All `requests` submitted at once, greedy, token ids only; their merged outputs."""

    def params(r: dict) -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"], detokenize=False
        )

    async def run_all() -> list:
        return await asyncio.gather(
            *(generator.generate_all(r["prompt_inputs"], params(r)) for r in requests)
        )

    return asyncio.run(run_all())


def run_engine(
    model: torch.nn.Module,
    tokenizer: Any,
    requests: list[dict],
    concurrency: int,
    decode_compile: str = "auto",
    packed_linear: bool = True,
    triton_kernels: bool = True,
    max_context_len: str = "auto",
    **switches: str,
) -> dict:
    """AReno's engine on the same requests: all submitted at once in arrival order, at most
    `concurrency` decoding (the engine's cache slots), greedy, token ids only (no detokenizing,
    as `generate` does none). Useful tokens are counted like `run_hf_generate`: the engine stops
    a request at its first EOS (unless `ignore_eos`) or at max_tokens. The warm-up (where a
    compiled decode step compiles) is timed separately. `triton_kernels=False` runs the engine's
    PyTorch references instead of its Triton kernels (which run on CUDA only).
    `max_context_len`: the engine's ("auto": the longest request's, plus one). `switches`: the
    engine's on/off options by name (`SWITCHES`, `prefill_compile`), each "auto" unless given."""
    max_len = max(r["prompt_inputs"].num_prompt_tokens + r["max_tokens"] for r in requests)
    context = max_len + 1 if max_context_len == "auto" else int(max_context_len)
    config = EngineConfig(
        max_running_prompts=concurrency,
        max_context_len=context,
        # The KV pool holds every running request's whole context (what one slot each held
        # before paging), not a share of the device: HF's runs follow in this process.
        # (and one whole longest context, which the engine checks it can hold).
        kv_cache_gib=pool_gib(
            model, max(concurrency * blocks_for(max_len + 1, 16), blocks_for(context, 16))
        ),
        decode_compile=decode_compile,
        cpu_packed_linear=packed_linear,
        **switches,
    )
    with contextlib.nullcontext() if triton_kernels else references_only():
        return _run_engine(model, tokenizer, requests, concurrency, config)


def _run_engine(model, tokenizer, requests, concurrency, config: EngineConfig) -> dict:
    start = time.perf_counter()  # construction included: a compiled decode compiles there
    generator = Generator.from_model(model, tokenizer, config)
    try:
        run_requests(generator, [dict(r, max_tokens=2) for r in requests[:concurrency]])  # warm-up
        # NOTE: else the timed run's first prompts start from the warm-up's cached blocks, and
        # such prompts prefill one at a time (HF, beside it, recomputes them all).
        asyncio.run(generator.reset_prefix_cache())
        synchronize(model.device)
        warmup_s = time.perf_counter() - start
        runner = generator.core.executor.runner
        phases = PhaseTimes(runner)
        compiles = _TimedRunCompiles(runner)
        with GcPauses() as pauses:
            start = time.perf_counter()
            outputs = run_requests(generator, requests)
            synchronize(model.device)
            wall_s = time.perf_counter() - start
        timed_compiles = compiles.report()  # before the shutdown releases the graphs
    finally:
        generator.shutdown()
    num_tokens = sum(len(out.samples[0].token_ids) for out in outputs)
    return {
        "output_tokens": num_tokens,
        "wall_s": wall_s,
        "tok_s": num_tokens / wall_s,
        "warmup_s": warmup_s,
        **timed_compiles,
        **phases.report(),
        **pauses.report(),
    }


class _TimedRunCompiles:
    """What the timed run compiled or captured after the warm-up (each costs its time inside the
    window), and whether the compiled decode step stayed compiled: a row's speed is only its
    engine's when these are small."""

    def __init__(self, runner: Any):
        self.graphs = runner.graphs
        self.dynamo_graphs = dynamo_counters["stats"]["unique_graphs"]
        self.captures = self.graphs.num_captured if self.graphs is not None else 0

    def report(self) -> dict:
        if self.graphs is None:
            return {}
        return {
            "decode_compiled": self.graphs.compiled,
            "timed_dynamo_graphs": dynamo_counters["stats"]["unique_graphs"] - self.dynamo_graphs,
            "timed_graph_captures": self.graphs.num_captured - self.captures,
        }


class PhaseTimes:
    """Where the timed run's seconds went: the runner's prefill and decode forwards, timed on the
    host around each call (CPU only: on CUDA the host returns before the device finishes)."""

    def __init__(self, runner: Any):
        self.timed = runner.device.type == "cpu"
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.calls = {"prefill": 0, "decode": 0}
        if self.timed:
            for name, phase in (
                ("prefill", "prefill"),
                ("prefill_batch", "prefill"),
                ("decode", "decode"),
            ):
                setattr(runner, name, self._timed(getattr(runner, name), phase))

    def _timed(self, fn: Any, phase: str) -> Any:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                self.calls[phase] += 1

        return call

    def report(self) -> dict:
        if not self.timed:
            return {}
        return {
            "prefill_s": self.seconds["prefill"],
            "prefill_calls": self.calls["prefill"],
            "decode_s": self.seconds["decode"],
            "decode_steps": self.calls["decode"],
        }


# --- roofline and report --------------------------------------------------------------------------


def run_model(name: str, args: argparse.Namespace, bandwidth_gb_s: float, tflops: float) -> list:
    """All systems on one model at each of `args.concurrency`; one report (rows, roofline, byte
    floor) per concurrency."""
    workload = WORKLOADS[args.workload]
    dtype = getattr(torch, args.dtype)
    tokenizer = None
    if name == "small":
        model, processor = load_small(args.family, args.device, dtype)
        tokenizer = processor.tokenizer
        decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
        requests = make_workload(
            args.seed,
            args.num_requests,
            workload["prompt_len_range"],
            workload["max_tokens_range"],
            workload["image_fraction"],
            processor,
            decoder,
        )
    else:
        model = random_model(name, args.device, dtype)
        vocab_size = model.config.get_text_config().vocab_size
        requests = make_random_id_workload(
            args.seed, args.num_requests, workload["prompt_len"], workload["max_tokens"], vocab_size
        )
    floor = ByteFloor(model, bandwidth_gb_s, tflops)
    prompt_tokens = [r["prompt_inputs"].num_prompt_tokens for r in requests]
    reports = []
    for concurrency in args.concurrency:
        rows = run_systems(model, tokenizer, requests, concurrency, args)
        roofline = concurrency * bandwidth_gb_s * 1e9 / weight_bytes(model)
        run_floor = floor.run(requests, concurrency)
        _add_ratios(rows, roofline, run_floor["floor_tok_s"])
        reports.append(
            {
                "model": name if name != "small" else f"{args.family}-small",
                "concurrency": concurrency,
                "num_params": sum(p.numel() for p in model.parameters()),
                "weight_bytes": weight_bytes(model),
                "roofline_tok_s": roofline,
                "decode_read_bytes": floor.weight_bytes,
                "kv_bytes_per_token": floor.kv_bytes_per_token,
                "linear_state_bytes_per_seq": floor.state_bytes_per_seq,
                **run_floor,
                "num_image_requests": sum(bool(r["prompt_inputs"].mm_spans) for r in requests),
                "mean_prompt_tokens": statistics.mean(prompt_tokens),
                "rows": rows,
            }
        )
    return reports


def run_systems(model, tokenizer, requests: list[dict], concurrency: int, args) -> list[dict]:
    """HF's baselines, then one engine row per combination of the engine options given several
    values (a row is named by those values), at `concurrency`."""
    systems = {}
    caches = [] if args.skip_hf else ["static"] if args.skip_hf_dynamic else ["static", "dynamic"]
    for cache in caches:
        systems[f"hf-{cache}"] = lambda c=cache: run_hf_generate(model, requests, concurrency, c)
    # NOTE: the engine runs last: its runner routes the model's linear-attention layers through
    # the engine's own kernels inside its forwards, and the baseline must be transformers' code.
    options = {
        "decode_compile": args.decode_compile,
        "cpu_linear": args.cpu_linear,
        "kernels": args.kernels,
        "prefill_compile": args.prefill_compile,
        "max_context_len": args.max_context_len,
        **{name: getattr(args, name) for name in SWITCHES},
    }
    labels = {
        "overlap_steps": "overlap-",
        "prefill_compile": "prefill-",
        "fuse_projections": "fuse-",
        "max_context_len": "ctx-",
        "one_row_gemv": "gemv-",
        "pad_lone_prefills": "pad-lone-",
        "whole_prompts_as_parts": "whole-as-parts-",
    }
    for values in itertools.product(*options.values()):
        chosen = dict(zip(options, values, strict=True))
        system = "engine" + "".join(
            f"-{labels.get(name, '')}{chosen[name]}" for name in options if len(options[name]) > 1
        )
        systems[system] = lambda c=chosen: run_engine(
            model,
            tokenizer,
            requests,
            concurrency,
            c["decode_compile"],
            c["cpu_linear"] == "packed",
            c["kernels"] == "triton",
            c["max_context_len"],
            prefill_compile=c["prefill_compile"],
            **{name: c[name] for name in SWITCHES},
        )
    rows = []
    for system, run in systems.items():
        result = run()
        warmup = f" (warm-up {result['warmup_s']:.1f} s)" if "warmup_s" in result else ""
        if "decode_compiled" in result:
            warmup += (
                f" [compiled {result['decode_compiled']}, in the timed run:"
                f" {result['timed_dynamo_graphs']} compiles,"
                f" {result['timed_graph_captures']} graph captures]"
            )
        print(f"{system} @ {concurrency}: {result['tok_s']:.1f} tok/s{warmup}", flush=True)
        rows.append({"system": system, "requests": len(requests), **result})
    return rows


def _add_ratios(rows: list[dict], roofline_tok_s: float, floor_tok_s: float) -> None:
    base = next((r["tok_s"] for r in rows if r["system"] == "hf-static"), None)
    for r in rows:
        r["vs_hf_static"] = r["tok_s"] / base if base else None
        r["pct_roofline"] = 100 * r["tok_s"] / roofline_tok_s
        r["pct_floor"] = 100 * r["tok_s"] / floor_tok_s


def print_report(report: dict, bandwidth_gb_s: float, tflops: float) -> None:
    print(
        f"\n{report['model']} at concurrency {report['concurrency']}: "
        f"{report['num_params'] / 1e6:.1f} M params, {report['weight_bytes'] / 1e6:.1f} MB "
        f"weights, {bandwidth_gb_s:.1f} GB/s copy, {tflops:.1f} TFLOP/s, roofline "
        f"{report['roofline_tok_s']:.0f} tok/s, mean prompt {report['mean_prompt_tokens']:.0f} "
        f"tokens, {report['num_image_requests']} with an image"
    )
    print(
        f"byte floor {report['floor_tok_s']:.0f} tok/s: decode {report['floor_decode_s']:.2f} s"
        f" ({report['decode_read_bytes'] / 1e9:.2f} GB weights a step, "
        f"{report['kv_bytes_per_token'] / 1e3:.1f} KB KV a token, "
        f"{report['linear_state_bytes_per_seq'] / 1e6:.1f} MB states a sequence), "
        f"prefill {report['floor_prefill_s']:.2f} s"
    )
    header = (
        f"{'system':<16} {'requests':>8} {'output tok':>10} {'wall s':>8} {'tok/s':>9} "
        f"{'vs HF static':>12} {'% roofline':>10} {'% floor':>8} {'max gc ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in report["rows"]:
        ratio = f"{r['vs_hf_static']:.2f}" if r["vs_hf_static"] else "-"
        print(
            f"{r['system']:<16} {r['requests']:>8} {r['output_tokens']:>10} {r['wall_s']:>8.1f} "
            f"{r['tok_s']:>9.1f} {ratio:>12} {r['pct_roofline']:>10.1f} "
            f"{r['pct_floor']:>8.1f} {r['gc_max_pause_ms']:>9.1f}"
        )
    for r in report["rows"]:
        if "prefill_s" in r:  # the engine's own split (CPU)
            print(
                f"{r['system']}: prefill {r['prefill_s']:.1f} s in {r['prefill_calls']} forwards,"
                f" decode {r['decode_s']:.1f} s in {r['decode_steps']} steps "
                f"({1e3 * r['decode_s'] / max(r['decode_steps'], 1):.1f} ms/step), the rest "
                f"{r['wall_s'] - r['prefill_s'] - r['decode_s']:.1f} s"
            )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=WORKLOADS, default="cpu")
    parser.add_argument("--model", nargs="+", choices=MODELS, help="default: the workload's")
    parser.add_argument("--family", choices=TINY_FAMILIES, default="qwen3_5")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: the workload's")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int)
    parser.add_argument(
        "--concurrency", type=int, nargs="+", help="one table per value (default: the workload's)"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--skip-hf-dynamic", action="store_true")
    parser.add_argument("--skip-hf", action="store_true", help="the engine's rows alone")
    parser.add_argument(
        "--decode-compile",
        nargs="+",
        choices=COMPILE_MODES,
        default=["auto"],
        help="the engine's decode_compile; several give one engine row each",
    )
    parser.add_argument(
        "--cpu-linear",
        nargs="+",
        choices=["packed", "aten"],
        default=["packed"],
        help="the engine's linear layers on CPU (cpu_packed_linear); several give one row each",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=["triton", "torch"],
        default=["triton"],
        help="the engine's CUDA kernels, or their PyTorch references; several give one row each",
    )
    parser.add_argument(
        "--prefill-compile",
        nargs="+",
        choices=COMPILE_MODES,
        default=["auto"],
        help="EngineConfig.prefill_compile (auto: as the decode); several give one row each",
    )
    for switch in SWITCHES:
        parser.add_argument(
            "--" + switch.replace("_", "-"),
            nargs="+",
            choices=["auto", "on", "off"],
            default=["auto"],
            help=f"EngineConfig.{switch} (auto: on CUDA); several give one row each",
        )
    parser.add_argument(
        "--max-context-len",
        nargs="+",
        default=["auto"],
        help="the engine's max_context_len (auto: the longest request's); several give one "
        "row each (a server's longer context pads every captured decode step to it)",
    )
    parser.add_argument(
        "--out", help="default: benchmarks/results/engine_throughput_<workload>.json"
    )
    args = parser.parse_args()
    defaults = WORKLOADS[args.workload]
    args.model = args.model or defaults["models"]
    args.device = args.device or defaults["device"]
    args.dtype = args.dtype or defaults["dtype"]
    args.num_requests = args.num_requests or defaults["num_requests"]
    args.concurrency = args.concurrency or [defaults["concurrency"]]
    args.out = args.out or f"benchmarks/results/engine_throughput_{args.workload}.json"
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth_gb_s(device, (1 << 30) if device.type == "cuda" else (256 << 20))
    tflops = matmul_tflops(device, getattr(torch, args.dtype))
    reports = [report for name in args.model for report in run_model(name, args, bandwidth, tflops)]
    for report in reports:
        print_report(report, bandwidth, tflops)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "workload": args.workload,
        "seed": args.seed,
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "dtype": args.dtype,
        "copy_bandwidth_gb_s": bandwidth,
        "matmul_tflops": tflops,
    }
    write_results(args.out, meta, {"models": reports})


if __name__ == "__main__":
    main()
