"""A GRPO group's episodes in one row of a trainer forward: the prompt they share once, then each
episode's own tokens after it (`shared_length`, `packed_logprobs`).

A group's episodes start from the same prompt (its media, the question, the tool schemas) and
part at their first sampled token; in a multimodal agent task the prompt is most of every
episode (the AVE example: ~1,700 of ~2,000 tokens). Trained one episode per row, the stack runs
over that prompt once per episode. Packed, a row holds [shared | rest 1 | rest 2 | ...]: every
rest sits at its episode's own positions, its queries attend to the shared tokens and to their
own causally (sliding layers within their window; Gemma 4's vision runs both ways, as the model
marks them), never to another rest. The shared tokens' hidden states, and their logits where an
episode's loss reads them, feed every episode's loss, so the gradient is the one the separate
rows give. Rows of several groups are right-padded into one batch.

The stack's inputs (embeddings with the media features merged, Qwen's multimodal positions,
Gemma's per-layer inputs, Qwen3-VL's deepstack features) come from one forward over the row where
no rest holds media, else from each episode's own forward, stopped where it reaches the text
stack; frozen towers answer from the trainer's encoder cache.
A linear-attention layer (Qwen3.5's gated delta net, also MiniCPM-V 4.6's stack) carries one
state through a sequence, which a mask cannot branch: in a packed row it runs segment by
segment (`_Branch`), the shared tokens from zero states, then each rest from the conv inputs and
recurrent state the shared tokens ended with, the gradient flowing back through those states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from areno.engine.runner.batched_prefill import stack_rows
from areno.engine.runner.prompt_chunks import (
    StagedPrompt,
    at_text_stack,
    bidirectional_groups,
    patched_forward,
)
from areno.processing.types import PromptInputs
from areno.train.grpo import token_logprobs
from areno.train.lora import base_model

ATTENTION_LAYERS = ("full_attention", "sliding_attention")
LINEAR_LAYERS = "linear_attention"


def shared_length(items: Sequence[PromptInputs]) -> int:
    """How many first tokens `items` share: equal ids, and every media item among them the
    same item (position and content) and whole (a row cannot split an item's tokens)."""
    first = items[0]
    shared = min(item.num_prompt_tokens for item in items)
    for item in items[1:]:
        same = 0
        for a, b in zip(first.input_ids[:shared], item.input_ids[:shared], strict=True):
            if a != b:
                break
            same += 1
        shared = same
    spans = {(s.start, s.end, s.content_hash) for s in first.mm_spans}
    bound = None
    while bound != shared:
        bound = shared
        for item in items:
            for span in item.mm_spans:
                whole = span.end <= shared and (span.start, span.end, span.content_hash) in spans
                if span.start < shared and not whole:
                    shared = span.start
    return shared


def is_per_token(value: torch.Tensor, num_tokens: int) -> bool:
    """A tensor with one entry per prompt token, like Gemma's `mm_token_type_ids`."""
    return value.ndim == 2 and value.shape == (1, num_tokens)


def row_length(items: Sequence[PromptInputs]) -> int:
    """The tokens of `items` packed into one row: the shared ones once, then each one's rest."""
    shared = shared_length(items)
    return shared + sum(item.num_prompt_tokens - shared for item in items)


@dataclass(frozen=True)
class PackLayout:
    """What the packed rows' masks follow: the stack's layer kinds, the sliding window and
    whether vision runs attend both ways in sliding layers (Gemma 4); whether linear-attention
    layers run by segment."""

    layer_types: tuple[str, ...]
    window: int | None
    bidirectional_vision: bool

    @classmethod
    def of(cls, model: torch.nn.Module) -> PackLayout | None:
        """The layout of `model`'s text stack, or None when a layer is neither attention nor a
        linear-attention layer of the kind `_Branch` continues (`linear_attn` modules)."""
        config = base_model(model).config.get_text_config()
        kinds = tuple(getattr(config, "layer_types", None) or ("full_attention",))
        if not set(kinds) <= {*ATTENTION_LAYERS, LINEAR_LAYERS}:
            return None
        if LINEAR_LAYERS in kinds and len(linear_layers(model)) != kinds.count(LINEAR_LAYERS):
            return None
        window = getattr(config, "sliding_window", None) if "sliding_attention" in kinds else None
        vision = getattr(config, "use_bidirectional_attention", None) == "vision"
        return cls(kinds, window, vision)

    def masks(self, seg_BT, pos_BT, groups_BT, dtype: torch.dtype):
        """Additive masks (B, 1, T, T) of packed rows whose tokens sit in segments `seg_BT` (0:
        shared, k: the k-th rest, -1: a pad) at positions `pos_BT`, in bidirectional runs
        `groups_BT` (-1 outside one); a mapping by layer kind when the stack has sliding
        layers. A pad sees itself only (its output is never read)."""
        seg_q, seg_k = seg_BT[:, :, None], seg_BT[:, None, :]
        pos_q, pos_k = pos_BT[:, :, None], pos_BT[:, None, :]
        own = (seg_k == 0) & (seg_q >= 0) | (seg_k == seg_q) & (seg_q > 0)
        causal = own & (pos_k <= pos_q)
        pads = torch.eye(seg_BT.shape[1], dtype=torch.bool, device=seg_BT.device)
        pads = pads & (seg_q < 0)

        def additive(seen):
            return torch.where(seen | pads, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]

        full = additive(causal)
        if LINEAR_LAYERS in self.layer_types:  # they run by segment (`_Branch`), unmasked
            return {"full_attention": full, LINEAR_LAYERS: None}
        if self.window is None:
            return full
        seen = causal
        if self.bidirectional_vision:
            same = (groups_BT[:, :, None] == groups_BT[:, None, :]) & (groups_BT[:, :, None] >= 0)
            seen = seen | same
        sliding = additive(seen & (pos_k > pos_q - self.window))
        return {"full_attention": full, "sliding_attention": sliding}


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The text stack's linear-attention modules (Qwen3.5's `linear_attn`)."""
    stack = base_model(model).get_decoder()
    return [layer.linear_attn for layer in stack.layers if hasattr(layer, "linear_attn")]


class _Branch:
    """The cache a linear-attention layer's forward reads and writes for one segment of a packed
    row: the states the segment starts from (None: zeros), then those it ended with. States are
    replaced, never written in place, so the gradient flows back through them."""

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None):
        self.conv, self.recurrent = conv, recurrent

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # keeps a one-token segment off the in-place single-step conv update

    def update_conv_state(self, inputs, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        """The conv's inputs with the kept ones before them; keeps the last kernel's worth."""
        full = inputs if self.conv is None else torch.cat([self.conv, inputs], dim=-1)
        self.conv = full[..., -conv_kernel_size:]
        return full

    def update_recurrent_state(self, state, layer_idx, state_idx=0, **kwargs):
        self.recurrent = state
        return state


def _by_segment(module: torch.nn.Module, rows: list[tuple[int, list[tuple[int, int]]]]):
    """A linear-attention layer's forward over packed rows, row r given as (its shared tokens'
    end, its rests' (start, end)): each row's shared tokens from zero states, then every rest of
    every row in one right-padded batch, each from its row's shared end states (zero where a
    row shares nothing); pads' outputs are zeros. Rows' shared tokens run in batches
    (`shared_batches`), left-padded where the layer has no bias, of equal length otherwise.
    Every piece moves by one gather (`_SegmentPlan`, made once a pass): on a GPU the slices,
    pads and joins of each piece had cost more launches than the layer's own work."""
    forward_class = type(module).forward
    kernel = module.conv_kernel_size
    biased = any(
        getattr(m, "bias", None) is not None
        for m in module.modules()
        if isinstance(m, torch.nn.Linear | torch.nn.Conv1d)
    )
    plans: dict[tuple[int, torch.device], _SegmentPlan] = {}

    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        batch_size, length, hidden = hidden_states.shape
        key = (length, hidden_states.device)
        if key not in plans:
            plans[key] = _SegmentPlan.of(rows, length, 0.0 if biased else 0.25, key[1])
        plan = plans[key]
        zero = hidden_states.new_zeros(1, hidden)
        flat = torch.cat([hidden_states.reshape(batch_size * length, hidden), zero])
        sources, convs, recurrents = [], [], []
        for index in plan.shared:
            # NOTE: left padding with zero inputs leaves a row's states at zero up to its first
            # token (no projection or convolution has a bias, and a zero key writes nothing),
            # so the rows' outputs and end states are theirs alone
            branch = _Branch()
            out = forward_class(module, flat[index], cache_params=branch)
            sources.append(out.reshape(-1, out.shape[-1]))
            conv = branch.conv
            if conv is None:  # the layer kept no conv inputs: zeros
                conv = out.new_zeros(out.shape[0], module.conv_dim, kernel)
            convs.append(F.pad(conv, (kernel - conv.shape[-1], 0)))
            recurrents.append(branch.recurrent)
        if plan.rests is not None:
            branch = _Branch()  # where no row shares anything: every rest from zero states
            if convs:
                # each rest starts from its row's end states: a gather from every batch's, a
                # zero entry last for a row that shares nothing
                conv = torch.cat([*convs, convs[0].new_zeros(1, *convs[0].shape[1:])])
                branch.conv = conv[plan.rest_states]
                like = next((r for r in recurrents if r is not None), None)
                if like is not None:
                    states = [
                        r if r is not None else like.new_zeros(c.shape[0], *like.shape[1:])
                        for r, c in zip(recurrents, convs, strict=True)
                    ]
                    recurrent = torch.cat([*states, like.new_zeros(1, *like.shape[1:])])
                    branch.recurrent = recurrent[plan.rest_states]
            out = forward_class(module, flat[plan.rests], cache_params=branch)
            sources.append(out.reshape(-1, out.shape[-1]))
        source = torch.cat([*sources, zero.new_zeros(1, sources[0].shape[-1]) if sources else zero])
        return source[plan.out]

    return forward


