"""The runner's prefills of part of a prompt over the keys its slot's blocks already hold: a long
prompt's chunks, a prompt resuming from the prefix cache (`ModelRunner` takes them from
`PartPrefills`).

Parts of several prompts share a forward (`prefill_parts`): right-padded rows, each attending to
its own cached keys through its block table, linear-attention states continuing per row. A part
past all of its prompt's media runs the model on its tokens (positions offset by the prompt's
multimodal rope delta); a part before or inside a media item runs the text stack on its share of
the stack inputs the model's own forward gave for the whole prompt (`StagedPrompt`), captured
where that forward reaches the stack (the towers run there, or the encoder cache answers).
Sliding-window layers read each row's ring window before its first new token. The engine runs
every chunk and resumption this way, except under tensor parallelism, where each runs alone
(`prefill_chunk`).
"""

from __future__ import annotations

import torch

from areno.engine.layers.attention import BLOCK_TABLES_KWARG
from areno.engine.layers.cache import BatchBinding, clear_rows, ring_window
from areno.engine.runner.batched_prefill import (
    PromptPart,
    last_real_positions,
    part_masks,
    part_sliding_masks,
    part_token_ids,
    stack_rows,
)
from areno.engine.runner.prompt_chunks import (
    StagedPrompt,
    at_text_stack,
    bidirectional_groups,
    chunk_masks,
    runs_of,
    stack_inputs,
    staging,
)
from areno.engine.transfer import to_device
from areno.processing.types import PromptInputs


