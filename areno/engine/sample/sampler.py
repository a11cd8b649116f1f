"""Token sampling on the device: temperature, top-k, top-p, min-p, per-row seeds, logprobs,
and what changes the logits before them: logit biases, repetition penalties, banned tokens
(media placeholders, stop tokens before `min_tokens`) and grammar masks.

Everything is batched over rows (one row per sequence of the step) and stays on the device:
`sample` never calls `.item()` or reads a tensor on the host, so the engine copies the small
`SamplerOutput` to the host once per step. Nothing loops over rows: all of a sampled row's
randomness is one 64-bit key (`row_keys`), which a seeded row computes from its seed and the
index of the token it draws. On CPU the filters look at each row's best tokens (or its sorted
whole) and the row inverts its distribution's cumulative sum at the key's uniform number; where
the engine's Triton kernels run, a race of its tokens with noise hashed from the key picks it in
two launches, and a top-p or min-p races within what the filter keeps without sorting the row
(kernels/race.py). So a seeded row costs no generator and no launch of its own, and its k-th
token is the same whatever the batch, the step it lands in, or a preemption between.

NOTE: logprobs are the log-softmax of the RAW logits (temperature 1, before top-k / top-p / min-p),
at the chosen token and for the top-K list: the model's own distribution, as OpenAI-style clients
expect. A row with `logprobs_mode="tempered"` reports the logits divided by its temperature
instead (still before the filters): the distribution its tokens were drawn from, short of the
filters, which is what a GRPO trainer recomputes (as verl does) when rollouts sample at T != 1.
Biases, penalties, bans and grammars apply after the logprobs are taken, so they never show in
them either (OpenAI reports the model's own logprobs under `logit_bias` too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from areno.engine.kernels import use_triton
from areno.engine.kernels.race import filtered_race, race
from areno.engine.outputs.grammar import allowed_tokens
from areno.engine.sample.penalties import apply_penalties
from areno.engine.sampling import MAX_SEED, SamplingParams
from areno.engine.transfer import to_device

# splitmix64's constants (Steele, Lea and Flood, "Fast splittable pseudorandom number
# generators"): its finalizer turns consecutive integers into independent-looking 64-bit words.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(words: np.ndarray) -> np.ndarray:
    words = (words ^ (words >> np.uint64(30))) * _MIX1
    words = (words ^ (words >> np.uint64(27))) * _MIX2
    return words ^ (words >> np.uint64(31))


def seeded_keys(seeds: Sequence[int], draws: Sequence[int]) -> np.ndarray:
    """A 64-bit key (uint64) for each (seed, draw index) pair: a counter-based generator, so
    draw k of a seed is a function of the two alone. Seeds are any int in the protocol's range
    (taken modulo 2**64)."""
    seeds_R = np.array([seed % (MAX_SEED + 1) for seed in seeds], dtype=np.uint64)
    draws_R = np.array(draws, dtype=np.uint64)
    return _mix(seeds_R * _GOLDEN + _mix(draws_R + _GOLDEN))


def row_keys(
    seeds: Sequence[int | None], draws: Sequence[int], device: torch.device | str
) -> Tensor:
    """Each row's key for `sample` (int64, the uint64's bits), on `device`: a seeded row's from
    its seed and the index of the token it draws (`seeded_keys`), the others' from torch's
    default CPU generator (so `torch.manual_seed` repeats an unseeded run). One host-to-device
    copy."""
    seeded = [i for i, seed in enumerate(seeds) if seed is not None]
    if len(seeded) == len(seeds):  # a GRPO rollout's rows
        keys_B = torch.from_numpy(seeded_keys(seeds, draws).view(np.int64))
    else:
        keys_B = torch.randint(-(2**63), 2**63 - 1, (len(seeds),), dtype=torch.int64)
        if seeded:
            keys = seeded_keys([seeds[i] for i in seeded], [draws[i] for i in seeded])
            keys_B[seeded] = torch.from_numpy(keys.view(np.int64))
    return to_device(keys_B, device)


def key_uniforms(keys_B: Tensor) -> Tensor:
    """The uniform number in [0, 1) (float64) of each key: its top 53 bits."""
    return ((keys_B >> 11) & (2**53 - 1)).double() * 2.0**-53


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors; build once per batch composition.

    Greedy rows carry temperature 1 so the division is safe; `greedy_B` picks argmax for them.
    top_k 0 means off. The Python flags let `sample` skip work no row asks for without a sync.
    """

    temperature_B: Tensor
    logprob_temperature_B: Tensor
    greedy_B: Tensor
    top_k_B: Tensor
    top_p_B: Tensor
    min_p_B: Tensor
    num_top_logprobs: int
    any_logprobs: bool
    all_greedy: bool
    any_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    tempered_logprobs: bool
    # The largest top_k of a sampled row (0: none), and whether every sampled row with a top_p
    # has a top_k too: then the filters see only each row's best `max_top_k` tokens (`_filter`).
    max_top_k: int = 0
    top_k_bounds_top_p: bool = False
    # Rows with penalties (P,) and their three factors; None when no row has any.
    penalty_rows_P: Tensor | None = None
    presence_P: Tensor | None = None
    frequency_P: Tensor | None = None
    repetition_P: Tensor | None = None
    # logit_bias as (row, token, bias) triples; None when no row has any.
    bias_rows_N: Tensor | None = None
    bias_ids_N: Tensor | None = None
    bias_N: Tensor | None = None

    @classmethod
    def from_params(
        cls, params_list: list[SamplingParams], device: torch.device | str
    ) -> SamplingTensors:
        """Tensors for rows sampled with `params_list[i]` (one entry per row)."""
        greedy = [p.is_greedy for p in params_list]
        sampled = [p for p in params_list if not p.is_greedy]  # filters matter only for these

        def column(values: list, dtype: torch.dtype) -> Tensor:
            return to_device(torch.tensor(values, dtype=dtype), device)

        penalised = [(i, p) for i, p in enumerate(params_list) if p.has_penalties]
        biases = [(i, t, b) for i, p in enumerate(params_list) for t, b in p.logit_bias]
        extra = {}
        if penalised:
            extra.update(
                penalty_rows_P=column([i for i, _ in penalised], torch.int64),
                presence_P=column([p.presence_penalty for _, p in penalised], torch.float32),
                frequency_P=column([p.frequency_penalty for _, p in penalised], torch.float32),
                repetition_P=column([p.repetition_penalty for _, p in penalised], torch.float32),
            )
        if biases:
            rows, ids, values = zip(*biases, strict=True)
            extra.update(
                bias_rows_N=column(list(rows), torch.int64),
                bias_ids_N=column(list(ids), torch.int64),
                bias_N=column(list(values), torch.float32),
            )
        return cls(
            temperature_B=column([p.temperature or 1.0 for p in params_list], torch.float32),
            logprob_temperature_B=column(
                [_logprob_temperature(p) for p in params_list], torch.float32
            ),
            greedy_B=column(greedy, torch.bool),
            top_k_B=column([max(p.top_k, 0) for p in params_list], torch.int64),
            top_p_B=column([p.top_p for p in params_list], torch.float32),
            min_p_B=column([p.min_p for p in params_list], torch.float32),
            num_top_logprobs=max((p.top_logprobs for p in params_list), default=0),
            any_logprobs=any(p.logprobs for p in params_list),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            use_top_k=any(p.top_k > 0 for p in sampled),
            use_top_p=any(p.top_p < 1 for p in sampled),
            use_min_p=any(p.min_p > 0 for p in sampled),
            tempered_logprobs=any(_logprob_temperature(p) != 1.0 for p in params_list),
            max_top_k=max((p.top_k for p in sampled if p.top_k > 0), default=0),
            top_k_bounds_top_p=all(p.top_k > 0 for p in sampled if p.top_p < 1),
            **extra,
        )