@dataclass
class _SegmentPlan:
    """Where `_by_segment`'s pieces come from and go, as indices into the pass's hidden states
    flattened to (rows x length + 1) tokens, the last a zero (a pad's input): `shared`, each
    batch's left-padded inputs (n, width); `rests`, every rest's right-padded inputs (n,
    width), or None; `rest_states`, each rest's row's entry among the batches' end states (the
    last: zeros); `out`, each (row, column) of the output's place among the batches' outputs,
    then the rests', then a zero."""

    shared: list[torch.Tensor]
    rests: torch.Tensor | None
    rest_states: torch.Tensor | None
    out: torch.Tensor

    @classmethod
    def of(cls, rows, length: int, waste: float, device) -> _SegmentPlan:
        zero = len(rows) * length
        out = [[None] * length for _ in rows]
        shared, state_of, placed, entries = [], {}, 0, 0
        for batch in shared_batches([n for n, _ in rows], waste):
            width = rows[batch[0]][0]
            index = []
            for i, r in enumerate(batch):
                n = rows[r][0]
                index.append([zero] * (width - n) + [r * length + c for c in range(n)])
                for c in range(n):
                    out[r][c] = placed + i * width + width - n + c
                state_of[r] = entries + i
            shared.append(torch.tensor(index, device=device))
            placed += len(batch) * width
            entries += len(batch)
        rests = [(r, a, b) for r, (_, spans) in enumerate(rows) for a, b in spans]
        rest_index = rest_states = None
        if rests:
            width = max(b - a for _, a, b in rests)
            index = []
            for k, (r, a, b) in enumerate(rests):
                index.append([r * length + c for c in range(a, b)] + [zero] * (width - (b - a)))
                for c in range(a, b):
                    out[r][c] = placed + k * width + c - a
            rest_index = torch.tensor(index, device=device)
            rest_states = torch.tensor(
                [state_of.get(r, entries) for r, _, _ in rests], device=device
            )
            placed += len(rests) * width
        out_index = [[placed if place is None else place for place in row] for row in out]
        return cls(shared, rest_index, rest_states, torch.tensor(out_index, device=device))


