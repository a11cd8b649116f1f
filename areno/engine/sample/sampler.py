"""Token sampling on the device: temperature, top-k, top-p, min-p, per-row seeds, logprobs,
and what changes the logits before them: logit biases, repetition penalties, banned tokens
(media placeholders, stop tokens before `min_tokens`) and grammar masks.

Everything is batched over rows (one row per sequence of the step) and stays on the device:
`sample` never calls `.item()` or reads a tensor on the host, so the engine copies the small
`SamplerOutput` to the host once per step. Filtering sorts each row once and never loops over rows;
only seeded rows loop, to draw their noise from their own generator.

NOTE: logprobs are the log-softmax of the RAW logits (temperature 1, before top-k / top-p / min-p),
at the chosen token and for the top-K list: the model's own distribution, as OpenAI-style clients
expect. A row with `logprobs_mode="tempered"` reports the logits divided by its temperature
instead (still before the filters): the distribution its tokens were drawn from, short of the
filters, which is what a GRPO trainer recomputes (as verl does) when rollouts sample at T != 1.
Biases, penalties, bans and grammars apply after the logprobs are taken, so they never show in
them either (OpenAI reports the model's own logprobs under `logit_bias` too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from areno.engine.outputs.grammar import allowed_tokens
from areno.engine.sample.penalties import apply_penalties
from areno.engine.sampling import MAX_SEED, SamplingParams
from areno.engine.transfer import to_device


def generator_for(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator on `device` seeded with `seed` (any int; wrapped into torch's range)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (MAX_SEED + 1))
    return generator


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
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    tempered_logprobs: bool
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
            use_top_k=any(p.top_k > 0 for p in sampled),
            use_top_p=any(p.top_p < 1 for p in sampled),
            use_min_p=any(p.min_p > 0 for p in sampled),
            tempered_logprobs=any(_logprob_temperature(p) != 1.0 for p in params_list),
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
    generators: list[torch.Generator | None],
    banned_ids: Tensor | None = None,
    step: StepLogits | None = None,
) -> SamplerOutput:
    """Choose one token per row of `logits_BV`.

    `generators[i]` is row i's own generator (a seeded sequence) or None (the device's default
    generator). A seeded row draws the same tokens whatever else is in the batch. `banned_ids`
    are never chosen (media placeholders: a sampled one would claim media features that do not
    exist); like the filters, banning leaves the reported logprobs as they are. `step` holds
    the step's penalty counts, stop-token bans and grammar masks (see `adjust_logits`).
    """
    assert len(generators) == logits_BV.shape[0], "one generator (or None) per row"
    logits_BV = logits_BV.float()
    logprobs_BV = None  # no row asked: skip a (rows x vocab) write and read, report zeros
    if tensors.tempered_logprobs:
        logprobs_BV = torch.log_softmax(logits_BV / tensors.logprob_temperature_B[:, None], dim=-1)
    elif tensors.any_logprobs:
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    logits_BV = adjust_logits(logits_BV, tensors, banned_ids, step)
    greedy_B = logits_BV.argmax(dim=-1)
    if tensors.all_greedy:
        token_ids_B = greedy_B
    else:
        filtered_BV = _filter(logits_BV / tensors.temperature_B[:, None], tensors)
        sampled_B = _exponential_race(filtered_BV, generators)
        token_ids_B = torch.where(tensors.greedy_B, greedy_B, sampled_B)
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


def _filter(logits_BV: Tensor, tensors: SamplingTensors) -> Tensor:
    """Temperature-scaled logits with tokens removed (-inf) by top-k, then top-p, then min-p
    (the order Hugging Face applies them)."""
    if tensors.use_top_k or tensors.use_top_p:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        vocab_size = logits_BV.shape[-1]
        remove_BV = torch.zeros_like(sorted_BV, dtype=torch.bool)
        if tensors.use_top_k:
            ranks_V = torch.arange(vocab_size, device=logits_BV.device)
            top_k_B = torch.where(tensors.top_k_B > 0, tensors.top_k_B, vocab_size)
            remove_BV |= ranks_V[None, :] >= top_k_B[:, None]
        if tensors.use_top_p:
            probs_BV = sorted_BV.masked_fill(remove_BV, float("-inf")).softmax(dim=-1)
            mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
            # Keep the smallest prefix reaching top_p (the first token always stays); rows with
            # top_p == 1 are exempt so float error in the cumsum never trims their tail.
            remove_BV |= (mass_before_BV > tensors.top_p_B[:, None]) & (tensors.top_p_B < 1)[
                :, None
            ]
        # Back from sorted order to vocab order, so the noise below is drawn per vocab entry and
        # does not depend on how ties happened to sort.
        remove_vocab_BV = torch.empty_like(remove_BV).scatter_(-1, order_BV, remove_BV)
        logits_BV = logits_BV.masked_fill(remove_vocab_BV, float("-inf"))
    if tensors.use_min_p:
        probs_BV = logits_BV.softmax(dim=-1)
        floor_B1 = tensors.min_p_B[:, None] * probs_BV.amax(dim=-1, keepdim=True)
        logits_BV = logits_BV.masked_fill(probs_BV < floor_B1, float("-inf"))
    return logits_BV


def _exponential_race(logits_BV: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """Draw from softmax(logits) per row as argmax(probs / E) with E ~ Exponential(1): the
    smallest of independent exponential clocks with rates `probs` wins with probability equal to
    its rate. Unlike torch.multinomial, the noise can come from a different generator per row."""
    probs_BV = logits_BV.softmax(dim=-1)
    noise_BV = torch.empty_like(probs_BV)
    if any(g is None for g in generators):
        noise_BV.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise_BV[row].exponential_(generator=generator)
    # A zero draw would give inf (or 0/0 = nan for a removed token); clamp keeps argmax sound.
    noise_BV.clamp_min_(torch.finfo(noise_BV.dtype).tiny)
    return probs_BV.div_(noise_BV).argmax(dim=-1)
