"""Greedy parity of linear-attention states stored in bf16 (the engine's `linear_state_dtype`).

The same random-id prompts are decoded greedily by transformers' `generate` (its own fp32
states: the reference) and by the engine once per stored state dtype (float32, bfloat16), all
at once (`--prompts` rows decoding together, as the engine serves them). For each engine run the
table gives: the prompts whose tokens equal the reference's all through, the mean and shortest
agreeing prefix, and how far the chosen tokens' logprobs part over that prefix (each prompt's
largest gap: their mean and maximum); and the same against the engine's float32 run. Random weights make greedy
decoding fragile (near-equal logits), so the float32 row is the baseline the bf16 row is read
against. Default: the small Qwen3.5 on CPU; on a GPU, `--model qwen3.5-2b` (bf16 weights,
compiled and captured as served). Fixed seed; prints a table and writes JSON (default
benchmarks/results/linear_state_parity.json).

    python benchmarks/linear_state_parity.py [--model qwen3.5-2b] [--prompts 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import load_small, random_model, write_results  # noqa: E402

from areno.engine.config import LINEAR_STATE_DTYPES, EngineConfig  # noqa: E402
from areno.engine.generator import Generator  # noqa: E402
from areno.engine.sampling import SamplingParams  # noqa: E402
from areno.processing.types import PromptInputs  # noqa: E402

Decoded = tuple[list[int], list[float]]  # a prompt's greedy tokens and their logprobs


def reference(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> list[Decoded]:
    """transformers' greedy tokens and their logprobs, never stopping early (no EOS: the engine
    ignores it too)."""
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        generation_config=config,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens_BT = out.sequences[:, prompts.shape[1] :]
    logprobs_BTV = torch.stack(out.logits, dim=1).float().log_softmax(-1)
    chosen_BT = logprobs_BTV.gather(-1, tokens_BT[..., None])[..., 0]
    return list(zip(tokens_BT.tolist(), chosen_BT.tolist(), strict=True))


def engine(
    model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, state_dtype: str, compile: str
) -> list[Decoded]:
    """The engine's greedy tokens and logprobs with linear-attention states stored as
    `state_dtype`."""
    config = EngineConfig(
        max_running_prompts=prompts.shape[0],
        max_context_len=prompts.shape[1] + new_tokens + 1,
        kv_cache_gib=1.0,
        decode_compile=compile,
        linear_state_dtype=state_dtype,
    )
    params = SamplingParams(
        temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False, logprobs=True
    )
    generator = Generator.from_model(model, None, config)

    async def run_all() -> list:
        return await asyncio.gather(
            *(generator.generate_all(PromptInputs(ids, {}), params) for ids in prompts.tolist())
        )

    try:
        samples = [out.samples[0] for out in asyncio.run(run_all())]
        return [(s.token_ids, s.logprobs) for s in samples]
    finally:
        generator.shutdown()


def agreement(have: list[Decoded], want: list[Decoded]) -> dict:
    """Prompts equal all through, the agreeing prefix's mean and least length, and how far the
    chosen tokens' logprobs part over it (the largest difference in a prompt's prefix: its mean
    and its maximum over the prompts), which near-tied random logits do not hide."""
    prefixes, gaps = [], []
    for (h, h_lp), (w, w_lp) in zip(have, want, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(h, w, strict=True)) if a != b), len(w))
        prefixes.append(same)
        pairs = zip(h_lp[:same], w_lp[:same], strict=True)
        gaps.append(max((abs(a - b) for a, b in pairs), default=0.0))
    return {
        "equal": sum(p == len(w) for p, (w, _) in zip(prefixes, want, strict=True)),
        "mean_prefix": sum(prefixes) / len(prefixes),
        "min_prefix": min(prefixes),
        "mean_max_logprob_gap": sum(gaps) / len(gaps),
        "max_logprob_gap": max(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small", choices=["small", "qwen3.5-2b"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "off", "inductor"],
        help="the decode step's compile (the recurrence is the same kernel either way)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/linear_state_parity.json")
    args = parser.parse_args()
    on_cuda = args.model != "small"
    device, dtype = ("cuda", torch.bfloat16) if on_cuda else ("cpu", torch.float32)
    torch.manual_seed(args.seed)
    if on_cuda:
        model = random_model(args.model, device, dtype)
    else:
        model = load_small("qwen3_5", device, dtype)[0]
    vocab = model.config.get_text_config().vocab_size
    high = vocab if on_cuda else min(vocab, 400)  # the small checkpoint: ids its tokenizer knows
    prompts = torch.randint(10, high, (args.prompts, args.prompt_len)).to(device)
    with torch.inference_mode():
        want = reference(model, prompts, args.new_tokens)
    runs = {
        name: engine(model, prompts, args.new_tokens, name, args.compile)
        for name in LINEAR_STATE_DTYPES
    }
    rows = []
    for name, tokens in runs.items():
        rows.append({"state": name, "against": "transformers", **agreement(tokens, want)})
    against_fp32 = agreement(runs["bfloat16"], runs["float32"])
    rows.append({"state": "bfloat16", "against": "engine float32", **against_fp32})
    print(
        f"\n{args.model} on {device}: {args.prompts} prompts of {args.prompt_len} random ids, "
        f"{args.new_tokens} greedy tokens, decoded together"
    )
    print(
        f"{'state':<10} {'against':<16} {'equal':>7} {'mean prefix':>12} {'least':>6} "
        f"{'logprob gap: mean':>18} {'max':>8}"
    )
    for row in rows:
        print(
            f"{row['state']:<10} {row['against']:<16} {row['equal']:>3}/{args.prompts:<3} "
            f"{row['mean_prefix']:>12.1f} {row['min_prefix']:>6} "
            f"{row['mean_max_logprob_gap']:>18.4f} {row['max_logprob_gap']:>8.4f}"
        )
    write_results(args.out, vars(args), {"rows": rows})


if __name__ == "__main__":
    main()