def _logprob_temperature(params: SamplingParams) -> float:
    """What a row's reported logprobs divide the logits by: its temperature when it asks for
    tempered logprobs and samples, else 1 (raw; a greedy row has no distribution to temper)."""
    if params.logprobs_mode == "tempered" and not params.is_greedy:
        return params.temperature
    return 1.0


@dataclass
class StepLogits:
    """What changes one step's logits besides the rows' fixed parameters, all on the device.

    seen: the penalty rows' (counts, in-prompt) from their slots' TokenHistory.
    ban_rows_N / ban_ids_N: (row, token) pairs that cannot be drawn (stop tokens before a row's
        min_tokens).
    grammar_rows_G / bitmask_GW: rows under a grammar and their packed allowed-token masks.
    """

    seen: tuple[Tensor, Tensor] | None = None
    ban_rows_N: Tensor | None = None
    ban_ids_N: Tensor | None = None
    grammar_rows_G: Tensor | None = None
    bitmask_GW: Tensor | None = None


@dataclass
class SamplerOutput:
    """One step's sampled tokens and their logprobs (raw, or tempered per row), still on the device.

    top_logprobs_ids_BK / top_logprobs_BK hold K = the largest `top_logprobs` in the batch,
    sorted by descending logprob; a row that asked for fewer uses its first entries. When no
    row asked for logprobs (and none reports tempered ones), logprobs_B is all zeros.
    """

    token_ids_B: Tensor
    logprobs_B: Tensor
    top_logprobs_ids_BK: Tensor
    top_logprobs_BK: Tensor

    def packed(self) -> Tensor:
        """The four fields side by side in one float64 (B, 2 + 2K) tensor (token ids are exact
        in it), so the step's host copy is one transfer, not four; `unpack` reads it back."""
        return torch.cat(
            [
                self.token_ids_B[:, None].double(),
                self.logprobs_B[:, None].double(),
                self.top_logprobs_ids_BK.double(),
                self.top_logprobs_BK.double(),
            ],
            dim=1,
        )

    @staticmethod
    def unpack(packed_BC: Tensor) -> tuple[list[int], list[float], list[list[int]], list[list]]:
        """(token ids, logprobs, top ids, top logprobs) as lists from a host copy of `packed`."""
        k = (packed_BC.shape[1] - 2) // 2
        token_ids = packed_BC[:, 0].long().tolist()
        top_ids = packed_BC[:, 2 : 2 + k].long().tolist()
        return token_ids, packed_BC[:, 1].tolist(), top_ids, packed_BC[:, 2 + k :].tolist()


