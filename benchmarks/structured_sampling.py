"""What grammar rows and penalties cost a decode step: a batch of 64 with 16 such rows vs none.

Rows (one run, fixed seed, every request arrives at once; random prompt ids of --prompt-len):
- free:              64 free rows (the engine's default overlap of steps).
- free, no overlap:  64 free rows, steps not overlapped (what any grammar row costs the batch:
                     a matcher must see each token before it masks the next).
- grammar 16:        48 free rows + 16 rows under a JSON schema (an object with one string of at
                     least 100k characters, so the rows stay grammar-bound to the end).
- penalties 16:      48 free rows + 16 with frequency, presence and repetition penalties.
- logit_bias 16:     48 free rows + 16 with a 50-token logit_bias.

Decode step time is measured as the difference of two runs, --short and --long new tokens per
request (EOS ignored; grammar rows end only at max_tokens), divided by the extra steps, so the
prefill and start-up cancel out; the median of --repeats such pairs.

The vocabulary: no real tokenizer can be downloaded here, so the model and the grammar run over a
synthetic byte-level vocabulary of 151,936 entries (Qwen3's size: every byte, 60k byte pairs, the
rest random 3-9 letter words), which sizes the mask and its per-token work like a real one.
Models: --device cpu: a small random Qwen3 (hidden 256, 4 layers), fp32; cuda: random bf16 in
Qwen3-1.7B's shapes.

    python benchmarks/structured_sampling.py --device cpu
    python benchmarks/structured_sampling.py --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch
from engine_workloads import make_random_id_workload, random_model, synchronize, write_results

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams, StructuredOutput

SEED = 0
VOCAB_SIZE = 151936
# A string too long to end within the run: the rows stay grammar-bound to max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 100000}},
    "required": ["text"],
}


def synthetic_tokenizer(num_tokens: int = 151643):
    """A byte-level tokenizer of `num_tokens` entries plus an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for a in alphabet:
        vocab.setdefault(a, len(vocab))
    for a in alphabet:
        for b in alphabet:
            if len(vocab) < 60000:
                vocab.setdefault(a + b, len(vocab))
    letters = "abcdefghijklmnopqrstuvwxyz\u0120"
    while len(vocab) < num_tokens:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 9)))
        vocab.setdefault(word, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def build_model(device: str) -> torch.nn.Module:
    if device == "cuda":
        return random_model("qwen3-1.7b", device, torch.bfloat16)
    import transformers as tf

    torch.manual_seed(SEED)
    config = tf.Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    )
    return tf.Qwen3ForCausalLM(config).eval()


def special_params(kind: str, max_tokens: int) -> SamplingParams:
    base = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    if kind == "grammar":
        return SamplingParams(
            **base, structured=StructuredOutput("json_schema", json.dumps(SCHEMA))
        )
    if kind == "penalties":
        return SamplingParams(
            **base, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1
        )
    if kind == "logit_bias":
        return SamplingParams(**base, logit_bias={t: 1.0 for t in range(1000, 1050)})
    return SamplingParams(**base)


async def _timed_batch(gen: Generator, prompts: list, params: list[SamplingParams]) -> float:
    await gen.pause("keep")
    tasks = [
        asyncio.create_task(gen.generate_all(x, p)) for x, p in zip(prompts, params, strict=True)
    ]
    while gen.stats()["num_waiting"] < len(prompts) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.001)
    start = time.perf_counter()
    await gen.resume()
    outputs = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    assert all(len(o.samples[0].token_ids) == params[0].max_tokens for o in outputs)
    # The mask held on this device (what follows may be partial UTF-8 of random byte tokens).
    for output, p in zip(outputs, params, strict=True):
        text = gen.core.tokenizer.decode(output.samples[0].token_ids)
        assert p.structured is None or text.startswith('{"text":'), text[:40]
    return elapsed


def measure(
    gen, device, prompts, kind: str, num_special: int, short: int, long: int, repeats: int
) -> dict:
    """The median over `repeats` of the decode step time from a long and a short run."""

    def run(max_tokens: int) -> float:
        params = [special_params("free", max_tokens)] * (len(prompts) - num_special)
        params += [special_params(kind, max_tokens)] * num_special
        synchronize(device)
        return asyncio.run(_timed_batch(gen, prompts, params))

    run(short)  # warm-up: compiles this row's grammar, allocates penalty counts
    steps_ms = sorted(1e3 * (run(long) - run(short)) / (long - short) for _ in range(repeats))
    step_ms = steps_ms[len(steps_ms) // 2]
    return {
        "step_ms": step_ms,
        "step_ms_runs": steps_ms,
        "decode_tok_s": len(prompts) / step_ms * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--special-rows", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=None, help="default: 136 cuda, 40 cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    long = args.long or (136 if device.type == "cuda" else 40)
    out = args.out or f"benchmarks/results/structured_sampling_{device.type}.json"

    tokenizer = synthetic_tokenizer()
    model = build_model(args.device)
    prompts = [
        r["prompt_inputs"]
        for r in make_random_id_workload(SEED, args.batch, args.prompt_len, 1, VOCAB_SIZE)
    ]
    max_len = args.prompt_len + long + 8
    rows = [
        ("free", "auto", "free", 0),
        ("free, no overlap", "off", "free", 0),
        (f"grammar {args.special_rows}", "auto", "grammar", args.special_rows),
        (f"penalties {args.special_rows}", "auto", "penalties", args.special_rows),
        (f"logit_bias {args.special_rows}", "auto", "logit_bias", args.special_rows),
    ]
    results = {}
    generators: dict[str, Generator] = {}
    try:
        for name, overlap, kind, num_special in rows:
            if overlap not in generators:
                # Both engines live at once: a fixed pool each, not most of the GPU.
                config = EngineConfig(
                    max_running_prompts=args.batch,
                    max_context_len=max_len,
                    overlap_steps=overlap,
                    kv_cache_gib=4 if device.type == "cuda" else None,
                )
                generators[overlap] = Generator.from_model(model, tokenizer, config)
            gen = generators[overlap]
            results[name] = measure(
                gen, device, prompts, kind, num_special, args.short, long, args.repeats
            )
            print(f"{name:20} {results[name]['step_ms']:8.2f} ms/step", flush=True)
    finally:
        for gen in generators.values():
            gen.shutdown()

    free = results["free"]["step_ms"]
    print(f"\n{device.type}, batch {args.batch}, vocabulary {VOCAB_SIZE}")
    print(f"{'rows':20} {'ms/step':>9} {'tok/s':>9} {'vs free':>8}")
    for name, r in results.items():
        print(
            f"{name:20} {r['step_ms']:>9.2f} {r['decode_tok_s']:>9.0f} {r['step_ms'] / free:>7.2f}x"
        )
    meta = {"seed": SEED, "vocab_size": VOCAB_SIZE, "long": long} | {
        k: v for k, v in vars(args).items() if k not in ("out", "long")
    }
    write_results(out, meta, results)


if __name__ == "__main__":
    main()
