"""LoRA against full-parameter training: trainer memory and step time, the bytes and seconds of
one weight sync, and the engine's decode speed with an adapter against the base model.

GPU, bf16, random weights in a real model's shape (default the Qwen3.5-2B hybrid), fixed seed:
- train step: one forward + backward + AdamW step over `--batch` sequences of `--seq-len`
  random tokens (next-token cross-entropy), the model in bf16 and the optimizer's states in
  the parameters' dtype (DeepSpeed's mixed precision adds fp32 master weights and states, 12
  bytes per trained parameter, to the full run only). Peak memory is the device's allocation
  peak over the step; its time the median of `--repeats` after one warm-up step.
- weight sync: what the trainer sends after a step (every trained parameter, or only the
  adapters' factors), copied to host memory, then loaded into a running engine in this
  process (`Generator.update_weights`; Ray's object store between them is left out).
- decode: `--requests` requests of `--prompt-len` random tokens x `--max-tokens` output
  tokens (EOS ignored), `--concurrency` in flight, greedy: the base engine (no LoRA slots),
  and an engine with one rank-`--rank` adapter slot running base requests and adapter
  requests.

    python benchmarks/lora.py [--model qwen3.5-2b] [--rank 16] [--concurrency 64]

Prints a table and writes JSON (default benchmarks/results/lora_gpu.json).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import torch
from engine_throughput import _TimedRunCompiles
from engine_workloads import make_random_id_workload, random_model, synchronize, write_results

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.kv.block_manager import blocks_for
from areno.engine.layers.lora import POLICY_ADAPTER
from areno.engine.parallel.kv_pool import pool_gib
from areno.engine.sampling import SamplingParams
from areno.train.lora import LoraConfig, apply_lora, policy_adapter
from areno.train.weight_sync import host_copies, trainable_named

SEED = 0


def train_step(model: torch.nn.Module, batch: int, seq_len: int, repeats: int) -> dict:
    """Peak memory and median time of a training step over the model's trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), device="cuda", generator=gen)
    model.train()

    def step() -> None:
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: the optimizer's states are created here
    synchronize(torch.device("cuda"))
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        synchronize(torch.device("cuda"))
        times.append(time.perf_counter() - start)
    model.eval()
    return {
        "trained_params": sum(p.numel() for p in params),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "step_s": statistics.median(times),
    }


def engine_config(model: torch.nn.Module, requests: list[dict], concurrency: int, **extra):
    max_len = max(r["prompt_inputs"].num_prompt_tokens + r["max_tokens"] for r in requests)
    return EngineConfig(
        max_running_prompts=concurrency,
        max_context_len=max_len + 1,
        kv_cache_gib=pool_gib(model, concurrency * blocks_for(max_len + 1, 16)),
        **extra,
    )


def run(generator: Generator, requests: list[dict], adapter: str | None) -> list:
    def params(r: dict) -> SamplingParams:
        return SamplingParams(
            temperature=0,
            max_tokens=r["max_tokens"],
            ignore_eos=True,
            detokenize=False,
            adapter=adapter,
        )

    async def run_all() -> list:
        return await asyncio.gather(
            *(generator.generate_all(r["prompt_inputs"], params(r)) for r in requests)
        )

    return asyncio.run(run_all())


def decode(generator: Generator, requests: list[dict], concurrency: int, adapter: str | None):
    run(generator, [dict(r, max_tokens=2) for r in requests[:concurrency]], adapter)  # warm-up
    asyncio.run(generator.reset_prefix_cache())  # the timed prompts prefill whole
    synchronize(torch.device("cuda"))
    compiles = _TimedRunCompiles(generator.core.executor.runner)
    start = time.perf_counter()
    outputs = run(generator, requests, adapter)
    synchronize(torch.device("cuda"))
    wall_s = time.perf_counter() - start
    tokens = sum(len(out.samples[0].token_ids) for out in outputs)
    return {
        "output_tokens": tokens,
        "wall_s": wall_s,
        "tok_s": tokens / wall_s,
        **compiles.report(),
    }