def sample(
    logits_BV: Tensor,
    tensors: SamplingTensors,
    keys_B: Tensor | None,
    banned_ids: Tensor | None = None,
    step: StepLogits | None = None,
) -> SamplerOutput:
    """Choose one token per row of `logits_BV`.

    `keys_B` holds each row's key (`row_keys`; None when every row is greedy), all a sampled
    row's randomness: on CPU the row takes the token where its distribution's cumulative sum
    passes the key's uniform number, where the Triton kernels run the token that wins a race
    with noise hashed from the key (kernels/race.py). The same key gives the same token
    whatever else is in the batch. `banned_ids` are never chosen (media placeholders: a
    sampled one would claim media features that do not exist); like the filters, banning
    leaves the reported logprobs as they are. `step` holds the step's penalty counts,
    stop-token bans and grammar masks (see `adjust_logits`).
    """
    logits_BV = logits_BV.float()
    logprobs_BV = None  # no row asked: skip a (rows x vocab) write and read, report zeros
    if tensors.tempered_logprobs:
        logprobs_BV = torch.log_softmax(logits_BV / tensors.logprob_temperature_B[:, None], dim=-1)
    elif tensors.any_logprobs:
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    logits_BV = adjust_logits(logits_BV, tensors, banned_ids, step)
    if tensors.all_greedy:
        token_ids_B = logits_BV.argmax(dim=-1)
    else:
        assert keys_B is not None and len(keys_B) == len(logits_BV), "one key a row"
        token_ids_B = _draw(logits_BV, tensors, keys_B)
    if logprobs_BV is None:
        logprobs_B = torch.zeros_like(token_ids_B, dtype=torch.float32)
    else:
        logprobs_B = logprobs_BV.gather(-1, token_ids_B[:, None]).squeeze(-1)
    if tensors.num_top_logprobs:
        top_logprobs_BK, top_ids_BK = logprobs_BV.topk(tensors.num_top_logprobs, dim=-1)
    else:
        top_ids_BK = token_ids_B.new_empty((len(token_ids_B), 0))
        top_logprobs_BK = logprobs_B.new_empty((len(token_ids_B), 0))
    return SamplerOutput(token_ids_B, logprobs_B, top_ids_BK, top_logprobs_BK)


