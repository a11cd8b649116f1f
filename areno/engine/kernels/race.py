"""A sampled row's token as the winner of a race over its vocabulary, in two small kernels.

Drawing token v with probability softmax(logits)[v] is the same as taking the argmax of
logits[v] + g[v], with g[v] independent Gumbel noise (-log(-log(u)) for u uniform in (0, 1)).
Here u is a hash of the row's 64-bit key (`areno/engine/sample/sampler.py::row_keys`: a seeded
row's is a function of its seed and the index of the token it draws) and of v, splitmix64's
output for that state, so no noise is drawn or stored: the first kernel reads each chunk of a
row's logits once, scores it and keeps the chunk's best token, the second picks each row's best
chunk. Against the PyTorch way on a GPU (a softmax, a cumulative sum or a noise tensor, and a
search: about ten launches, each over rows x vocabulary), this reads the logits once and
launches twice, whatever the rows.

The noise's u takes 23 bits and a half (u in [2**-24, 1 - 2**-24], exact in float32), so g lies
within [-2.9, 16.7]: a token more than about 20 below the row's best logit never wins, where its
true chance is under 2e-9. A removed token (-inf) never wins. The CPU path
(`sampler._inverse_cdf`) draws from the same distribution another way, so one seed gives
different tokens on CPU and on a GPU (as their logits differ anyway); on one device a row's
tokens depend on its key and logits alone.
"""

from __future__ import annotations

import torch

from areno.engine.kernels import triton

# Logits a program of the first kernel scores. The launch is not tuned on a GPU yet.
CHUNK = 2048

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _splitmix64(z):
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _race_kernel(
        Logits, Keys, Greedy, Temperature, Best, BestIndex, V, stride_b, num_chunks,
        CHUNK: tl.constexpr, HAS_TEMPERATURE: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(Logits + b * stride_b + offs, mask=offs < V, other=float("-inf"))
        x = x.to(tl.float32)
        if HAS_TEMPERATURE:
            x = x / tl.load(Temperature + b)
        key = tl.load(Keys + b).to(tl.uint64)
        state = key + (offs + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
        bits = _splitmix64(state) >> 41
        u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # exact in float32, never 0 or 1
        # NOTE: E = -log(u) is at least 2**-24 in exact arithmetic; the floor keeps a fast log's
        # error near u = 1 from making it 0 (a score of +inf, a token that always wins).
        clock = tl.maximum(-tl.log(u), 5.96e-8)
        noise = tl.where(tl.load(Greedy + b), 0.0, -tl.log(clock))  # a greedy row: argmax
        score = tl.where(x == float("-inf"), x, x + noise)
        best = tl.max(score, axis=0)
        tl.store(Best + b * num_chunks + c, best)
        tl.store(BestIndex + b * num_chunks + c, c * CHUNK + tl.argmax(score, axis=0))

    @triton.jit
    def _winner_kernel(Best, BestIndex, Out, num_chunks, C_PAD: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.arange(0, C_PAD)
        best = tl.load(Best + b * num_chunks + offs, mask=offs < num_chunks, other=float("-inf"))
        chunk = tl.argmax(best, axis=0)
        tl.store(Out + b, tl.load(BestIndex + b * num_chunks + chunk))


def race(
    logits_BV: torch.Tensor,
    keys_B: torch.Tensor,
    greedy_B: torch.Tensor,
    temperature_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's token (int64) drawn from softmax(`logits_BV` / `temperature_B`) with the
    noise of its key (`keys_B`, int64), or its first most likely token where `greedy_B`. The
    logits' rows must be contiguous."""
    rows, vocab = logits_BV.shape
    assert logits_BV.stride(-1) == 1, "a row's logits must be contiguous"
    num_chunks = triton.cdiv(vocab, CHUNK)
    best_BC = logits_BV.new_empty((rows, num_chunks), dtype=torch.float32)
    index_BC = logits_BV.new_empty((rows, num_chunks), dtype=torch.int64)
    _race_kernel[(rows, num_chunks)](
        logits_BV, keys_B, greedy_B, keys_B if temperature_B is None else temperature_B,
        best_BC, index_BC, vocab, logits_BV.stride(0), num_chunks,
        CHUNK=CHUNK, HAS_TEMPERATURE=temperature_B is not None, num_warps=4,
    )  # fmt: skip
    tokens_B = logits_BV.new_empty(rows, dtype=torch.int64)
    pad = max(2, triton.next_power_of_2(num_chunks))
    _winner_kernel[(rows,)](best_BC, index_BC, tokens_B, num_chunks, C_PAD=pad, num_warps=1)
    return tokens_B
