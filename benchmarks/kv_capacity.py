"""How many requests run at once in a fixed amount of KV memory: the paged pool against the slot
cache it replaced, for the Qwen3.5-2B hybrid shape (bf16; 6 full-attention layers of 24 keep keys
and values, 2 KV heads of dim 256).

The memory is what the slot cache took for 64 slots of 8,192 tokens (`--max-running-prompts 64
--max-context-len 8192`): every slot reserved its whole context in every full-attention layer,
so that memory ran 64 requests whatever their length. The paged pool of the same bytes is handed
to the engine's own scheduler (areno/engine/core/scheduler.py: its block manager, admission and
preemption, no model) with `--max-context-len 8192` and a running cap high enough not to bind;
requests of 512 tokens (448 prompt + 64 output, EOS ignored) arrive all at once, and every step
each running sequence gets its token, as the engine appends them. The row reports the most that
ran at once, the steps, and the preemptions.

The linear-attention layers' conv and recurrent states are per running sequence in both designs
(not KV); their bytes at the measured concurrency are reported beside, from the model's config.
A third row spends the slot cache's whole memory, states included, on a running cap
(`--max-running-prompts`) and the pool beside it, as a deployment of this shape would.

    python benchmarks/kv_capacity.py [--requests 2048] [--prompt-tokens 448 --output-tokens 64]
"""

from __future__ import annotations

import argparse
import math

import torch
from engine_workloads import linear_state_bytes, random_model, write_results

from areno.engine.core.scheduler import Scheduler, SchedulerConfig
from areno.engine.kv.block_manager import blocks_for
from areno.engine.parallel.kv_pool import block_bytes
from areno.engine.sampling import SamplingParams
from areno.engine.sequence import SequenceGroup

GIB = 1 << 30


def run_paged(num_blocks: int, args: argparse.Namespace, max_running: int | None = None) -> dict:
    """The scheduler over `num_blocks` blocks, at most `max_running` sequences at once (None: no
    cap); requests all arrive at once (module docstring)."""
    config = SchedulerConfig(
        max_running_prompts=max_running or args.requests,
        max_context_len=args.max_context_len,
        max_num_batched_tokens=1 << 30,
        num_blocks=num_blocks,
        block_size=args.block_size,
    )
    scheduler = Scheduler(config)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    prompt = [7] * args.prompt_tokens
    for i in range(args.requests):
        scheduler.add(SequenceGroup.create(f"r{i}", prompt, params))
    peak = steps = 0
    while scheduler.has_work:
        out = scheduler.schedule()
        steps += 1
        peak = max(peak, out.num_running)
        finished = []
        for seq in [s for item in out.prefill for s in item.seqs] + out.decode:
            seq.append_token(0)
            if seq.num_output_tokens >= args.output_tokens:
                seq.finish("length")
                finished.append(seq)
        scheduler.update(finished)
    return {"max_running": peak, "steps": steps, "preemptions": scheduler.num_preemptions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=64, help="the slot cache's slots")
    parser.add_argument("--max-context-len", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--prompt-tokens", type=int, default=448)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/kv_capacity.json")
    args = parser.parse_args()

    model = random_model("qwen3.5-2b", "meta", torch.bfloat16)  # shapes only
    config = model.config.get_text_config()
    per_block = block_bytes(model, config.layer_types, args.block_size)
    per_token = per_block // args.block_size
    memory = args.slots * args.max_context_len * per_token
    num_blocks = memory // per_block
    request_tokens = args.prompt_tokens + args.output_tokens

    slot = {"max_running": args.slots, "steps": None, "preemptions": 0}  # by construction
    paged = run_paged(num_blocks, args)
    state = linear_state_bytes(config)
    # The same memory counting the linear-attention states too: --max-running-prompts R
    # allocates R states, and the pool gets the rest; R as large as leaves each a request's blocks.
    total = memory + args.slots * state
    request_bytes = blocks_for(request_tokens, args.block_size) * per_block
    running = total // (state + request_bytes)
    with_states = run_paged((total - running * state) // per_block, args, max_running=running)
    rows = [
        {"design": "slot cache (before)", **slot},
        {"design": "paged, same KV memory", **paged},
        {"design": "paged, same KV + states", **with_states},
    ]
    for row in rows:
        row["vs_slot_cache"] = row["max_running"] / args.slots
        row["linear_state_gib"] = row["max_running"] * state / GIB
    print(
        f"Qwen3.5-2B shape, bf16: {per_token} KV bytes a token; KV memory "
        f"{memory / GIB:.2f} GiB ({args.slots} slots x {args.max_context_len} tokens = "
        f"{num_blocks} blocks); {args.requests} requests of {request_tokens} tokens "
        f"({blocks_for(request_tokens, args.block_size)} blocks each)"
    )
    print(
        f"{'design':<26} {'at once':>8} {'x slots':>8} {'steps':>7} {'preempt':>8} {'states GiB':>11}"
    )
    for row in rows:
        steps = "-" if row["steps"] is None else str(row["steps"])
        print(
            f"{row['design']:<26} {row['max_running']:>8} {row['vs_slot_cache']:>8.1f} "
            f"{steps:>7} {row['preemptions']:>8} {row['linear_state_gib']:>11.2f}"
        )
    meta = {
        "model": "qwen3.5-2b",
        "dtype": "bfloat16",
        "kv_bytes_per_token": per_token,
        "kv_memory_gib": memory / GIB,
        "num_blocks": num_blocks,
        "requests": args.requests,
        "request_tokens": request_tokens,
        "ideal_max_running": math.floor(num_blocks / blocks_for(request_tokens, args.block_size)),
        "linear_state_bytes_per_seq": state,
    }
    write_results(args.out, meta, {"rows": rows})


if __name__ == "__main__":
    main()
