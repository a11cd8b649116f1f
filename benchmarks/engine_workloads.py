"""What the engine benchmarks share: their requests (encoded chat prompts, random token ids), their
models (random weights in real models' shapes, the `make-tiny --size small` checkpoints), the
device copy bandwidth and matrix-product rate behind every roofline, the byte floor of a decode
step and of a whole run, and how results are written.
"""

from __future__ import annotations

import gc
import json
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from areno.media import MediaDecoder
from areno.media.samples import write_image
from areno.models.tiny import tiny_checkpoint
from areno.models.tiny.corpus import corpus
from areno.processing import Processor, PromptInputs, process_messages

MODELS = ("small", "qwen3-1.7b", "qwen3.5-2b", "qwen3-8b")
_FIT_ROUNDS = 4  # encode / adjust rounds to bring a prompt to its target token count


# --- workloads ------------------------------------------------------------------------------------


def _messages(words: list[str], image: Path | None) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": " ".join(words)}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": str(image)}})
    return [{"role": "user", "content": content}]


def _fit_prompt(
    processor: Processor,
    decoder: MediaDecoder,
    rng: random.Random,
    pool: list[str],
    target: int,
    image: Path | None,
) -> PromptInputs:
    """Random words, as many as bring the encoded prompt close to `target` tokens.

    The template and image placeholders count too, so a prompt can exceed a small target.
    """
    words = rng.choices(pool, k=1)
    inputs = process_messages(processor, decoder, _messages(words, image))
    base = inputs.num_prompt_tokens  # template + image + one word
    tokens_per_word = 1.5  # a first guess for the small BPE vocab, measured after one round
    for _ in range(_FIT_ROUNDS):
        missing = target - inputs.num_prompt_tokens
        num_words = max(1, len(words) + round(missing / tokens_per_word))
        if num_words == len(words):
            break
        words = words[:num_words] + rng.choices(pool, k=max(0, num_words - len(words)))
        inputs = process_messages(processor, decoder, _messages(words, image))
        if len(words) > 1:
            tokens_per_word = max(0.5, (inputs.num_prompt_tokens - base) / (len(words) - 1))
    return inputs


def make_workload(
    seed: int,
    num_requests: int,
    prompt_len_range: tuple[int, int],
    max_tokens_range: tuple[int, int],
    image_fraction: float,
    processor: Processor,
    decoder: MediaDecoder,
) -> list[dict]:
    """Chat requests: {"prompt_inputs": PromptInputs, "max_tokens": int, "ignore_eos": False}."""
    rng = random.Random(seed)
    pool = sorted({w for line in corpus(num_lines=300, seed=seed) for w in line.split()})
    with_image = set(rng.sample(range(num_requests), round(num_requests * image_fraction)))
    requests = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(num_requests):
            image = None
            if i in with_image:
                w, h = rng.randint(64, 320), rng.randint(64, 320)
                image = write_image(Path(tmp) / f"{i}.png", w, h, seed=seed + i)
            target = rng.randint(*prompt_len_range)
            inputs = _fit_prompt(processor, decoder, rng, pool, target, image)
            max_tokens = rng.randint(*max_tokens_range)
            requests.append(
                {"prompt_inputs": inputs, "max_tokens": max_tokens, "ignore_eos": False}
            )
    return requests


def make_random_id_workload(
    seed: int, num_requests: int, prompt_len: int, max_tokens: int, vocab_size: int
) -> list[dict]:
    """Text-only requests of random token ids that must generate exactly `max_tokens`."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_requests, prompt_len), generator=gen)
    return [
        {
            "prompt_inputs": PromptInputs(input_ids=row, mm_inputs={}),
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        for row in ids.tolist()
    ]


# --- models ---------------------------------------------------------------------------------------

# The Qwen3 shapes (vocab 151,936, head dim 128) by what sets them apart.
QWEN3_SHAPES = {
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
}


def random_model(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights in a real model's shapes, initialized directly on `device`."""
    import transformers as tf

    if name in QWEN3_SHAPES:
        config = tf.Qwen3Config(vocab_size=151936, head_dim=128, **QWEN3_SHAPES[name])
    elif name == "qwen3.5-2b":
        # Default layer_types: every 4th layer full attention, the rest gated delta net.
        config = tf.Qwen3_5TextConfig(
            vocab_size=248320,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            tie_word_embeddings=True,
        )
    else:
        raise ValueError(f"no random model named {name!r}")
    with torch.device(device):
        return tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def load_small(family: str, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Processor]:
    """The `make-tiny --size small` checkpoint of `family` (cached) and its processor."""
    path = tiny_checkpoint(family, size="small")
    processor = Processor(path)
    model = processor.adapter.load_model(path, dtype=dtype).to(device).eval()
    return model, processor


