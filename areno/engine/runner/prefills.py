"""Every prefill of a step, planned in one place: which items share a forward and how each runs.

A step's `PrefillItem`s are whole prompts, chunks of long prompts and resumptions from the prefix
cache. Whole prompts without media share right-padded forwards (`ModelRunner.prefill_batch`)
in groups whose padding stays within MAX_PREFILL_PADDING (`prefill_groups`), a lone one too where
that forward is compiled, or, where the engine asks (`whole_prompts_as_parts`), run as parts
from their first token in the forward of parts below, whose compiled graph then serves both; a
prompt with media runs alone (`ModelRunner.prefill`). Chunks and resumptions run over the keys
their blocks hold, several in one forward (`ModelRunner.prefill_parts`), or one at a time under
tensor parallelism (`ModelRunner.prefill_chunk`); state saves midway split an item into rounds.
An item of several samples is forked into their slots once its prompt is done.
"""

from __future__ import annotations

import torch

from areno.engine.runner.batched_prefill import PromptPart, can_batch_prefill
from areno.engine.runner.model_runner import ModelRunner
from areno.engine.step import PrefillItem

# A padded prefill group computes at most this many tokens per real one.
MAX_PREFILL_PADDING = 1.25


def prefill_groups(lengths: list[int], *, pad: bool) -> list[list[int]]:
    """Indices into `lengths` (prompt lengths), grouped to share prefill forwards. Without `pad`
    a group holds equal lengths; with it, lengths in ascending order join a group while its
    padded size (rows x longest) stays within MAX_PREFILL_PADDING of its real tokens."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        group = groups[-1] if groups else None
        if group is not None and (
            lengths[i] == lengths[group[-1]]
            or (pad and (len(group) + 1) * lengths[i] <= MAX_PREFILL_PADDING * (real + lengths[i]))
        ):
            group.append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def run_prefills(
    runner: ModelRunner,
    items: list[PrefillItem],
    *,
    share_parts: bool,
    whole_as_parts: bool = False,
) -> list[torch.Tensor]:
    """Run a step's prefills on `runner` (its slots' adapters already assigned): each item's
    resume point restored and its tail block copied first, then the forwards. Returns each
    final item's last logits, repeated for its n rows, in item order (a chunk that does not end
    its prompt has none). Whole prompts without media share forwards (`prefill_groups`); so do
    chunks and resumptions from the prefix cache where `share_parts` (`_prefill_parts`; not
    under tensor parallelism), else each runs alone (`_prefill_chunks`). With `whole_as_parts`
    (and `share_parts`) whole prompts without media of two tokens or more run as parts from
    their first token too, so the batched prefill's forward never runs."""
    for item in items:  # before any prefill writes a block
        if item.copy_block is not None:
            runner.copy_block(*item.copy_block)
        if item.restore_row is not None:
            runner.restore_state(item.restore_row, item.slots[0])
    last: list[torch.Tensor | None] = [None] * len(items)
    batchable, parts = [], []
    for i, item in enumerate(items):
        if item.is_chunk or item.saves:
            if share_parts:
                parts.append(i)
            else:
                last[i] = _prefill_chunks(runner, item)
        elif can_batch_prefill(item.inputs):
            # NOTE: not a one-token prompt (the start-up's cache allocation): it runs uncompiled
            # (`batches_lone`), as it did beside the batched prefill.
            as_part = share_parts and whole_as_parts and item.inputs.num_prompt_tokens > 1
            (parts if as_part else batchable).append(i)
        else:
            last[i] = runner.prefill(item.inputs, item.slots, item.block_tables)
    lengths = [items[i].inputs.num_prompt_tokens for i in batchable]
    for group in prefill_groups(lengths, pad=runner.can_pad_prefill):
        indices = [batchable[g] for g in group]
        if len(indices) == 1 and not runner.batches_lone(lengths[group[0]]):
            item = items[indices[0]]
            last[indices[0]] = runner.prefill(item.inputs, item.slots, item.block_tables)
            continue
        tables = [items[i].block_tables for i in indices]
        logits_BV = runner.prefill_batch(
            [items[i].inputs for i in indices],
            [items[i].slots for i in indices],
            tables if all(t is not None for t in tables) else None,
        )
        for row, i in enumerate(indices):
            last[i] = logits_BV[row]
    for i, logits_V in zip(parts, _prefill_parts(runner, [items[i] for i in parts]), strict=True):
        last[i] = logits_V
    return [
        v.expand(len(item.slots), -1) for v, item in zip(last, items, strict=True) if item.is_final
    ]