def shared_batches(lengths: list[int], waste: float = 0.25) -> list[list[int]]:
    """The rows with shared tokens (`lengths`, 0: none), longest first, in batches that one
    forward runs left-padded to their longest: a row joins the batch before it while the padding
    stays within `waste` of the batch's tokens. On a GPU a forward of a short prompt costs its
    kernel launches, not its tokens: a step's groups in one forward, not one each."""
    batches: list[list[int]] = []
    for r in sorted((r for r, n in enumerate(lengths) if n), key=lambda r: -lengths[r]):
        if batches:
            batch = batches[-1]
            tokens = sum(lengths[b] for b in batch) + lengths[r]
            if lengths[batch[0]] * (len(batch) + 1) <= (1 + waste) * tokens:
                batch.append(r)
                continue
        batches.append([r])
    return batches


def stack_inputs_of(model: torch.nn.Module, inputs: PromptInputs, device: str) -> StagedPrompt:
    """The text stack's inputs for `inputs`, from the model's own forward over them, stopped
    where it reaches the stack (with the autograd graph of whatever trains before it)."""
    batch = {k: v.to(device) for k, v in inputs.model_inputs().items()}
    stack = base_model(model).get_decoder()
    return at_text_stack(model, stack, batch, inputs.num_prompt_tokens)