def adjust_logits(
    logits_BV: Tensor,
    tensors: SamplingTensors,
    banned_ids: Tensor | None = None,
    step: StepLogits | None = None,
) -> Tensor:
    """The logits tokens are drawn from: biased, penalised, with banned and (last) grammar-
    forbidden tokens at -inf. Out of place: `logits_BV` may be the model's own (or a view
    repeated over a prompt's n rows)."""
    if tensors.bias_rows_N is not None:
        logits_BV = logits_BV.index_put(
            (tensors.bias_rows_N, tensors.bias_ids_N), tensors.bias_N, accumulate=True
        )
    if tensors.penalty_rows_P is not None and step is not None and step.seen is not None:
        rows_P = tensors.penalty_rows_P
        penalised_PV = apply_penalties(
            logits_BV[rows_P],
            *step.seen,
            tensors.presence_P,
            tensors.frequency_P,
            tensors.repetition_P,
        )
        logits_BV = logits_BV.index_copy(0, rows_P, penalised_PV)
    if banned_ids is not None:
        logits_BV = logits_BV.index_fill(-1, banned_ids, float("-inf"))
    if step is None:
        return logits_BV
    if step.ban_rows_N is not None:
        logits_BV = logits_BV.index_put(
            (step.ban_rows_N, step.ban_ids_N), logits_BV.new_tensor(float("-inf"))
        )
    if step.grammar_rows_G is not None:
        rows_G = step.grammar_rows_G
        allowed_GV = allowed_tokens(step.bitmask_GW, logits_BV.shape[-1])
        logits_BV = logits_BV.index_copy(
            0, rows_G, logits_BV[rows_G].masked_fill(~allowed_GV, float("-inf"))
        )
    return logits_BV


# The tokens a row's top-p sees first where it has no top_k (on CPU, `_window_filter`): of Qwen3's
# 151,936, the best 1,024 hold all but a sliver of a trained model's mass.
TOP_P_WINDOW = 1024


def _filter(logits_BV: Tensor, tensors: SamplingTensors) -> Tensor:
    """Temperature-scaled logits with tokens removed (-inf) by top-k, then top-p, then min-p
    (the order Hugging Face applies them), where the kernels do not run (the kernels' draw is
    `_kernel_filtered_draw`).

    Top-k and top-p look at a row's tokens from the most likely down, which a sort of the whole
    vocabulary gives (on 2 CPU cores 64 rows of 151,936 tokens take about half a second; on an
    H100 1.7 ms). Where every sampled row's filters stop within its best W tokens, those W
    (`topk`) are enough: W the largest top_k where every top-p row has a top_k, else, on CPU,
    TOP_P_WINDOW, checked after (the rows without a top_k must find their top_p within it;
    else the whole sort runs: the check reads one number back, which on CPU costs nothing and
    on a GPU would wait for the step)."""
    if tensors.use_top_k or tensors.use_top_p:
        vocab_size = logits_BV.shape[-1]
        if tensors.top_k_bounds_top_p:
            width = tensors.max_top_k
        elif logits_BV.device.type == "cpu":
            width = max(TOP_P_WINDOW, tensors.max_top_k)
        else:
            width = vocab_size
        filtered_BV = None
        if width < vocab_size:
            filtered_BV = _window_filter(logits_BV, tensors, width)
        logits_BV = _sorted_filter(logits_BV, tensors) if filtered_BV is None else filtered_BV
    if tensors.use_min_p:
        probs_BV = logits_BV.softmax(dim=-1)
        floor_B1 = tensors.min_p_B[:, None] * probs_BV.amax(dim=-1, keepdim=True)
        logits_BV = logits_BV.masked_fill(probs_BV < floor_B1, float("-inf"))
    return logits_BV


