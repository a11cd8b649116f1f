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
    def _score(x, key, offs, greedy):
        # x + Gumbel noise hashed from the row's key and each token's index; -inf stays -inf,
        # and a greedy row's score is x itself (the race is its argmax).
        state = key + (offs + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
        bits = _splitmix64(state) >> 41
        u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # exact in float32, never 0 or 1
        # NOTE: E = -log(u) is at least 2**-24 in exact arithmetic; the floor keeps a fast log's
        # error near u = 1 from making it 0 (a score of +inf, a token that always wins).
        clock = tl.maximum(-tl.log(u), 5.96e-8)
        noise = tl.where(greedy, 0.0, -tl.log(clock))
        return tl.where(x == float("-inf"), x, x + noise)

    @triton.jit
    def _race_kernel(
        Logits, Keys, Greedy, Temperature, Best, BestIndex, ChunkMax, ChunkSum, V, stride_b,
        num_chunks, CHUNK: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, STATS: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(Logits + b * stride_b + offs, mask=offs < V, other=float("-inf"))
        x = x.to(tl.float32)
        if HAS_TEMPERATURE:
            x = x / tl.load(Temperature + b)
        key = tl.load(Keys + b).to(tl.uint64)
        score = _score(x, key, offs, tl.load(Greedy + b))
        best = tl.max(score, axis=0)
        tl.store(Best + b * num_chunks + c, best)
        tl.store(BestIndex + b * num_chunks + c, c * CHUNK + tl.argmax(score, axis=0))
        if STATS:
            # The chunk's share of the row's softmax: its max and its sum of exp below it.
            top = tl.max(x, axis=0)
            shift = tl.where(top == float("-inf"), 0.0, top)
            tl.store(ChunkMax + b * num_chunks + c, top)
            tl.store(ChunkSum + b * num_chunks + c, tl.sum(tl.exp(x - shift), axis=0))

    @triton.jit
    def _winner_kernel(Best, BestIndex, Out, num_chunks, C_PAD: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.arange(0, C_PAD)
        best = tl.load(Best + b * num_chunks + offs, mask=offs < num_chunks, other=float("-inf"))
        chunk = tl.argmax(best, axis=0)
        tl.store(Out + b, tl.load(BestIndex + b * num_chunks + chunk))

    @triton.jit
    def _filtered_rounds_kernel(
        Logits, Keys, Greedy, TopP, LogMinP, Best, BestIndex, ChunkMax, ChunkSum, Out, V,
        stride_b, num_chunks, BLOCK: tl.constexpr, C_PAD: tl.constexpr,
    ):  # fmt: skip
        # One program a row, after the race kernel's chunks: the row's softmax (its max m and
        # sum of exp) and the race's winner c over the whole row come from the chunks. Then
        # while c is not in the row's nucleus (the tokens before it, most likely first, hold
        # more than top_p of the mass, or its probability is under min_p of the top's), one
        # more pass takes the mass before c while racing the tokens before c that min_p keeps:
        # those are the only ones that can still be kept, and the best of them under the same
        # noise is the next candidate.
        b = tl.program_id(0)
        row = Logits + b * stride_b
        key = tl.load(Keys + b).to(tl.uint64)
        greedy = tl.load(Greedy + b)
        top_p = tl.load(TopP + b)
        log_min_p = tl.load(LogMinP + b)  # -inf without a min_p
        chunks = b * num_chunks + tl.arange(0, C_PAD)
        real = tl.arange(0, C_PAD) < num_chunks
        chunk_best = tl.load(Best + chunks, mask=real, other=float("-inf"))
        winner = tl.load(BestIndex + b * num_chunks + tl.argmax(chunk_best, 0)).to(tl.int32)
        chunk_max = tl.load(ChunkMax + chunks, mask=real, other=float("-inf"))
        m = tl.max(chunk_max, 0)
        scale = tl.where(chunk_max == float("-inf"), 0.0, tl.exp(chunk_max - m))
        total = tl.sum(tl.load(ChunkSum + chunks, mask=real, other=0.0) * scale, 0)
        x_c = tl.load(row + winner).to(tl.float32)
        # A greedy row takes its argmax, which every filter keeps; so does a row whose winner
        # passes min_p and that has no top_p.
        done = greedy | ((top_p >= 1.0) & (x_c - m >= log_min_p))
        while done == 0:
            # "Before c": more likely, or as likely and earlier in the vocabulary.
            mass = tl.zeros([], tl.float32)
            best = tl.full([], float("-inf"), tl.float32)
            next_winner = winner
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                before = ((x > x_c) | ((x == x_c) & (offs < winner))) & (x - m >= log_min_p)
                # Most blocks of a peaked row hold no token before c: their noise is not drawn.
                if tl.max(before.to(tl.int32), 0) > 0:
                    mass += tl.sum(tl.where(before, tl.exp(x - m), 0.0), 0)
                    score = tl.where(before, _score(x, key, offs, greedy), float("-inf"))
                    block_best = tl.max(score, 0)
                    take = block_best > best
                    next_winner = tl.where(take, start + tl.argmax(score, 0), next_winner)
                    best = tl.maximum(best, block_best)
            # A c that min_p keeps has every token before it kept by min_p too: `mass` is then
            # all the mass before it.
            kept = (x_c - m >= log_min_p) & ((top_p >= 1.0) | (mass / total <= top_p))
            # Nothing before c: c is the row's most likely token, which every filter keeps.
            # Without a top_p, the next candidate is kept: min_p keeps it by construction.
            done = kept | (best == float("-inf")) | (top_p >= 1.0)
            winner = tl.where(kept, winner, next_winner)
            x_c = tl.load(row + winner).to(tl.float32)
        tl.store(Out + b, winner.to(tl.int64))


def race(
    logits_BV: torch.Tensor,
    keys_B: torch.Tensor,
    greedy_B: torch.Tensor,
    temperature_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's token (int64) drawn from softmax(`logits_BV` / `temperature_B`) with the
    noise of its key (`keys_B`, int64), or its first most likely token where `greedy_B`. The
    logits' rows must be contiguous."""
    tokens_B = logits_BV.new_empty(logits_BV.shape[0], dtype=torch.int64)
    best_BC, index_BC, _, _ = _race_chunks(logits_BV, keys_B, greedy_B, temperature_B)
    num_chunks = best_BC.shape[1]
    pad = max(2, triton.next_power_of_2(num_chunks))
    _winner_kernel[(len(tokens_B),)](
        best_BC, index_BC, tokens_B, num_chunks, C_PAD=pad, num_warps=1
    )  # fmt: skip
    return tokens_B


def _race_chunks(
    logits_BV: torch.Tensor,
    keys_B: torch.Tensor,
    greedy_B: torch.Tensor,
    temperature_B: torch.Tensor | None,
    stats: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The race kernel's per-chunk results (rows, chunks): each chunk's best score and its
    token, and with `stats` its max logit and its sum of exp below that (else None)."""
    rows, vocab = logits_BV.shape
    assert logits_BV.stride(-1) == 1, "a row's logits must be contiguous"
    num_chunks = triton.cdiv(vocab, CHUNK)
    best_BC = logits_BV.new_empty((rows, num_chunks), dtype=torch.float32)
    index_BC = logits_BV.new_empty((rows, num_chunks), dtype=torch.int64)
    max_BC = torch.empty_like(best_BC) if stats else None
    sum_BC = torch.empty_like(best_BC) if stats else None
    _race_kernel[(rows, num_chunks)](
        logits_BV, keys_B, greedy_B, keys_B if temperature_B is None else temperature_B,
        best_BC, index_BC, best_BC if max_BC is None else max_BC,
        best_BC if sum_BC is None else sum_BC, vocab, logits_BV.stride(0), num_chunks,
        CHUNK=CHUNK, HAS_TEMPERATURE=temperature_B is not None, STATS=stats, num_warps=4,
    )  # fmt: skip
    return best_BC, index_BC, max_BC, sum_BC


# Logits a filtered race's program reads at a time.
FILTERED_BLOCK = 2048


def filtered_race(
    logits_BV: torch.Tensor,
    keys_B: torch.Tensor,
    greedy_B: torch.Tensor,
    top_p_B: torch.Tensor,
    min_p_B: torch.Tensor,
) -> torch.Tensor:
    """`race` over what top-p (`top_p_B`, 1: none) and then min-p (`min_p_B`, 0: none) keep of
    each row of `logits_BV` (float32, tempered), without sorting it: the same token as the race
    over the filtered row, up to float rounding in the mass at the nucleus's edge.

    The race's chunks (the race kernel, with each chunk's softmax share) give the winner over
    the whole row, which is checked against the filters; where they remove it, every token
    less likely goes with it, so the race runs again over the tokens before it that min-p
    keeps, until its winner is kept (one program a row, kernel above). Each round is one pass
    over the row: min-p alone takes at most one, top-p one for a trained model's peaked row
    and about log2 of the tokens in the running for a flat one."""
    tokens_B = logits_BV.new_empty(logits_BV.shape[0], dtype=torch.int64)
    best_BC, index_BC, max_BC, sum_BC = _race_chunks(logits_BV, keys_B, greedy_B, None, True)
    num_chunks = best_BC.shape[1]
    _filtered_rounds_kernel[(len(tokens_B),)](
        logits_BV, keys_B, greedy_B, top_p_B, min_p_B.log(), best_BC, index_BC, max_BC, sum_BC,
        tokens_B, logits_BV.shape[1], logits_BV.stride(0), num_chunks,
        BLOCK=FILTERED_BLOCK, C_PAD=max(2, triton.next_power_of_2(num_chunks)), num_warps=8,
    )  # fmt: skip
    return tokens_B