class PartPrefills:
    """ModelRunner's prefills of parts of prompts (see the module docstring); they use its cache,
    tables, model and row inputs."""

    @property
    def chunking_slots(self) -> list[int]:
        """The slots whose prompts are between two of their prefill chunks."""
        return sorted(self._staged.keys() | self._between_parts)

    @property
    def can_prefill_parts(self) -> bool:
        """Whether parts of prompts may share a forward (`prefill_parts`): the text stack is a
        module of its own (each row's last real position is read out of it)."""
        return self.can_pad_prefill

    @torch.inference_mode()
    def prefill_parts(self, parts: list[PromptPart]) -> torch.Tensor:
        """Prefill a part of each of several prompts, part i's tokens into its slot over the
        keys its blocks hold (`PromptPart`); returns each part's last logits (B, V).

        The parts are right-padded to the longest. Each row's queries attend to its cached keys
        through its table and to its own keys causally; a pad position writes its key past the
        row's last real one (its own block, or the sink past its table), where no real query
        reads it, and linear-attention layers continue each row's states up to its last real
        token (BatchBinding.lengths_B). A slot that starts its prompt at 0 starts from zero
        states. Parts past all of their prompt's media run the model on their tokens, at
        positions offset by the prompt's rope delta (`_at_text_stack` finds it); the others run
        the text stack on their share of the stack inputs their prompt staged (`StagedPrompt`),
        in a forward of their own. The forwards run eagerly: their shapes vary with every
        step's parts."""
        staged: list[StagedPrompt | None] = []
        for part in parts:
            self.set_tables(
                [part.slot], None if part.table is None else [part.table], new=part.first
            )
            # The plain-token path holds for text after every media item (its positions are
            # offset by the whole prompt's rope delta); a part before or inside one takes its
            # share of the staged stack inputs.
            stage = any(s.end > part.start for s in part.inputs.mm_spans)
            prompt = self._staged.get(part.slot)
            if part.first and (stage or (self.uses_mrope and part.inputs.mm_spans)):
                prompt, self.rope_delta[part.slot] = self._at_text_stack(part.inputs)
            elif part.first:
                self.rope_delta[part.slot] = 0
            staged.append(prompt if stage else None)
            if part.ends_prompt:
                self._between_parts.discard(part.slot)
                self._staged.pop(part.slot, None)
            else:
                self._between_parts.add(part.slot)
                if stage:
                    self._staged[part.slot] = prompt
        fresh = [p.slot for p in parts if p.start == 0]
        if fresh:
            clear_rows(self.cache, fresh)
        logits: list[torch.Tensor | None] = [None] * len(parts)
        for with_media in (False, True):
            rows = [i for i, prompt in enumerate(staged) if (prompt is not None) == with_media]
            if rows:
                prompts = [staged[i] for i in rows] if with_media else None
                out = self._parts_forward([parts[i] for i in rows], prompts)
                for row, i in enumerate(rows):
                    logits[i] = out[row]
        return torch.stack(logits)

    def _parts_forward(
        self, parts: list[PromptPart], staged: list[StagedPrompt] | None
    ) -> torch.Tensor:
        """One forward of `prefill_parts`: the text stack on each part's share of its
        prompt's `staged` inputs, or (None) the model on the parts' tokens."""
        lengths = [p.end - p.start for p in parts]
        width = max(lengths)
        slots = [p.slot for p in parts]
        # A pad's position stays within the table's columns (the last one's block is the row's
        # own or the sink).
        last_position = self.max_blocks * self.block_size - 1
        starts_B1 = torch.tensor([p.start for p in parts])[:, None]
        pos_BQ = (starts_B1 + torch.arange(width)).clamp(max=last_position)
        kv_len = int(pos_BQ.max()) + 1
        pos_BQ = to_device(pos_BQ, self.device)
        slots_B = to_device(torch.tensor(slots), self.device)
        lengths_B = to_device(torch.tensor(lengths), self.device)
        tables = self.tables.on_device(slots, kv_len, self.device)
        binding = BatchBinding(
            slots_B,
            pos_BQ,
            kv_len,
            tables,
            min(p.start for p in parts),
            paged=True,
            lengths_B=lengths_B,
            chunk=self.ring_blocks is not None,
            windowed=True,
        )
        self.cache.bind(binding, is_prefill=False)
        delta_B = torch.tensor([self.rope_delta[s] for s in slots], device=self.device)
        self._adapter_rows(slots)
        stack_class = type(self._text_stack).forward
        inputs = {}
        if staged is not None:
            cuts = [prompt.cut(p.start, p.end) for prompt, p in zip(staged, parts, strict=True)]
            inputs = stack_rows(cuts, width)

        def run_stack(*args, **kwargs):
            return stack_class(self._text_stack, *args, **(kwargs | inputs))

        last = last_real_positions(self._text_stack, run_stack, lengths_B - 1)
        with self._engine_context(), last:
            out = self.model(
                input_ids=to_device(part_token_ids(parts, width), self.device),
                position_ids=self.row_inputs.part_position_ids(pos_BQ, delta_B),
                attention_mask=self._part_masks(parts, pos_BQ, kv_len),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
                **{BLOCK_TABLES_KWARG: self.row_inputs.attention_tables(tables, None)},
            )
        self.cache.commit()
        return out.logits[:, -1].float()

    def _part_masks(self, parts: list[PromptPart], pos_BQ: torch.Tensor, kv_len: int):
        """The parts' causal masks over their cached and own keys, and with sliding layers a
        mapping by layer kind whose sliding masks cover what a windowed chunk's sliding layers
        return (`part_sliding_masks`)."""
        full = part_masks(pos_BQ, kv_len)
        if self._window is None:
            return full
        groups = [self._bidirectional_groups(p.inputs) for p in parts]
        groups_BQ = None
        if any(g is not None for g in groups):
            groups_BQ = torch.full(pos_BQ.shape, -1, dtype=torch.long, device=self.device)
            for row, (g, part) in enumerate(zip(groups, parts, strict=True)):
                if g is not None:
                    groups_BQ[row, : part.end - part.start] = g[part.start : part.end]
        width = ring_window(self.ring_blocks, self.block_size)
        sliding = part_sliding_masks(pos_BQ, pos_BQ[:, 0], width, self._window, groups_BQ)
        return {"full_attention": full, "sliding_attention": sliding}

    def _at_text_stack(self, inputs: PromptInputs) -> tuple[StagedPrompt, int]:
        """The text stack's inputs for the whole prompt and its multimodal rope delta (the
        offset of text positions after its media; 0 without), from the model's own forward over
        it, stopped where it reaches the stack: the towers encode its media (or the encoder
        cache answers), the stack never runs."""
        if self.uses_mrope:
            self.model.model.rope_deltas = None
        model_inputs = {k: to_device(v, self.device) for k, v in inputs.model_inputs().items()}
        with self._engine_context(), self.encoders.around(inputs.mm_spans):
            staged = at_text_stack(
                self.model, self._text_stack, model_inputs, inputs.num_prompt_tokens
            )
        delta = 0
        if self.uses_mrope and self.model.model.rope_deltas is not None:
            delta = int(self.model.model.rope_deltas[0, 0])
        return staged, delta

    @torch.inference_mode()
    def prefill_chunk(
        self,
        inputs: PromptInputs,
        slot: int,
        block_table: list[int] | None,
        start: int,
        end: int,
        cached: int = 0,
    ) -> torch.Tensor:
        """Prefill tokens start..end-1 of a prompt into `slot`, whose blocks hold its tokens
        before `start` (earlier chunks, or the prefix cache's first `cached`); returns the last
        position's logits (V,).

        The first chunk (start 0) runs the model's own forward over the whole prompt up to its
        text stack: the media towers encode every item once, and the stack's inputs (embeddings
        with the media features merged, Qwen's multimodal rope positions, Gemma's per-layer
        inputs, Qwen3-VL's deepstack features) are kept for the slot; the stack runs on the
        chunk's part of them. A later chunk runs the stack on its own part: its queries attend
        to the cached keys through the block table and to their own causally (both ways within
        a bidirectional run, which a chunk holds whole: `whole_runs`), and linear-attention
        layers continue the slot's state. The last chunk drops what was kept."""
        table = [block_table] if block_table else None
        n = inputs.num_prompt_tokens
        if start == cached:
            return self.prefill(inputs, [slot], table, end, start)
        staged = self._staged.pop(slot) if end == n else self._staged[slot]
        self.set_tables([slot], table, new=False)
        pos_Q, tables = self._bind_chunk(slot, start, end)
        ids = to_device(torch.tensor([inputs.input_ids[start:end]]), self.device)
        delta = torch.tensor([self.rope_delta[slot]], device=self.device)
        # The model's own positions for its forward (the stack takes the kept ones): (4, 1, L)
        # or (1, L), one row of L positions.
        position_ids = self.row_inputs.position_ids(pos_Q, delta.expand(len(pos_Q))).transpose(
            -1, -2
        )
        self._adapter_rows([slot])
        with self._engine_context(), stack_inputs(self._text_stack, staged.cut(start, end)):
            out = self.model(
                input_ids=ids,
                position_ids=position_ids,
                attention_mask=self._chunk_masks(pos_Q, end, staged.groups),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
                # sliding layers return their ring's keys and the chunk's, in order (cache.py)
                **{BLOCK_TABLES_KWARG: self.row_inputs.attention_tables(tables, None)},
            )
        self.cache.commit()
        return out.logits[0, -1].float()

    def _staging(self, slot: int, inputs: PromptInputs, end: int, start: int = 0):
        """Within the block, the text stack's inputs for the whole prompt are kept for `slot`
        and the stack runs on their tokens start..end-1 (past 0: bound as a later chunk)."""
        groups = self._bidirectional_groups(inputs)

        def keep(staged: StagedPrompt) -> None:
            self._staged[slot] = staged

        def chunk(staged: StagedPrompt) -> dict:
            pos_Q, tables = self._bind_chunk(slot, start, end)
            return {
                "attention_mask": self._chunk_masks(pos_Q, end, staged.groups),
                BLOCK_TABLES_KWARG: self.row_inputs.attention_tables(tables, None),
            }

        n = inputs.num_prompt_tokens
        return staging(self._text_stack, keep, n, end, groups, start, chunk if start else None)

    def _bind_chunk(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bind the cache to tokens start..end-1 of `slot` over its cached keys before them;
        returns their positions (Q,) and the slot's tables (1, blocks)."""
        pos_Q = torch.arange(start, end, device=self.device)
        tables = self.tables.on_device([slot], end, self.device)
        slot_B = to_device(torch.tensor([slot]), self.device)
        binding = BatchBinding(
            slot_B, pos_Q[None], end, tables, num_cached=start, paged=True, chunk=True
        )
        self.cache.bind(binding, is_prefill=False)
        return pos_Q, tables

    def whole_runs(self, inputs: PromptInputs) -> list[tuple[int, int]]:
        """The token runs (start, end) of `inputs` that one prefill chunk must hold whole: where
        the model attends both ways, Gemma 4's runs of vision tokens (one image, one video
        frame) in its sliding layers."""
        return runs_of(self._bidirectional_groups(inputs))

    def _bidirectional_groups(self, inputs: PromptInputs) -> torch.Tensor | None:
        """Each token's bidirectional run (L,), -1 outside one, or None where the model has
        none (`bidirectional_groups`)."""
        types = inputs.mm_inputs.get("mm_token_type_ids")
        if types is None or not self.bidirectional_vision:
            return None
        return to_device(bidirectional_groups(types[0]), self.device)

    def _chunk_masks(self, pos_Q: torch.Tensor, kv_len: int, groups: torch.Tensor | None):
        return chunk_masks(pos_Q, kv_len, self._window, groups)