def _joined(pieces: list[dict], keys: dict[str, Any]) -> dict:
    """Consecutive shares of the stack's inputs (`StagedPrompt.cut`) as one row's, with the
    inputs `keys` names that a piece without media lacks (Qwen3-VL's visual mask: zeros; its
    deepstack features: none)."""
    row = {}
    for key, like in keys.items():
        if key == "deepstack_visual_embeds":
            values = [piece[key] for piece in pieces if key in piece]
            row[key] = [torch.cat(layer) for layer in zip(*values, strict=True)]
            continue
        values = []
        for piece in pieces:
            n = piece["position_ids"].shape[-1]
            value = piece[key] if key in piece else like.new_zeros(1, n, *like.shape[2:])
            if key == "position_ids" and value.ndim < like.ndim:
                # text positions (1, L) beside multimodal ones (axes, 1, L): equal on every axis
                value = value.expand(like.shape[0], *value.shape)
            values.append(value)
        row[key] = torch.cat(values, dim=-1 if key == "position_ids" else 1)
    return row


@dataclass
class _Row:
    """One packed row: its pieces of stack inputs in order, and per token its id, segment (0:
    shared, k: the k-th rest), position and bidirectional run; `picks` holds, per trajectory,
    the row columns whose logits score its tokens and those tokens."""

    pieces: list[dict]
    ids: list[int]
    seg: list[int]
    pos: list[int]
    groups: list[int]
    picks: list[tuple[list[int], list[int]]]


