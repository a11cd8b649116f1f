"""Several trajectories in one trainer forward: which may share one, and their batch tensors.

A step's trajectories are split into `grpo.mini_batches` mini-batches (one optimizer step each)
and each mini-batch into micro-batches of at most `trainer.micro_batch_tokens` tokens, counted
as the forward pays for them: rows x the longest row. Trajectories are placed longest first, so
a micro-batch holds rows of similar length and padding stays a small share. Rows are
right-padded: every row keeps the positions, masks and media it has alone.

Where the trainer packs (`areno.train.packing`; every supported family, once its check passes),
a row holds a whole GRPO group's episodes instead, their shared prompt once (`plan_rows`), and a
micro-batch is counted as rows x the longest packed row.

Otherwise media tensors batch the way the processor batches prompts: concatenated along their
first dimension (patches, images, frames, clips). Trajectories with media share a forward only with
their own GRPO group (whose prompt media the frozen towers then encode once) and only when their
media tensors line up; a family whose forward cannot take several prompts' media
(`FamilyAdapter.batched_media`) runs its media trajectories alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from areno.processing.types import PromptInputs
from areno.train.packing import is_per_token, row_length


@dataclass
class MiniBatch:
    """One rank's part of one optimizer step: micro-batches of (trajectory, advantage) pairs,
    and the counts over every rank that the batch-level loss is normalised by."""

    micro: list[list[tuple[Any, float]]] = field(default_factory=list)
    tokens: int = 0  # generated tokens of the mini-batch on all ranks
    episodes: int = 0  # trajectories of the mini-batch on all ranks
    version: int | None = None  # the policy version being trained (None: not tracked)
    # packed passes (`plan_rows`): each micro-batch's rows, as the sizes of consecutive runs of
    # its pairs; None: every trajectory is a row of its own
    rows: list[list[int]] | None = None
    # the last `num_fillers` micro-batches are fillers: a copy of a trajectory, weighted 0, run
    # where a rank has fewer trajectories than another rank has passes, so that its backward
    # passes still reduce with the other ranks' (`plan_step`)
    num_fillers: int = 0

    def is_filler(self, index: int) -> bool:
        return index >= len(self.micro) - self.num_fillers


# name -> (shape past the first dimension, dtype) of a trajectory's media tensors
Signature = dict[str, tuple[tuple[int, ...], torch.dtype]]


def signature(inputs: PromptInputs) -> Signature:
    n = inputs.num_prompt_tokens
    return {
        name: (tuple(value.shape[1:]), value.dtype)
        for name, value in inputs.mm_inputs.items()
        if not is_per_token(value, n)
    }


def compatible(a: Signature, b: Signature) -> bool:
    return all(b[name] == spec for name, spec in a.items() if name in b)


def plan_micro_batches(
    inputs: Sequence[PromptInputs],
    budget: int,
    *,
    groups: Sequence[Any] | None = None,
    batched_media: bool = True,
) -> list[list[int]]:
    """Indices into `inputs`, grouped into micro-batches of at most `budget` padded tokens
    (first fit, longest first; a trajectory longer than the budget runs alone; budget 0: one
    trajectory per micro-batch).

    A trajectory with media shares a pass only with others of its group (`groups[i]`; by
    default, trajectories with the same media items): a GRPO group's episodes share their
    prompt's media, which the frozen towers then encode once for all the group's passes
    (`Learner.features` keys tower outputs by a pass's media items), and only when their media
    tensors line up (`compatible`). Text-only trajectories share passes freely."""
    order = sorted(range(len(inputs)), key=lambda i: (-inputs[i].num_prompt_tokens, i))
    if budget <= 0:
        return [[i] for i in order]
    batches: list[tuple[list[int], Any, Signature]] = []
    for i in order:
        item = inputs[i]
        sig = signature(item)
        if not item.mm_spans:
            key = None
        else:
            key = groups[i] if groups is not None else tuple(s.content_hash for s in item.mm_spans)
        alone = key is not None and not batched_media
        for members, shared_key, shared in batches if not alone else ():
            longest = inputs[members[0]].num_prompt_tokens  # placed longest first
            fits = (len(members) + 1) * longest <= budget
            if fits and shared_key == key and compatible(shared, sig):
                members.append(i)
                shared.update(sig)
                break
        else:
            batches.append(([i], key, dict(sig)))
    return [members for members, _, _ in batches]


def plan_rows(
    inputs: Sequence[PromptInputs], budget: int, keys: Sequence[Any]
) -> list[list[list[int]]]:
    """Packed passes: micro-batches of rows of indices into `inputs`. The trajectories of one
    key (a GRPO group's sample id; None: alone) make one row (`packing.row_length` tokens),
    halved until it fits `budget`; rows fill micro-batches of at most `budget` padded tokens
    (rows x the longest, first fit, longest first). Budget 0: one trajectory per pass."""
    if budget <= 0:
        order = sorted(range(len(inputs)), key=lambda i: (-inputs[i].num_prompt_tokens, i))
        return [[[i]] for i in order]
    by_key: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(("alone", i) if key is None else key, []).append(i)
    pending, rows = list(by_key.values()), []
    while pending:
        members = pending.pop(0)
        if len(members) > 1 and row_length([inputs[i] for i in members]) > budget:
            half = len(members) // 2
            pending[:0] = [members[:half], members[half:]]
        else:
            rows.append((row_length([inputs[i] for i in members]), members))
    rows.sort(key=lambda row: (-row[0], row[1][0]))
    batches: list[tuple[int, list[list[int]]]] = []  # (longest row, rows)
    for length, members in rows:
        for longest, placed in batches:
            if (len(placed) + 1) * longest <= budget:
                placed.append(members)
                break
        else:
            batches.append((length, [members]))
    return [placed for _, placed in batches]


def split_rows_to(batches: list[list[list[int]]], count: int) -> list[list[list[int]]]:
    """`batches` (micro-batches of rows) split further until there are `count` of them, so that
    every rank runs the same number of backward passes: the one with the most trajectories
    splits its rows in two, or a lone row its members; `count` is at most the number of
    trajectories."""
    batches = [[list(row) for row in rows] for rows in batches]
    while len(batches) < count:
        largest = max(range(len(batches)), key=lambda j: sum(map(len, batches[j])))
        rows = batches.pop(largest)
        if len(rows) > 1:
            half = len(rows) // 2
            parts = [rows[:half], rows[half:]]
        else:
            half = len(rows[0]) // 2
            parts = [[rows[0][:half]], [rows[0][half:]]]
        batches[largest:largest] = parts
    return batches


def plan_step(
    pairs: Sequence[tuple[Any, float]],
    world_size: int,
    mini_batches: int,
    budget: int,
    *,
    batched_media: bool = True,
    version: int | None = None,
    packs: bool = False,
) -> list[list[MiniBatch]]:
    """Each rank's mini-batches of a step's (trajectory, advantage) pairs. Every pair is
    trained, however many a step kept (skipped samples shrink it): mini-batch m is the m-th of
    `mini_batches` contiguous parts of `pairs`, as even as they can be (whole groups stay
    together where they divide evenly; never more parts than pairs), each split over the
    ranks as evenly as it can be, and each rank's part planned into micro-batches (`packs`: of
    packed rows, `plan_rows`). Every rank gets the same number of micro-batches per mini-batch
    (their backward passes reduce together); a rank with fewer pairs than that runs fillers
    (`MiniBatch.num_fillers`)."""
    shares: list[list[MiniBatch]] = [[] for _ in range(world_size)]
    num_parts = min(mini_batches, len(pairs))
    for m in range(num_parts):
        part = list(pairs[_bound(m, len(pairs), num_parts) : _bound(m + 1, len(pairs), num_parts)])
        tokens = sum(traj.num_generated_tokens for traj, _ in part)
        per_rank = [
            part[_bound(r, len(part), world_size) : _bound(r + 1, len(part), world_size)]
            for r in range(world_size)
        ]
        plans = [_plan(own, budget, packs, batched_media) for own in per_rank]
        count = max(len(plan) for plan in plans)
        for rank, (own, plan) in enumerate(zip(per_rank, plans, strict=True)):
            mini = _mini_batch(own, plan, count, part[0])
            mini.tokens, mini.episodes, mini.version = tokens, len(part), version
            if not packs:
                mini.rows = None
            shares[rank].append(mini)
    return shares


def _plan(own: list, budget: int, packs: bool, batched_media: bool) -> list[list[list[int]]]:
    """Micro-batches of rows of indices into `own`: packed rows (`plan_rows`), or one
    trajectory a row (`plan_micro_batches`)."""
    inputs = [traj.inputs for traj, _ in own]
    if packs:
        return plan_rows(inputs, budget, [_row_key(traj) for traj, _ in own])
    batches = plan_micro_batches(inputs, budget, batched_media=batched_media)
    return [[[i] for i in members] for members in batches]


def _row_key(traj: Any) -> Any:
    """The trajectories that share a packed row: a GRPO group's episodes (its sample id), the
    parts of an agent program's split episodes by part (the group's first calls share their
    prompt, its later calls theirs; a row of both would share nothing and hold them all)."""
    return None if traj.sample_id is None else (traj.sample_id, traj.part)


def _mini_batch(own: list, plan: list[list[list[int]]], count: int, spare) -> MiniBatch:
    """One rank's `count` micro-batches of its pairs `own` planned as `plan` (micro-batches of
    rows of indices), split until there are `count` where it has as many pairs, then fillers
    (copies of `spare`)."""
    batches = split_rows_to(plan, min(count, len(own))) if own else []
    micro = [[own[i] for row in rows for i in row] for rows in batches]
    rows = [[len(row) for row in rows] for rows in batches]
    num_fillers = count - len(micro)
    micro += [[spare]] * num_fillers
    rows += [[1]] * num_fillers
    return MiniBatch(micro, rows=rows, num_fillers=num_fillers)


def _bound(i: int, n: int, parts: int) -> int:
    """Where part i of n items cut into `parts` near-equal contiguous parts starts."""
    return i * n // parts


def collate(batch: Sequence[PromptInputs]) -> dict[str, torch.Tensor]:
    """The model inputs of several prompts as one right-padded batch: ids, attention mask and
    per-token tensors padded with 0 to the longest, media tensors concatenated in row order."""
    length = max(item.num_prompt_tokens for item in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    mask = torch.zeros(len(batch), length, dtype=torch.long)
    per_token: dict[str, torch.Tensor] = {}
    media: dict[str, list[torch.Tensor]] = {}
    for row, item in enumerate(batch):
        n = item.num_prompt_tokens
        ids[row, :n] = torch.tensor(item.input_ids, dtype=torch.long)
        mask[row, :n] = 1
        for name, value in item.mm_inputs.items():
            if is_per_token(value, n):
                if name not in per_token:
                    per_token[name] = torch.zeros(len(batch), length, dtype=value.dtype)
                per_token[name][row, :n] = value[0]
            else:
                media.setdefault(name, []).append(value)
    joined = {name: torch.cat(values) for name, values in media.items()}
    return {"input_ids": ids, "attention_mask": mask, **per_token, **joined}
