"""The engine's Triton kernels against the PyTorch paths they replace, at the GPU workload's shapes
(64 decoding rows, 256-token prompts; Qwen3-1.7B and Qwen3.5-2B heads), on CUDA.

- decode attention: one query token per row over 384 cached keys, each row attending to its own
  first 257-384 (the runner's per-row mask), at 64 and 256 rows (`--attention-rows`; Qwen3-1.7B,
  Qwen3-8B and Qwen3.5-2B heads). Baseline: the engine's packed SDPA call with that mask
  (memory-efficient attention). Floor: the valid keys and values read once. Rows: every row's
  keys in 128-key splits and a combine (the launch before the split plan), the engine's plan,
  every row's keys in one split (no combine), the plan at other targets of programs per
  multiprocessor, and the engine's split at other launches (keys a block, warps,
  software-pipelining stages).
- gated delta, decode: one token per row through the recurrent state (16 heads of 128 x 128
  fp32). Baseline: the engine's four-pass PyTorch update. Floor: the state read and written once.
- gated delta, prefill: 32 prompts x 256 tokens from a zero state. Baseline: transformers'
  chunked PyTorch delta rule (what runs without flash-linear-attention). The engine's launch,
  then others: value columns per program, warps, inputs loaded a token ahead or not. Then the
  chunked rule (kernels/chunked_delta.py) against that token-by-token kernel (its "pytorch"
  column is the token kernel's time), at chunk sizes, value columns and product precisions,
  and on few long prompts (4 x 4096 and 1 x 16384 tokens).

Decode kernels are timed as the engine runs them, replayed from a CUDA graph (10 calls per
replay); the prefill eagerly. Prints a table and writes JSON.

    python benchmarks/engine_kernels.py [--out benchmarks/results/engine_kernels_gpu.json]
    python benchmarks/engine_kernels.py --kernels attention --attention-rows 1 64
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).parent))
from engine_workloads import copy_bandwidth_gb_s, write_results  # noqa: E402

import areno.engine.kernels.decode_attention as attention_kernel  # noqa: E402
from areno.engine.kernels import references_only  # noqa: E402
from areno.engine.kernels.chunked_delta import CHUNK, chunked_gated_delta  # noqa: E402
from areno.engine.kernels.decode_attention import SPLIT_KEYS, decode_attention  # noqa: E402
from areno.engine.kernels.gated_delta import gated_delta, launch_choices  # noqa: E402
from areno.engine.layers.linear_attention import recurrent_update  # noqa: E402

ROWS, PROMPT, CACHED = 64, 256, 384
ATTENTION_ROWS = (64, 256)
PAGE = 16  # the paged cache's default block size (--block-size)
ATTENTION_SHAPES = {  # heads, kv heads, head dim
    "qwen3-1.7b": (16, 8, 128),
    "qwen3-8b": (32, 8, 128),
    "qwen3.5-2b": (8, 2, 256),
}
LINEAR_HEADS, LINEAR_DIM = 16, 128
PROGRAMS_PER_SM = (1, 2, 4, 8)  # the split plan's target (the engine's: in decode_attention.py)
STAGES = (1, 2, 3)  # software-pipelining stages of a split's loop
WARPS = (4, 8)


def graph_ms(fn, calls: int = 10, replays: int = 20) -> float:
    """Milliseconds per call of `fn`, replayed from a CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return _timed(graph.replay, replays) / calls


def _timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def attention_rows(bandwidth: float, batches=ATTENTION_ROWS) -> list[dict]:
    rows = []
    for batch in batches:
        gen = torch.Generator(device="cuda").manual_seed(0)
        ends = torch.randint(PROMPT + 1, CACHED + 1, (batch,), device="cuda", generator=gen)
        mask = torch.arange(CACHED, device="cuda")[None] < ends[:, None]
        for model, (heads, kv_heads, dim) in ATTENTION_SHAPES.items():
            rows += _attention_rows(model, heads, kv_heads, dim, mask, bandwidth)
    return rows