def _top_k_and_p(sorted_BW: Tensor, tensors: SamplingTensors, lse_B: Tensor | None) -> Tensor:
    """Which of each row's tokens, sorted from the most likely down, top-k and top-p remove.
    Top-p's probabilities are over the tokens top-k left (`lse_B`: a row's log normalizer
    where that is not them alone: a row without a top_k, seen through a window)."""
    width = sorted_BW.shape[-1]
    remove_BW = torch.zeros_like(sorted_BW, dtype=torch.bool)
    if tensors.use_top_k:
        ranks_W = torch.arange(width, device=sorted_BW.device)
        top_k_B = torch.where(tensors.top_k_B > 0, tensors.top_k_B, width)
        remove_BW |= ranks_W[None, :] >= top_k_B[:, None]
    if tensors.use_top_p:
        kept_BW = sorted_BW.masked_fill(remove_BW, float("-inf"))
        normalized_BW = kept_BW.log_softmax(dim=-1) if lse_B is None else kept_BW - lse_B[:, None]
        probs_BW = normalized_BW.exp()
        mass_before_BW = probs_BW.cumsum(dim=-1) - probs_BW
        # Keep the smallest prefix reaching top_p (the first token always stays); rows with
        # top_p == 1 are exempt so float error in the cumsum never trims their tail.
        remove_BW |= (mass_before_BW > tensors.top_p_B[:, None]) & (tensors.top_p_B < 1)[:, None]
    return remove_BW


def _sorted_filter(logits_BV: Tensor, tensors: SamplingTensors) -> Tensor:
    """Top-k and top-p over each row's whole vocabulary, sorted."""
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
    remove_BV = _top_k_and_p(sorted_BV, tensors, None)
    # Back from sorted order to vocab order, so the noise below is drawn per vocab entry and
    # does not depend on how ties happened to sort.
    remove_vocab_BV = torch.empty_like(remove_BV).scatter_(-1, order_BV, remove_BV)
    return logits_BV.masked_fill(remove_vocab_BV, float("-inf"))


def _window_filter(logits_BV: Tensor, tensors: SamplingTensors, width: int) -> Tensor | None:
    """Top-k and top-p over each row's best `width` tokens, everything past them removed; a row
    with neither filter keeps its whole row. None where a row without a top_k would keep tokens
    past the window (its best `width` hold no more than its top_p)."""
    best_BW, ids_BW = logits_BV.topk(width, dim=-1)
    lse_B = None
    has_k_B = tensors.top_k_B > 0
    if not tensors.top_k_bounds_top_p:
        # A row without a top_k normalizes over its whole row, not the window.
        window_lse_B = best_BW.masked_fill(
            torch.arange(width, device=best_BW.device)[None, :] >= tensors.top_k_B[:, None],
            float("-inf"),
        ).logsumexp(dim=-1)
        lse_B = torch.where(has_k_B, window_lse_B, logits_BV.logsumexp(dim=-1))
        window_mass_B = (best_BW - lse_B[:, None]).exp().sum(dim=-1)
        short_B = ~has_k_B & (tensors.top_p_B < 1) & (window_mass_B <= tensors.top_p_B)
        if bool(short_B.any()):
            return None
    remove_BW = _top_k_and_p(best_BW, tensors, lse_B)
    kept_BV = torch.full_like(logits_BV, float("-inf"))
    kept_BV.scatter_(-1, ids_BW, best_BW.masked_fill(remove_BW, float("-inf")))
    unfiltered_B = ~has_k_B & (tensors.top_p_B >= 1)
    return torch.where(unfiltered_B[:, None], logits_BV, kept_BV)