def _packed_row(model, layout: PackLayout, items, starts, device: str, around) -> _Row:
    """`items` packed into one row: the stack inputs of the shared tokens, then each one's rest,
    from one forward to the stack over the row where no rest holds media (`_row_staged`), else
    from each one's own forward (`around` it)."""
    shared = shared_length(items)
    row = _Row(
        pieces=[],
        ids=list(items[0].input_ids[:shared]),
        seg=[0] * shared,
        pos=list(range(shared)),
        groups=_groups(items[0], layout)[:shared],
        picks=[],
    )
    cuts = []
    for k, (item, start) in enumerate(zip(items, starts, strict=True), 1):
        n, offset = item.num_prompt_tokens, len(row.ids)
        cuts.append((offset, offset + n - shared))
        row.ids += item.input_ids[shared:]
        row.seg += [k] * (n - shared)
        row.pos += range(shared, n)
        top = max(row.groups, default=-1) + 1
        row.groups += [g + top if g >= 0 else -1 for g in _groups(item, layout)[shared:]]
        # the logit of token t is read at position t - 1: a shared one, or this rest's
        cols = [p if p < shared else offset + p - shared for p in range(start - 1, n - 1)]
        row.picks.append((cols, item.input_ids[start:]))
    if _one_forward(items, shared):
        staged = _row_staged(model, items, shared, row.ids, cuts, device, around)
        row.pieces = [staged.cut(0, shared)] + [staged.cut(a, b) for a, b in cuts]
        return row
    staged = []
    for item in items:
        with around(item) if around is not None else contextlib.nullcontext():
            staged.append(stack_inputs_of(model, item, device))
    row.pieces = [staged[0].cut(0, shared)]
    row.pieces += [
        prompt.cut(shared, item.num_prompt_tokens)
        for item, prompt in zip(items, staged, strict=True)
    ]
    return row


def _one_forward(items, shared: int) -> bool:
    """Whether one forward over the row gives each token its own episode's stack inputs: no
    rest holds media, and every episode has the first's per-token tensors at its own length."""
    if any(span.end > shared for item in items for span in item.mm_spans):
        return False
    first = items[0]
    n = first.num_prompt_tokens
    for key, value in first.mm_inputs.items():
        if is_per_token(value, n):
            for item in items:
                own = item.mm_inputs.get(key)
                if own is None or not is_per_token(own, item.num_prompt_tokens):
                    return False
    return True


def _row_staged(model, items, shared: int, ids: list[int], cuts, device: str, around):
    """The stack inputs of a packed row whose rests hold no media, from one forward to the stack
    over its tokens [shared | rest 1 | rest 2 | ...] with the shared tokens' media: each token's
    own inputs, as its episode's forward gives them. The forward counts positions on through
    the rests; each rest's are moved back to follow the shared tokens, as text's positions
    follow what comes before them (by one a token, on every axis of Qwen's)."""
    first = items[0]
    n = first.num_prompt_tokens
    mm_inputs = {}
    for key, value in first.mm_inputs.items():
        if is_per_token(value, n):
            parts = [value[:, :shared]]
            parts += [i.mm_inputs[key][:, shared:] for i in items]
            value = torch.cat(parts, dim=1)
        mm_inputs[key] = value
    inputs = PromptInputs(ids, mm_inputs, list(first.mm_spans))
    with around(inputs) if around is not None else contextlib.nullcontext():
        staged = stack_inputs_of(model, inputs, device)
    positions = staged.position_ids.clone()
    for a, b in cuts:
        positions[..., a:b] -= a - shared
    staged.position_ids = positions
    return staged