def _prefill_parts(runner: ModelRunner, items: list[PrefillItem]) -> list[torch.Tensor]:
    """Each item's last logits (V,), its tokens start..end-1 prefilled over the keys its
    blocks hold, in forwards shared by items of lengths within MAX_PREFILL_PADDING of each
    other (`ModelRunner.prefill_parts`). An item with state saves runs in rounds: up to its
    first save, which is made, on to the next, and so on (as `_prefill_chunks` does), its last
    round beside every other item's last; an item that ends its prompt is then forked into its
    other slots."""
    planned = [_rounds(runner, item) for item in items]
    depth = max((len(bounds) - 1 for bounds, _ in planned), default=0)
    rounds: list[list[tuple[int, PromptPart]]] = [[] for _ in range(depth)]
    saves_after: list[list[tuple[int, int]]] = [[] for _ in range(depth)]
    for i, (item, (bounds, saves)) in enumerate(zip(items, planned, strict=True)):
        table = item.block_tables[0] if item.block_tables else None
        # An item's rounds end with the last: a resumption's one part runs beside the last part
        # of a prompt that stops at a save first (a color quiz step's first prompts of their
        # groups and the rest of each group then share their tail forward).
        late = depth - (len(bounds) - 1)
        for number, (start, stop) in enumerate(zip(bounds, bounds[1:], strict=False)):
            first = number == 0 and item.start == item.cached
            part = PromptPart(item.inputs, item.slots[0], table, start, stop, first)
            rounds[late + number].append((i, part))
            saves_after[late + number] += [(item.slots[0], row) for row in saves.get(stop, [])]
    last: list[torch.Tensor | None] = [None] * len(items)
    for parts, saves in zip(rounds, saves_after, strict=True):
        for group in prefill_groups([p.end - p.start for _, p in parts], pad=True):
            logits_BV = runner.prefill_parts([parts[g][1] for g in group])
            for row, g in enumerate(group):
                last[parts[g][0]] = logits_BV[row]
        if saves:
            runner.save_states(saves)
    for item in items:
        if len(item.slots) > 1 and item.is_final:
            runner.fork_prompt(item.slots, item.block_tables, item.inputs.num_prompt_tokens)
    return last


def _prefill_chunks(runner: ModelRunner, item: PrefillItem) -> torch.Tensor:
    """An item's tokens start..end as one chunk, or as several around its state saves."""
    table = item.block_tables[0] if item.block_tables else None
    bounds, saves = _rounds(runner, item)
    for start, stop in zip(bounds, bounds[1:], strict=False):
        last = runner.prefill_chunk(item.inputs, item.slots[0], table, start, stop, item.cached)
        if stop in saves:
            runner.save_states([(item.slots[0], row) for row in saves[stop]])
    if len(item.slots) > 1:
        runner.fork_prompt(item.slots, item.block_tables, bounds[-1])
    return last


def _rounds(runner: ModelRunner, item: PrefillItem) -> tuple[list[int], dict[int, list[int]]]:
    """Where an item's prefill stops: its bounds [start, ..., end], and the saved-state rows
    each stop saves. A linear-attention state must be saved where the prefill stands, so the
    prefill stops at each save. A sliding ring holds a window and a block, so a save within a
    block of the end is made at the end (a resumption there reads only the window before it);
    an earlier one stops the prefill too."""
    end = item.end if item.end is not None else item.inputs.num_prompt_tokens
    saves: dict[int, list[int]] = {}
    for position, row in item.saves:
        late = not runner.has_linear_state and end - position <= runner.block_size
        saves.setdefault(end if late else position, []).append(row)
    bounds = [item.start, *sorted(p for p in saves if item.start < p < end), end]
    return bounds, saves