def _draw(logits_BV: Tensor, tensors: SamplingTensors, keys_B: Tensor) -> Tensor:
    """Each row's token: the argmax for a greedy row, else drawn with its key from its
    filtered, tempered distribution. Where the Triton kernels run, the race does it in two
    launches (the temperature inside them when no row filters); a top-p without a top_k, or a
    min-p, races within the filter instead of sorting the row (`_kernel_filtered_draw`)."""
    filters = tensors.use_top_k or tensors.use_top_p or tensors.use_min_p
    if use_triton(logits_BV) and not filters:
        return race(logits_BV, keys_B, tensors.greedy_B, tensors.temperature_B)
    if use_triton(logits_BV):
        return _kernel_filtered_draw(logits_BV / tensors.temperature_B[:, None], tensors, keys_B)
    filtered_BV = _filter(logits_BV / tensors.temperature_B[:, None], tensors)
    greedy_B = logits_BV.argmax(dim=-1)
    token_ids_B = _inverse_cdf(filtered_BV, key_uniforms(keys_B), greedy_B)
    if tensors.any_greedy:
        token_ids_B = torch.where(tensors.greedy_B, greedy_B, token_ids_B)
    return token_ids_B


def _kernel_filtered_draw(tempered_BV: Tensor, tensors: SamplingTensors, keys_B: Tensor) -> Tensor:
    """The kernels' draw under filters, with no sort and no read back. Rows with a top_k are
    filtered over their best `max_top_k` tokens (`_window_filter`; their top_p there too,
    over the tokens the top_k keeps); the rest of the filtering is the race's own: a top-p
    without a top_k, and min-p, by `filtered_race`, which races within what they keep."""
    by_race = tensors.use_min_p or (tensors.use_top_p and not tensors.top_k_bounds_top_p)
    with_k_B = tensors.top_k_B > 0
    if tensors.use_top_k:
        # The rows without a top_k pass through whole: their top_p is the race's.
        top_k_rows = replace(
            tensors,
            top_p_B=torch.where(with_k_B, tensors.top_p_B, 1.0),
            top_k_bounds_top_p=True,
        )
        width = tensors.max_top_k
        if width < tempered_BV.shape[-1]:
            tempered_BV = _window_filter(tempered_BV, top_k_rows, width)
        else:
            tempered_BV = _sorted_filter(tempered_BV, top_k_rows)
    if not by_race:
        return race(tempered_BV, keys_B, tensors.greedy_B)  # the filters keep each row's argmax
    # A row with a top_k had its top_p in the window.
    top_p_B = torch.where(with_k_B, 1.0, tensors.top_p_B) if tensors.use_top_k else tensors.top_p_B
    return filtered_race(
        tempered_BV.contiguous(), keys_B, tensors.greedy_B, top_p_B, tensors.min_p_B
    )


def _inverse_cdf(logits_BV: Tensor, uniforms_B: Tensor, greedy_B: Tensor) -> Tensor:
    """Draw from softmax(logits) per row: the first token whose cumulative probability exceeds
    the row's uniform number times the row's total. The sum runs in float64, so a token's
    chance is its float32 probability to within about 1e-16 even over a 262k vocabulary. A
    token the filters removed has probability 0 and is never the first to exceed; where
    rounding leaves no token above (a uniform number within 2**-53 of 1), the row takes its
    most likely token, `greedy_B` (every filter keeps it)."""
    probs_BV = logits_BV.softmax(dim=-1)
    cumulative_BV = probs_BV.cumsum(dim=-1, dtype=torch.float64)
    targets_B1 = uniforms_B.to(torch.float64)[:, None] * cumulative_BV[:, -1:]
    chosen_B = torch.searchsorted(cumulative_BV, targets_B1, right=True).squeeze(-1)
    chosen_B = chosen_B.clamp_max_(logits_BV.shape[-1] - 1)
    drawable_B = probs_BV.gather(-1, chosen_B[:, None]).squeeze(-1) > 0
    return torch.where(drawable_B, chosen_B, greedy_B)