def packed_logprobs(
    model: torch.nn.Module,
    layout: PackLayout,
    rows: list[list[PromptInputs]],
    starts: list[list[int]],
    device: str,
    temperature: float = 1.0,
    around: Callable[[PromptInputs], contextlib.AbstractContextManager] | None = None,
) -> list[list[torch.Tensor]]:
    """`policy.sequence_logprobs` of every trajectory of `rows` (each row's trajectories
    packed as the module docstring says), from one forward: row r's trajectory j's logprobs of
    its tokens starts[r][j]..N-1. `around(item)` wraps each trajectory's forward to the stack
    (the trainer's encoder cache)."""
    packed = [
        _packed_row(model, layout, items, firsts, device, around)
        for items, firsts in zip(rows, starts, strict=True)
    ]
    width = max(len(row.ids) for row in packed)
    keys: dict[str, Any] = {}
    for piece in (piece for row in packed for piece in row.pieces):
        for key, value in piece.items():
            if key not in keys or (key == "position_ids" and value.ndim > keys[key].ndim):
                keys[key] = value
    stack_in = stack_rows([_joined(row.pieces, keys) for row in packed], width)

    def padded(values: list[list[int]], pad: int) -> torch.Tensor:
        return torch.tensor([v + [pad] * (width - len(v)) for v in values], device=device)

    masks = layout.masks(
        padded([row.seg for row in packed], -1),
        padded([row.pos for row in packed], 0),
        padded([row.groups for row in packed], -1),
        stack_in["inputs_embeds"].dtype,
    )
    picks = [(r, cols, targets) for r, row in enumerate(packed) for cols, targets in row.picks]
    rows_M = torch.tensor([r for r, cols, _ in picks for _ in cols], device=device)
    cols_M = torch.tensor([c for _, cols, _ in picks for c in cols], device=device)
    stack = base_model(model).get_decoder()
    stack_class = type(stack).forward

    def forward(*args, **kwargs):
        out = stack_class(stack, *args, **(kwargs | stack_in))
        out.last_hidden_state = out.last_hidden_state[rows_M, cols_M][None]
        return out

    runs = contextlib.ExitStack()
    runs.enter_context(patched_forward(stack, forward))
    if LINEAR_LAYERS in layout.layer_types:
        segments = [_segments(row.seg) for row in packed]
        for module in linear_layers(model):
            runs.enter_context(patched_forward(module, _by_segment(module, segments)))
    with runs:
        logits = model(
            input_ids=padded([row.ids for row in packed], 0),
            position_ids=stack_in["position_ids"],
            attention_mask=masks,
            use_cache=False,
            logits_to_keep=0,
        ).logits[0]
    if temperature not in (0, 1):
        logits = logits / temperature
    # every pick's logprobs from one copy of the targets and few log-softmaxes (chunks bound the
    # float32 copy of the logits), split back into views
    targets_M = torch.tensor([t for _, _, targets in picks for t in targets], device=device)
    sizes = [len(cols) for _, cols, _ in picks]
    parts = [
        token_logprobs(logits[a:b][None], targets_M[a:b][None])[0]
        for a, b in _chunks(sizes, LOGPROB_CHUNK)
    ]
    logprobs_M = torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)
    out: list[list[torch.Tensor]] = [[] for _ in rows]
    for (r, _, _), lp in zip(picks, logprobs_M.split(sizes), strict=True):
        out[r].append(lp)
    return out


# Positions whose logits one log-softmax takes in float32 (a Gemma vocabulary: 1 GiB)
LOGPROB_CHUNK = 1024


def _chunks(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive spans of the concatenated `sizes` of at most `limit` positions each, cut
    only between items (an item longer than `limit` is a span of its own)."""
    spans, start, end = [], 0, 0
    for size in sizes:
        if end > start and end + size - start > limit:
            spans.append((start, end))
            start = end
        end += size
    if end > start:
        spans.append((start, end))
    return spans


def _segments(seg: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """A packed row's shared tokens' end and its rests' (start, end), from each token's
    segment (0: shared, k: the k-th rest)."""
    shared = seg.count(0)
    rests, start = [], shared
    for i in range(shared + 1, len(seg) + 1):
        if i == len(seg) or seg[i] != seg[start]:
            rests.append((start, i))
            start = i
    return shared, rests


def _groups(item: PromptInputs, layout: PackLayout) -> list[int]:
    """Each token's bidirectional run (-1 outside one), where the layout has them."""
    types = item.mm_inputs.get("mm_token_type_ids")
    if not layout.bidirectional_vision or types is None:
        return [-1] * item.num_prompt_tokens
    return bidirectional_groups(types[0]).tolist()