def sync_seconds(generator: Generator, payload, version: int) -> float:
    start = time.perf_counter()
    asyncio.run(generator.update_weights(payload, version))
    synchronize(torch.device("cuda"))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3.5-2b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--train-only", action="store_true", help="the trainer's step alone (no sync, no decode)"
    )
    parser.add_argument("--out", default="benchmarks/results/lora_gpu.json")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank)
    results: dict = {}

    # --- the trainer's step ---------------------------------------------------------------
    full = random_model(args.model, "cuda", torch.bfloat16)
    results["train_full"] = train_step(full, args.batch, args.seq_len, args.repeats)
    del full
    torch.cuda.empty_cache()
    adapted = apply_lora(random_model(args.model, "cuda", torch.bfloat16), lora)
    with torch.no_grad():  # PEFT starts B at zero; a trained adapter's is not
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.02)
    results["train_lora"] = train_step(adapted, args.batch, args.seq_len, args.repeats)
    if args.train_only:
        _print_train(args, results)
        write_results(args.out, _meta(args, lora), results)
        return

    # --- one weight sync into a running engine --------------------------------------------
    start = time.perf_counter()
    lora_payload = policy_adapter(adapted, host_copies(trainable_named(adapted)))
    lora_host_s = time.perf_counter() - start
    del adapted
    torch.cuda.empty_cache()
    model = random_model(args.model, "cuda", torch.bfloat16)
    vocab = model.config.get_text_config().vocab_size
    requests = make_random_id_workload(SEED, args.requests, args.prompt_len, args.max_tokens, vocab)

    base = Generator.from_model(model, None, engine_config(model, requests, args.concurrency))
    try:
        start = time.perf_counter()  # every parameter trains in the full run (no towers here)
        on_device = list(host_copies(trainable_named(model)).items())
        full_host_s = time.perf_counter() - start
        results["sync_full"] = {
            "bytes": sum(t.numel() * t.element_size() for _, t in on_device),
            "host_copy_s": full_host_s,
            "load_s": sync_seconds(base, dict(on_device), 1),
        }
        results["decode_base"] = decode(base, requests, args.concurrency, None)
    finally:
        base.shutdown()
    config = engine_config(model, requests, args.concurrency, max_loras=1, max_lora_rank=args.rank)
    slots = Generator.from_model(model, None, config)
    try:
        results["sync_lora"] = {
            "bytes": sum(
                a.numel() * a.element_size() + b.numel() * b.element_size()
                for a, b in lora_payload.factors.values()
            ),
            "host_copy_s": lora_host_s,
            "load_s": sync_seconds(slots, lora_payload, 1),
        }
        # the adapter loaded, requests naming none run the base through the low-rank path
        slots.core.executor.default_adapter = None
        results["decode_lora_engine_base"] = decode(slots, requests, args.concurrency, None)
        results["decode_lora_engine_adapter"] = decode(
            slots, requests, args.concurrency, POLICY_ADAPTER
        )
    finally:
        slots.shutdown()

    _print_train(args, results)
    print(f"\n{'':24} {'MB sent':>10} {'host copy s':>12} {'engine load s':>14}")
    for key in ("sync_full", "sync_lora"):
        r = results[key]
        print(f"{key:24} {r['bytes'] / 1e6:>10.1f} {r['host_copy_s']:>12.3f} {r['load_s']:>14.3f}")
    print(
        f"\n{'decode (concurrency ' + str(args.concurrency) + ')':24} {'tok/s':>10} {'compiled':>9}"
    )
    for key in ("decode_base", "decode_lora_engine_base", "decode_lora_engine_adapter"):
        r = results[key]
        print(f"{key:24} {r['tok_s']:>10.0f} {str(r.get('decode_compiled')):>9}")
    write_results(args.out, _meta(args, lora), results)


def _meta(args, lora: LoraConfig) -> dict:
    meta = {"seed": SEED, "lora": dataclasses.asdict(lora)}
    return meta | {k: v for k, v in vars(args).items() if k != "out"}


def _print_train(args, results: dict) -> None:
    print(f"\n{args.model}, bf16, LoRA rank {args.rank} on every language-model linear layer")
    print(f"train step, {args.batch} x {args.seq_len} tokens")
    print(f"{'':24} {'trained params':>15} {'peak GiB':>9} {'step s':>8}")
    for key in ("train_full", "train_lora"):
        r = results[key]
        print(f"{key:24} {r['trained_params']:>15,} {r['peak_gib']:>9.2f} {r['step_s']:>8.3f}")


if __name__ == "__main__":
    main()