def _attention_rows(model, heads, kv_heads, dim, mask, bandwidth: float) -> list[dict]:
    batch = mask.shape[0]
    query = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    key, value = (
        torch.randn(batch, kv_heads, CACHED, dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    packed = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    # The same keys in the paged cache's layout: blocks of PAGE tokens, each row's in a table.
    blocks = -(-CACHED // PAGE)
    pool_k, pool_v = (
        t.reshape(batch, kv_heads, blocks, PAGE, dim)
        .transpose(1, 2)
        .reshape(-1, kv_heads, PAGE, dim)
        for t in (key, value)
    )
    tables = torch.arange(batch * blocks, device="cuda").reshape(batch, blocks)

    def sdpa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            F.scaled_dot_product_attention(packed, key, value, attn_mask=mask[:, None, None])

    def kernel(keys: int, options: dict | None = None) -> float:
        return graph_ms(
            lambda: attention_kernel.launch(
                query, pool_k, pool_v, tables, mask, dim**-0.5, None, keys, options
            )
        )

    floor_ms = int(mask.sum()) * kv_heads * dim * 2 * 2 / bandwidth / 1e6
    sdpa_ms = graph_ms(sdpa)
    shape = f"{model} x{batch}"
    # The launch before the split plan: every row's keys in SPLIT_KEYS splits and a combine.
    rows = [
        _row(
            f"attention {SPLIT_KEYS}-key splits (before)",
            shape,
            sdpa_ms,
            kernel(SPLIT_KEYS),
            floor_ms,
        )
    ]
    engine_ms = graph_ms(lambda: decode_attention(query, pool_k, pool_v, tables, mask, dim**-0.5))
    rows.append(_row("attention, the engine's plan", shape, sdpa_ms, engine_ms, floor_ms))
    # One split a row: no combine, the fewest programs.
    whole = -(-CACHED // SPLIT_KEYS) * SPLIT_KEYS
    rows.append(_row(f"attention one {whole}-key split", shape, sdpa_ms, kernel(whole), floor_ms))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for per_sm in PROGRAMS_PER_SM:
        keys = attention_kernel.split_keys(batch, kv_heads, CACHED, per_sm * sms)
        name = f"attention {per_sm}/SM: {keys}-key splits"
        rows.append(_row(name, shape, sdpa_ms, kernel(keys), floor_ms))
    # The launch of the engine's split: keys a block, warps, pipeline stages.
    keys = attention_kernel.split_keys(
        batch, kv_heads, CACHED, attention_kernel.PROGRAMS_PER_SM * sms
    )
    blocks = (32, 64, 128) if dim <= 128 else (16, 32, 64)
    for block, warps, stages in itertools.product(blocks, WARPS, STAGES):
        options = {"BLOCK_N": block, "num_warps": warps, "num_stages": stages}
        name = f"attention {keys}-key splits: {block} a block, {warps} warps, {stages} st"
        try:
            rows.append(_row(name, shape, sdpa_ms, kernel(keys, options), floor_ms))
        except OutOfResources:
            print(f"{name}: does not launch (shared memory)")
    return rows


def gated_delta_rows(bandwidth: float) -> list[dict]:
    torch.manual_seed(0)
    heads, dim = LINEAR_HEADS, LINEAR_DIM
    state = torch.randn(ROWS, heads, dim, dim, device="cuda")
    query, key = (F.normalize(torch.randn(ROWS, heads, dim, device="cuda"), dim=-1) for _ in "qk")
    value = torch.randn(ROWS, heads, dim, device="cuda")
    beta, decay = torch.rand(ROWS, heads, device="cuda"), torch.rand(ROWS, heads, device="cuda")

    def torch_step():
        with references_only():
            recurrent_update(state, decay, query, key, value, beta)

    def triton_step():
        gated_delta(state, *(t[:, None] for t in (query, key, value, beta, decay)))

    torch_ms = graph_ms(torch_step)
    decode = _row(
        "gated delta decode",
        "qwen3.5-2b",
        torch_ms,
        graph_ms(triton_step),
        state.numel() * 4 * 2 / bandwidth / 1e6,
    )
    decode_rows = [decode]
    # A bf16 stored state (`linear_state_dtype`): half the bytes; the engine's launch first,
    # then the columns and warps around it.
    half = state.to(torch.bfloat16)
    engine = launch_choices(1, dim, half.dtype)
    for block_v, num_warps in [
        (engine["block_v"], engine["num_warps"]),
        *[(bv, w) for bv in (32, 64, 128) for w in (2, 4, 8)],
    ]:
        launch = {"block_v": block_v, "num_warps": num_warps}
        name = f"gated delta decode bf16 state v{block_v} w{num_warps}"
        if launch == {k: engine[k] for k in launch}:
            if len(decode_rows) > 1:
                continue  # measured first
            name += " (engine)"

        def half_step(launch=launch):
            gated_delta(half, *(t[:, None] for t in (query, key, value, beta, decay)), **launch)

        floor_ms = half.numel() * 2 * 2 / bandwidth / 1e6
        decode_rows.append(_row(name, "qwen3.5-2b", torch_ms, graph_ms(half_step), floor_ms))

    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    batch = 32
    q, k = (
        torch.randn(batch, PROMPT, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in "qk"
    )
    v = torch.randn(batch, PROMPT, heads, dim, device="cuda", dtype=torch.bfloat16)
    b = torch.rand(batch, PROMPT, heads, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(batch, PROMPT, heads, device="cuda")
    chunked = _timed(
        lambda: torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=b, output_final_state=True, use_qk_l2norm_in_kernel=True
        ),
        5,
    )

    nq = F.normalize(q.float(), dim=-1, eps=1e-6) * dim**-0.5
    nk = F.normalize(k.float(), dim=-1, eps=1e-6)
    rows = list(decode_rows)
    first_prefill = len(rows)
    engine = launch_choices(PROMPT, dim)
    # The engine's launch first, then the launch choices around it (the kernel's docstring).
    for block_v, num_warps, prefetch in [
        (engine["block_v"], engine["num_warps"], engine["prefetch"]),
        *[(bv, w, p) for p in (False, True) for bv in (16, 32, 64) for w in (1, 2, 4, 8)],
    ]:
        launch = {"block_v": block_v, "num_warps": num_warps, "prefetch": prefetch}
        name = f"gated delta prefill v{block_v} w{num_warps}" + (" ahead" if prefetch else "")
        if launch == engine:
            if len(rows) > first_prefill:
                continue  # measured first
            name += " (engine)"
        kernel_ms = _timed(lambda la=launch: gated_delta(None, nq, nk, v, b, g.exp(), **la), 5)
        rows.append(_row(name, "qwen3.5-2b", chunked, kernel_ms, None))
    token_ms = rows[1]["triton_ms"]  # the token-by-token kernel at the engine's launch
    for chunk, block_v, precision, stages in [
        (32, 32, "tf32", 1), (32, 32, "tf32", 2), (32, 64, "tf32", 1), (64, 32, "tf32", 1),
        (16, 32, "tf32", 1), (32, 32, "ieee", 1),
    ]:  # fmt: skip
        launch = {"chunk": chunk, "block_v": block_v, "precision": precision}
        name = f"chunked prefill c{chunk} v{block_v} {precision} s{stages}"
        name += " (engine)" if (chunk, block_v, precision, stages) == (CHUNK, 32, "tf32", 1) else ""
        kernel_ms = _fitting(
            lambda la=launch, st=stages: chunked_gated_delta(nq, nk, v, b, g, scan_stages=st, **la)
        )
        rows.append(_row(name, "qwen3.5-2b", token_ms, kernel_ms, None))
    rows += long_prompt_rows()
    return rows


def long_prompt_rows() -> list[dict]:
    """Few long prompts, where the token-by-token kernel's steps run one after another: its
    time (the "pytorch" column here) against the chunked rule's at the engine's launch."""
    heads, dim = LINEAR_HEADS, LINEAR_DIM
    rows = []
    for batch, length in [(4, 4096), (1, 16384)]:
        inputs = _long_prompt(batch, length, heads, dim)
        token_ms = _timed(lambda i=inputs: gated_delta(None, *i[:4], i[4].exp()), 3)
        chunk_ms = _timed(lambda i=inputs: chunked_gated_delta(*i), 3)
        name = f"prefill {batch} x {length}: chunked vs token"
        rows.append(_row(name, "qwen3.5-2b", token_ms, chunk_ms, None))
    return rows


def _fitting(fn) -> float:
    """`_timed(fn, 5)`, or NaN for a launch whose tiles do not fit the GPU's shared memory."""
    try:
        return _timed(fn, 5)
    except OutOfResources as error:
        print(f"  (does not fit: {error})")
        return float("nan")


def _long_prompt(batch: int, length: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Normalised query (scaled) and key, bfloat16 value and beta, log-decay: (B, T, N, ...)."""
    query, key = (
        F.normalize(torch.randn(batch, length, heads, dim, device="cuda"), dim=-1) for _ in "qk"
    )
    value = torch.randn(batch, length, heads, dim, device="cuda", dtype=torch.bfloat16)
    beta = torch.rand(batch, length, heads, device="cuda", dtype=torch.bfloat16)
    log_decay = -torch.rand(batch, length, heads, device="cuda")
    return query * dim**-0.5, key, value, beta, log_decay


def _row(kernel: str, model: str, torch_ms: float, triton_ms: float, floor_ms) -> dict:
    return {
        "kernel": kernel,
        "shape": model,
        "pytorch_ms": torch_ms,
        "triton_ms": triton_ms,
        "speedup": torch_ms / triton_ms,
        "floor_ms": floor_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/engine_kernels_gpu.json")
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=["attention", "gated-delta"],
        default=["attention", "gated-delta"],
    )
    parser.add_argument(
        "--attention-rows",
        nargs="+",
        type=int,
        default=list(ATTENTION_ROWS),
        help="decoding rows of the attention kernel's workloads",
    )
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gb_s(torch.device("cuda"), 1 << 30)
    rows = []
    if "attention" in args.kernels:
        rows += attention_rows(bandwidth, args.attention_rows)
    if "gated-delta" in args.kernels:
        rows += gated_delta_rows(bandwidth)
    print(
        f"{'kernel':<44} {'shape':<11} {'pytorch ms':>10} {'triton ms':>10} {'x':>6} {'floor ms':>9}"
    )
    for r in rows:
        floor = f"{r['floor_ms']:.4f}" if r["floor_ms"] is not None else "-"
        print(
            f"{r['kernel']:<44} {r['shape']:<11} {r['pytorch_ms']:>10.4f} {r['triton_ms']:>10.4f} "
            f"{r['speedup']:>6.2f} {floor:>9}"
        )
    meta = {"copy_bandwidth_gb_s": bandwidth, "rows": ROWS, "prompt": PROMPT, "cached_keys": CACHED}
    write_results(args.out, meta, {"rows": rows})


if __name__ == "__main__":
    main()