# --- bandwidth and results -------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int = 5) -> float:
    """Median wall time of `fn()` after one warm-up call, the device synchronized around each."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int, repeats: int = 5) -> float:
    """Median device copy bandwidth; a copy reads and writes, so it moves 2x the tensor's bytes.
    (The warm-up copy pages in both buffers.)"""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_seconds(lambda: dst.copy_(src), device, repeats) / 1e9


class GcPauses:
    """The garbage collector's pauses inside a timed window. Entering collects first, so no
    system pays for the garbage of the one timed before it: a full collection of a process that
    ran torch.compile walks millions of objects (about 0.5 s on the H200), and where one falls
    moves a row by a sixth. `report()` after the window: count, longest and total pause."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._start)

    def __enter__(self) -> GcPauses:
        gc.collect()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def report(self) -> dict:
        return {
            "gc_collections": len(self.pauses),
            "gc_max_pause_ms": 1e3 * max(self.pauses, default=0.0),
            "gc_total_s": sum(self.pauses),
        }


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def matmul_tflops(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """Median rate of a square matrix product in `dtype` (8192 on CUDA, 1024 on CPU): the
    compute side of a prefill's floor."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / median_seconds(lambda: a @ b, device, repeats) / 1e12


# --- byte floor -----------------------------------------------------------------------------------


def linear_state_bytes(config, state_itemsize: int = 4) -> int:
    """One sequence's conv and recurrent state over every linear-attention layer: the recurrent
    state (heads x key dim x value dim) at `state_itemsize` bytes an element (4: float32, the
    engine's default `linear_state_dtype`), the conv state in the model's dtype."""
    layers = sum(t == "linear_attention" for t in getattr(config, "layer_types", None) or [])
    if not layers:
        return 0
    heads, key_dim, value_dim = (
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    conv_dim = 2 * config.linear_num_key_heads * key_dim + heads * value_dim
    per_layer = (
        heads * key_dim * value_dim * state_itemsize + conv_dim * config.linear_conv_kernel_dim * 2
    )
    return layers * per_layer


class ByteFloor:
    """The least time a model's decode steps and prefills can take on a device, from the bytes a
    decode step must move and the FLOPs a prefill must do:

    - a decode step of `rows` sequences at `context` tokens each reads every weight it uses once
      (all but an untied input embedding, of which it gathers `rows` rows), or, where it takes
      longer, does the weights' products for its rows (2 FLOPs per non-embedding parameter per
      row: an 8B model's step turns compute-bound near 256 rows on an H200); then it reads the
      keys and values of every cached token in the layers that keep them, and reads and writes
      each sequence's linear-attention states;
    - a prefill of `tokens` tokens does 2 FLOPs per non-embedding parameter per token (attention
      scores are left out: short prompts).

    Bytes go at the measured copy bandwidth (`bandwidth_gb_s`, counting bytes read and written),
    FLOPs at the measured matrix-product rate (`tflops`); the linear-attention states at
    `state_itemsize` bytes an element (the engine's `linear_state_dtype`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        bandwidth_gb_s: float,
        tflops: float,
        state_itemsize: int = 4,
    ):
        from areno.engine.parallel.kv_pool import block_bytes

        config = model.config.get_text_config()
        layer_types = getattr(config, "layer_types", None) or (
            ["full_attention"] * config.num_hidden_layers
        )
        embedding = model.get_input_embeddings().weight
        embedding_bytes = embedding.numel() * embedding.element_size()
        tied = model.get_output_embeddings().weight is embedding
        self.weight_bytes = weight_bytes(model) - (0 if tied else embedding_bytes)
        self.prefill_params = sum(p.numel() for p in model.parameters()) - embedding.numel()
        self.kv_bytes_per_token = block_bytes(model, layer_types, 1)
        self.state_bytes_per_seq = linear_state_bytes(config, state_itemsize)
        self.bandwidth = bandwidth_gb_s * 1e9
        self.flops = tflops * 1e12

    def weights_s(self, rows: int) -> float:
        """A step's weight reads, or its rows' products where those take longer."""
        return max(self.weight_bytes / self.bandwidth, 2 * self.prefill_params * rows / self.flops)

    def step_ms(self, rows: int, context: float) -> float:
        cache_bytes = rows * context * self.kv_bytes_per_token + 2 * rows * self.state_bytes_per_seq
        return 1e3 * (self.weights_s(rows) + cache_bytes / self.bandwidth)

    def run(self, requests: list[dict], concurrency: int) -> dict:
        """The floor of a whole run: each request prefilled once, then decoded `max_tokens - 1`
        steps (its first token comes from the prefill) in steps of `concurrency` rows (fewer
        steps are impossible; the weights are read once a step). Output tokens are max_tokens."""
        prompt = [r["prompt_inputs"].num_prompt_tokens for r in requests]
        output = [r["max_tokens"] for r in requests]
        decode_tokens = sum(t - 1 for t in output)
        steps = decode_tokens / concurrency
        kv_bytes = self.kv_bytes_per_token * sum(
            (t - 1) * p + (t - 1) * t / 2 for p, t in zip(prompt, output, strict=True)
        )
        decode_s = (
            steps * self.weights_s(concurrency)
            + (kv_bytes + 2 * decode_tokens * self.state_bytes_per_seq) / self.bandwidth
        )
        prefill_s = 2 * self.prefill_params * sum(prompt) / self.flops
        floor_s = decode_s + prefill_s
        return {
            "floor_s": floor_s,
            "floor_decode_s": decode_s,
            "floor_prefill_s": prefill_s,
            "floor_tok_s": sum(output) / floor_s,
        }


def stop_on_terminate() -> None:
    """Turn SIGTERM (`timeout`, a cancelled job) into SystemExit in the main thread, so that a
    benchmark's `finally` blocks stop the servers, Ray and child processes it started. Killed
    by the signal's default action, a benchmark left them running, holding the GPU's memory
    for whatever ran next."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def write_results(path: str, meta: dict, results: dict) -> None:
    """`results` as JSON at `path`, under a "meta" that also names the machine and device."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {"machine": platform.platform(), "device": device, "torch": torch.__version__, **meta}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, **results}, indent=2))
    print(f"wrote {out}")
