"""The model runner: all tensor work of the engine (prefill with media, batched decode).

It reuses transformers' modules and weights and supplies what their generate loop lacks for
continuous batching: a paged cache (KV blocks per sequence, linear-attention state per slot),
per-row positions (including Qwen's multimodal rope offset) and per-row attention masks (a
sliding-window mask for Gemma 4's sliding layers).

Every sequence runs in a slot (0..num_slots-1: its linear-attention state, its rope delta, its
last token on the device) and keeps its keys and values in the blocks its table lists. The engine
sends each row's table with the step; the runner keeps them, by slot, in one host tensor.

Prefills of part of a prompt run over the keys its slot's blocks already hold: a long prompt's
chunks, a prompt resuming from the prefix cache. Parts of several prompts share a forward
(`prefill_parts`): right-padded rows, each attending to its own cached keys through its block table,
linear-attention states continuing per row. A part past all of its prompt's media runs the model on
its tokens (positions offset by the prompt's multimodal rope delta); a part before or inside a media
item runs the text stack on its share of the stack inputs the model's own forward gave for the whole
prompt (`StagedPrompt`), captured where that forward reaches the stack (the towers run there, or the
encoder cache answers). Sliding-window layers read each row's ring window before its first new
token. The engine runs every chunk and resumption this way, except under tensor parallelism, where
each runs alone (`prefill_chunk`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from areno.engine import kernels
from areno.engine.config import resolve_step_modes
from areno.engine.kernels.decode_attention import fits_heads
from areno.engine.kv.block_manager import blocks_for
from areno.engine.layers.attention import BLOCK_TABLES_KWARG, KV_LENGTHS_KWARG, EngineAttention
from areno.engine.layers.cache import (
    BatchBinding,
    PagedCache,
    clear_rows,
    copy_blocks,
    copy_rows,
    fork,
    ring_window,
)
from areno.engine.layers.cpu_linear import PackedLinears, can_pack
from areno.engine.layers.fused_linear import FusedLinears
from areno.engine.layers.linear_attention import EngineKernels
from areno.engine.layers.lora import LoraLayers
from areno.engine.layers.row_layer import RowLayers
from areno.engine.layers.row_linear import RowLinears
from areno.engine.runner.batched_prefill import (
    PromptPart,
    last_real_positions,
    pad_tokens,
    part_masks,
    part_sliding_masks,
    part_token_ids,
    stack_rows,
)
from areno.engine.runner.compiled import CompiledForward
from areno.engine.runner.cuda_graphs import DecodeGraphs
from areno.engine.runner.encoder_cache import EncoderCache
from areno.engine.runner.prompt_chunks import (
    RecentStaged,
    StagedPrompt,
    at_text_stack,
    bidirectional_groups,
    chunk_masks,
    runs_of,
    stack_inputs,
    staging,
)
from areno.engine.runner.row_inputs import RowInputs
from areno.engine.runner.slot_tables import SlotTables
from areno.engine.transfer import to_device
from areno.processing.types import PromptInputs

# NOTE: not cuDNN: with a per-row mask it re-plans its graph whenever the key length changes,
# which cost ~1.4 ms of CPU per attention call on an H200, more than the whole step's GPU time.
_CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class ModelRunner:
    """Runs one model over a fixed set of cache slots. Never decides policy."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_slots: int,
        max_len: int,
        num_blocks: int | None = None,
        block_size: int = 16,
        graphs: str = "auto",
        compile: str = "auto",
        prefill_compile: str = "off",
        packed_linear: bool = False,
        fuse_projections: bool = False,
        one_row_gemv: bool = False,
        row_layer: bool = False,
        state_rows: int = 0,
        encoder_cache_bytes: int = 0,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        linear_state_dtype: torch.dtype | None = None,
        pad_lone_tokens: int = 0,
    ):
        """`num_blocks` KV blocks of `block_size` tokens (None: as many as give every slot
        `max_len` tokens, the blocks a slot's default table lists: see `default_table`).
        `graphs`: decode through CUDA graphs ("capture"), through the same padded static-shape
        step without capturing ("static", for tests), or plainly ("off"); "auto" captures on
        CUDA only. `compile`: the torch.compile backend of that padded step's forward ("off",
        "inductor", "aot_eager"); "auto" compiles with inductor where graphs are captured.
        `prefill_compile`: the torch.compile backend of the text stack in batched prefills
        (`prefill_batch`); "auto" is the decode step's. `packed_linear`: on CPU in
        float32, the linear layers run on prepacked oneDNN weights (areno/engine/layers/cpu_linear.py).
        `fuse_projections`: sibling projections of one input run as one matmul (packed whole
        where the layers are packed; areno/engine/layers/fused_linear.py). `one_row_gemv`: the text
        stack's products of one row, and the LM head's, on the matrix-vector kernel where the
        layers are not packed (areno/engine/layers/row_linear.py); with `row_layer` and fused
        projections too, a Qwen-style layer at one row with its norms, residual adds and
        activation folded into its products (areno/engine/layers/row_layer.py; off by default:
        not yet faster on an H100, docs/performance.md). `state_rows`:
        spare rows of slot state (linear-attention states, sliding rings) that the prefix cache
        saves states in (areno/engine/kv/state_cache.py); none where every layer keeps only
        keys.
        `encoder_cache_bytes`: media tower outputs kept by content (encoder_cache.py).
        `max_loras`, `max_lora_rank`: LoRA adapter slots beside the text stack's linear layers
        (areno/engine/layers/lora.py); a slot runs the adapter `assign_adapter` gave it.
        `linear_state_dtype`: the stored dtype of linear-attention recurrent states (None:
        fp32); they are computed in fp32 either way. `pad_lone_tokens`: where the text stack's
        prefills run compiled, a lone prompt (or part of one) of up to this many tokens runs
        beside a copy of itself, so that no graph of a batch of one is compiled (torch.compile
        specializes a size of 1: on CPU those graphs were 30% of a first start's compile); a
        longer lone one runs uncompiled, where its matrix work sets the pace. 0: a lone one
        runs a graph of its own."""
        self.model = model.eval()
        self.kernels = EngineKernels(model)
        self.attention = EngineAttention(model)
        self.num_slots, self.max_len = num_slots, max_len
        self.linear_state_dtype = linear_state_dtype
        self.pad_lone_tokens = pad_lone_tokens
        self.device = next(model.parameters()).device
        self.text_config = model.config.get_text_config()
        num_layers = self.text_config.num_hidden_layers
        self.layer_types = getattr(self.text_config, "layer_types", None) or (
            ["full_attention"] * num_layers
        )
        self.sliding_window = getattr(self.text_config, "sliding_window", None)
        # Gemma 4: a run of vision tokens attends to itself both ways in the sliding layers.
        self.bidirectional_vision = (
            getattr(self.text_config, "use_bidirectional_attention", None) == "vision"
            and "sliding_attention" in self.layer_types
        )
        self.block_size = block_size
        # A row's table covers max_len + 1 positions (a compiled step's key length bucket may
        # round up to it).
        self.max_blocks = blocks_for(max_len + 1, block_size)
        # Sliding-window layers keep a ring of their window's blocks and one more per slot.
        self.ring_blocks = None
        if self.sliding_window and "sliding_attention" in self.layer_types:
            self.ring_blocks = blocks_for(self.sliding_window, block_size) + 1
        self.num_state_rows = state_rows if self.keeps_slot_state else 0
        if num_blocks is None:
            num_blocks = num_slots * self.max_blocks
        self.cache = self._new_cache(num_blocks, self.num_rows)
        self.tables = SlotTables(num_slots, self.max_blocks, block_size)
        # The kept stack inputs of each slot whose prompt is prefilled in chunks.
        self._staged: dict[int, StagedPrompt] = {}
        # The whole stack inputs of prompts staged lately, for the next request of the same
        # prompt object (a GRPO group's episodes resuming from the prefix cache).
        self._recent_staged = RecentStaged()
        # The slots whose prompts without media are between two of their parts (`prefill_parts`).
        self._between_parts: set[int] = set()
        self._text_stack = model.get_decoder()
        self.encoders = EncoderCache(model, encoder_cache_bytes)
        # The parameters media features do not depend on: new values of these keep the cache.
        text = {id(p) for p in self._text_stack.parameters()}
        text |= {id(p) for p in model.get_output_embeddings().parameters()}
        self._text_names = {n for n, p in model.named_parameters() if id(p) in text}
        # Qwen-style multimodal rope: text positions after media are offset by a per-request delta.
        self.uses_mrope = hasattr(model.model, "rope_deltas")
        self.row_inputs = RowInputs(
            uses_mrope=self.uses_mrope,
            sliding_window=self._window,
            ring_blocks=self.ring_blocks,
            device=self.device,
        )
        self.rope_delta = [0] * num_slots
        graphs, compile, prefill_compile = resolve_step_modes(
            graphs, compile, prefill_compile, self.device.type
        )
        backend = None if prefill_compile == "off" else prefill_compile
        self._prefill_stack = CompiledForward(
            self._text_stack.forward, backend, "the batched prefill"
        )
        self._parts_stack = CompiledForward(
            self._text_stack.forward, backend, "the prefill of parts"
        )
        self.lora = None
        if max_loras:
            self.lora = LoraLayers(
                model,
                self._text_stack,
                max_adapters=max_loras,
                max_rank=max_lora_rank,
                max_rows=num_slots,
            )
        self.adapter_of = [0] * num_slots  # each slot's adapter index (0: the base model)
        self.fused = FusedLinears.of(self._text_stack) if fuse_projections else None
        self.linears = None
        if packed_linear and can_pack(model):
            self.linears = PackedLinears(model, self.fused)
        self.row_linears = None
        if one_row_gemv and self.linears is None:
            modules = [*self._text_stack.modules(), model.get_output_embeddings()]
            self.row_linears = RowLinears(modules, self.fused)
        self.row_layers = None
        if self.row_linears is not None and row_layer and self.fused is not None:
            self.row_layers = RowLayers(self._text_stack.modules(), self.fused)
        self.graphs = None
        if graphs != "off":
            self.graphs = DecodeGraphs(
                self,
                max_rows=num_slots,
                capture=graphs == "capture",
                compile_backend=None if compile == "off" else compile,
            )

    def _engine_context(self) -> contextlib.ExitStack:
        """Around every forward of the runner: the engine's kernels and attention function, and
        on CUDA its attention backends."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.kernels)
        stack.enter_context(self.attention)
        if self.linears is not None:
            stack.enter_context(self.linears)
        if self.row_linears is not None:
            stack.enter_context(self.row_linears)
        if self.row_layers is not None:
            stack.enter_context(self.row_layers)
        if self.fused is not None:
            stack.enter_context(self.fused)
        if self.lora is not None:
            stack.enter_context(self.lora)
        if self.device.type == "cuda":
            stack.enter_context(sdpa_kernel(_CUDA_ATTENTION))
        return stack

    @property
    def decodes_in_kernel(self) -> bool:
        """Whether every attention layer decodes through the paged Triton kernel (on CUDA, with
        head shapes it takes), never gathering its keys."""
        if not (kernels.ENABLED and self.device.type == "cuda"):
            return False
        config = self.text_config
        return all(
            fits_heads(
                layer.self_attn.head_dim,
                config.num_attention_heads,
                config.num_key_value_heads,
            )
            for kind, layer in zip(self.layer_types, self._text_stack.layers, strict=True)
            if kind != "linear_attention"
        )

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def num_rows(self) -> int:
        """Rows of slot state: the running slots' and the saved states'."""
        return self.num_slots + self.num_state_rows

    def _new_cache(self, num_blocks: int, num_rows: int, **kwargs) -> PagedCache:
        return PagedCache(
            self.layer_types,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_slots=num_rows,
            max_len=self.max_len,
            ring_blocks=self.ring_blocks,
            linear_state_dtype=self.linear_state_dtype,
            **kwargs,
        )

    def reset_pool(self, num_blocks: int, *, measured: bool = False) -> None:
        """Size the KV pool anew (before the first forward allocates it). `measured`: its size
        already leaves the device's activation room (no headroom kept besides)."""
        assert not any(layer.is_initialized for layer in self.cache.attention.values())
        kwargs = {"headroom": 0.0} if measured else {}
        self.cache = self._new_cache(num_blocks, self.num_rows, **kwargs)
        self._staged.clear()
        self._recent_staged.clear()
        self._between_parts.clear()

    def release_cache(self) -> None:
        """Drop the cache's storage (a new, unallocated cache of one block takes its place)."""
        self.cache = self._new_cache(1, self.num_rows)
        self._staged.clear()
        self._recent_staged.clear()
        self._between_parts.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def measure_prefill_memory(self, num_tokens: int) -> tuple[int, int]:
        """On CUDA: (the activation peak of a `num_tokens` prefill, beyond its cache; the bytes
        of one slot's linear-attention state and sliding rings), from a prefill into a pool of
        its own size that is dropped after."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with self._probe(num_tokens) as cache:
            peak = torch.cuda.max_memory_allocated(self.device) - before
            return max(peak - cache.allocator.num_bytes, 0), _slot_state_bytes(cache)

    def measure_state_bytes(self) -> int:
        """The bytes of one slot's linear-attention state and sliding rings (one row of saved
        state), from a one-block prefill into a pool of its own that is dropped after."""
        with self._probe(self.block_size) as cache:
            return _slot_state_bytes(cache)

    @contextlib.contextmanager
    def _probe(self, num_tokens: int):
        """A prefill of `num_tokens` into a one-row pool of its own size, which is yielded and
        then dropped: the real cache stays unallocated (`reset_pool` may still size it)."""
        real = self.cache
        num = blocks_for(num_tokens, self.block_size)
        self.cache = self._new_cache(num, 1)
        try:
            self.prefill(PromptInputs([0] * num_tokens, {}), [0], [list(range(1, num + 1))])
            yield self.cache
        finally:
            self.cache = real
            self.set_tables([0], [[]], new=True)

    def default_table(self, slot: int) -> list[int]:
        """The blocks a slot holds when the caller sends no tables (`SlotTables.default`)."""
        return self.tables.default(slot, self.num_blocks)

    def set_tables(self, slots: list[int], tables: list[list[int]] | None, *, new: bool) -> None:
        """Record each slot's block table (`SlotTables.set`); a new one drops what the slot had
        staged of a chunked prompt."""
        if new:
            for slot in slots:
                self._staged.pop(slot, None)
                self._between_parts.discard(slot)
        self.tables.set(slots, tables, new=new, num_blocks=self.num_blocks)

    def _fork(self, slots: list[int], num_tokens: int) -> None:
        """Give slots[1:] the prefilled state of slots[0]: linear-attention state, and the
        blocks of their tables that differ from slots[0]'s (their own last, partial block)."""
        if len(slots) >= 2:
            fork(self.cache, slots[0], slots[1:], self.tables.fork_copies(slots, num_tokens))

    @torch.inference_mode()
    def prefill(
        self,
        inputs: PromptInputs,
        slots: list[int],
        block_tables: list[list[int]] | None = None,
        end: int | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Run the prompt (media towers included) into `slots[0]` and its table's blocks, fork
        it into the other slots (each slot i with `block_tables[i]`), and return the last
        position's logits (V,). `end`: only the first `end` tokens (a prompt's first chunk,
        one slot): the towers still encode every item, and the text stack's inputs for the
        whole prompt are kept for its later chunks (`prefill_chunk`). `start`: the blocks of
        the table hold the keys of the first `start` tokens already (the prefix cache's; one
        slot, its state restored where it `keeps_slot_state`): the text stack runs on tokens
        start..end-1 only."""
        n = inputs.num_prompt_tokens if end is None else end
        self.set_tables(slots, block_tables, new=True)
        staging = contextlib.nullcontext()
        if start:
            assert len(slots) == 1, "a cached prefix feeds one slot"
            staging = self._staging(slots[0], inputs, n, start)
        elif n < inputs.num_prompt_tokens:
            assert len(slots) == 1, "a first chunk prefills one slot"
            staging = self._staging(slots[0], inputs, n)
        positions = torch.arange(n, device=self.device)[None]
        first_slot = to_device(torch.tensor(slots[:1]), self.device)
        tables = self.tables.on_device(slots[:1], n, self.device)
        self.cache.bind(BatchBinding(first_slot, positions, n, tables), is_prefill=True)
        if self.uses_mrope:
            self.model.model.rope_deltas = None
        self._adapter_rows(slots[:1])
        model_inputs = {k: to_device(v, self.device) for k, v in inputs.model_inputs().items()}
        with self._engine_context(), staging, self.encoders.around(inputs.mm_spans):
            out = self.model(
                **model_inputs, past_key_values=self.cache, use_cache=True, logits_to_keep=1
            )
        self.cache.commit()
        if start and n == inputs.num_prompt_tokens:
            self._staged.pop(slots[0])  # no later chunk takes it
        delta = 0
        if self.uses_mrope and self.model.model.rope_deltas is not None:
            delta = int(self.model.model.rope_deltas[0, 0])
        for slot in slots:
            self.rope_delta[slot] = delta
        self._fork(slots, n)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def fork_prompt(self, slots: list[int], block_tables: list[list[int]] | None, n: int) -> None:
        """Give slots[1:] (tables `block_tables[1:]`) the `n`-token prompt slots[0] holds, as
        `prefill` does for its slots."""
        self.set_tables(slots[1:], block_tables[1:] if block_tables else None, new=True)
        for slot in slots[1:]:
            self.rope_delta[slot] = self.rope_delta[slots[0]]
        self._fork(slots, n)

    @torch.inference_mode()
    def prefill_batch(
        self,
        prompts: list[PromptInputs],
        slots: list[list[int]],
        block_tables: list[list[list[int]]] | None = None,
    ) -> torch.Tensor:
        """Prefill prompts without media in one forward (`can_batch_prefill`); prompt i goes into
        `slots[i][0]` and is forked into the rest (tables `block_tables[i]`). Returns logits
        (B, V).

        Prompts of unequal lengths are right-padded to the longest (`can_pad_prefill`): causal
        attention keeps the pads out of every real position, the pads' keys land past each
        row's blocks, in the sink, linear-attention layers keep each row's state at its last
        real token (see BatchBinding.lengths_B), and the logits are each row's last real
        position's. The text stack runs compiled where `prefill_compile` asks."""
        lengths = [p.num_prompt_tokens for p in prompts]
        num_tokens = max(lengths)
        assert min(lengths) == num_tokens or self.can_pad_prefill, "unequal lengths need padding"
        for i, row_slots in enumerate(slots):
            self.set_tables(row_slots, block_tables[i] if block_tables else None, new=True)
        # The forward's rows: a lone prompt's twice where lone prompts are padded (its copy
        # writes the same keys and states to the same places).
        lone = len(prompts) == 1 and self.prefill_compiled and self._copies_lone(num_tokens)
        rows = [0, 0] if lone else list(range(len(prompts)))
        first = [slots[row][0] for row in rows]
        first_slots = to_device(torch.tensor(first), self.device)
        positions = torch.arange(num_tokens, device=self.device).expand(len(rows), -1)
        # NOTE: lengths travel even when all are equal, so that one compiled graph serves both.
        lengths_B = to_device(torch.tensor([lengths[row] for row in rows]), self.device)
        tables = self.tables.on_device(first, num_tokens, self.device)
        binding = BatchBinding(first_slots, positions, num_tokens, tables, lengths_B=lengths_B)
        self.cache.bind(binding, is_prefill=True)
        if self.uses_mrope:
            self.model.model.rope_deltas = None
        # NOTE: no attention mask: every prompt's is all ones, and without one SDPA runs its
        # causal (flash) kernel; under torch.compile a given mask was materialized (B, 1, L, L)
        # and took the memory-efficient kernel.
        model_inputs = {
            key: to_device(
                torch.cat(
                    [pad_tokens(prompts[row].model_inputs()[key], num_tokens) for row in rows]
                ),
                self.device,
            )
            for key in prompts[0].model_inputs()
            if key != "attention_mask"
        }
        last = last_real_positions(self._text_stack, self._prefill_stack, lengths_B - 1)
        self._adapter_rows(first)
        with self._engine_context(), last:
            out = self.model(
                **model_inputs, past_key_values=self.cache, use_cache=True, logits_to_keep=1
            )
        self.cache.commit()
        deltas = [0] * len(prompts)
        if self.uses_mrope and self.model.model.rope_deltas is not None:
            deltas = self.model.model.rope_deltas[:, 0].tolist()
        for row, row_slots in enumerate(slots):
            for slot in row_slots:
                self.rope_delta[slot] = int(deltas[row])
            self._fork(row_slots, lengths[row])
        return out.logits[: len(prompts), -1].float()

    @property
    def keeps_slot_state(self) -> bool:
        """Whether some layers keep state per slot besides the pool's keys (linear-attention
        states, sliding-window rings): a prompt then starts from cached keys only with that
        state restored (`restore_state`)."""
        return self.ring_blocks is not None or "linear_attention" in self.layer_types

    @property
    def has_linear_state(self) -> bool:
        return "linear_attention" in self.layer_types

    def weights_changed(self, names: list[str]) -> None:
        """New values of the parameters `names`: tower outputs are stale unless all of them
        belong to the text stack (frozen towers are not sent)."""
        if any(name not in self._text_names for name in names):
            self.encoders.clear()
        self._recent_staged.clear()  # the embeddings may have changed too

    @torch.inference_mode()
    def save_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the state of each (slot, row) pair's slot into its saved-state row."""
        slots, rows = zip(*pairs, strict=True)
        copy_rows(self.cache, list(slots), [self.num_slots + row for row in rows])

    @torch.inference_mode()
    def restore_state(self, row: int, slot: int) -> None:
        """Copy saved-state `row` into `slot` (before a prefill that starts where it was saved)."""
        copy_rows(self.cache, [self.num_slots + row], [slot])

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy KV block `src` into `dst` in every layer that pages (a resume point's tail)."""
        copy_blocks(self.cache, [(src, dst)])

    @property
    def _window(self) -> int | None:
        """The sliding layers' window, None without sliding layers."""
        if self.sliding_window and "sliding_attention" in self.layer_types:
            return self.sliding_window
        return None

    @property
    def can_pad_prefill(self) -> bool:
        """Whether prompts of unequal lengths may share a prefill: the model's text stack is a
        module of its own, whose output `_last_real_positions` narrows to each row's last real
        token."""
        return isinstance(self._text_stack, torch.nn.Module)

    def batches_lone(self, num_tokens: int) -> bool:
        """Whether a lone prompt of `num_tokens` without media runs the batched prefill: where
        it is compiled (eager, one 256-token prompt of the 1.7B shape took 57 ms of host time
        for 6 ms of GPU kernels: docs/performance.md, "Where a step's time goes"), but not a
        one-token prompt (start-up's cache allocation: its size-1 length would compile a graph
        of its own), nor, where lone prompts are padded, one past `pad_lone_tokens`."""
        if not self.prefill_compiled or num_tokens < 2:
            return False
        return not self.pad_lone_tokens or self._copies_lone(num_tokens)

    def _copies_lone(self, num_tokens: int) -> bool:
        """Whether a lone prompt (or part of one) of `num_tokens` runs its compiled forward
        beside a copy of itself (`pad_lone_tokens`)."""
        return 0 < num_tokens <= self.pad_lone_tokens

    @property
    def prefill_compiled(self) -> bool:
        """Whether batched prefills run the text stack compiled."""
        return self._prefill_stack.compiled

    @property
    def parts_compiled(self) -> bool:
        """Whether prefills of parts of prompts without staged media run the text stack
        compiled (`prefill_parts`)."""
        return self._parts_stack.compiled

    @torch.inference_mode()
    def decode(
        self,
        slots: list[int],
        positions: list[int],
        token_ids: list[int] | torch.Tensor,
        block_tables: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """One token for each row: `token_ids[i]` sits at cache position `positions[i]` of
        `slots[i]`, whose blocks `block_tables[i]` lists (None: the tables last set). Returns
        logits (B, V). A tensor `token_ids` is indexed by slot instead, on the device:
        (num_slots,), row i feeds `token_ids[slots[i]]`."""
        if block_tables is not None:
            self.set_tables(slots, block_tables, new=False)
        # NOTE: the graph step's row i is slot i (cuda_graphs.py), the eager step's row i is
        # slots[i]: the adapter mask follows the rows the forward computes.
        self._adapter_rows(range(self.num_slots) if self.graphs is not None else slots)
        with self._engine_context():
            if self.graphs is not None:
                return self.graphs.decode(slots, positions, token_ids)
            return self._decode_eager(slots, positions, token_ids)

    def _decode_eager(
        self, slots: list[int], positions: list[int], token_ids: list[int] | torch.Tensor
    ) -> torch.Tensor:
        slots_B = torch.tensor(slots, device=self.device)
        pos_B = torch.tensor(positions, device=self.device)
        kv_len = max(positions) + 1
        lo = slots[0]
        slot_range = (lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else None
        tables = self.tables.on_device(slots, kv_len, self.device)
        binding = BatchBinding(
            slots_B, pos_B[:, None], kv_len, tables, min(positions), slot_range, paged=True
        )
        self.cache.bind(binding, is_prefill=False)
        delta_B = torch.tensor([self.rope_delta[s] for s in slots], device=self.device)
        if isinstance(token_ids, torch.Tensor):
            ids_B = token_ids[slots_B]
        else:
            ids_B = torch.tensor(token_ids, device=self.device)
        out = self.model(
            input_ids=ids_B[:, None],
            position_ids=self.row_inputs.position_ids(pos_B, delta_B),
            attention_mask=self.row_inputs.masks(pos_B, kv_len),
            past_key_values=self.cache,
            use_cache=True,
            **{
                BLOCK_TABLES_KWARG: self.row_inputs.attention_tables(tables, slots_B),
                KV_LENGTHS_KWARG: (pos_B + 1).int(),
            },
        )
        self.cache.commit()
        return out.logits[:, -1].float()

    def assign_adapter(self, slots: list[int], index: int) -> None:
        """The sequences in `slots` run with adapter `index` (LoraLayers'; 0: the base model)
        from their prefill on."""
        for slot in slots:
            self.adapter_of[slot] = index

    def _adapter_rows(self, slots: Iterable[int]) -> None:
        """Row i of the next forward runs with the adapter of the i-th of `slots`."""
        if self.lora is not None:
            self.lora.set_rows([self.adapter_of[slot] for slot in slots])

    @torch.inference_mode()
    def score(
        self, inputs: PromptInputs, adapter: int = 0, num_top_logprobs: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities of tokens 1..N-1 of `inputs` under the model (with adapter index
        `adapter`), from one full forward without the slot cache (N-1,); and at each of those
        positions the `num_top_logprobs` most likely tokens' logprobs and ids (N-1, K), most
        likely first (K = 0: empty)."""
        if self.uses_mrope:
            self.model.model.rope_deltas = None
        if self.lora is not None:
            self.lora.set_rows([adapter])
        model_inputs = {k: v.to(self.device) for k, v in inputs.model_inputs().items()}
        with self._engine_context():
            logits_NV = self.model(**model_inputs, use_cache=False).logits[0, :-1].float()
        targets_N = model_inputs["input_ids"][0, 1:]
        logprobs_NV = torch.log_softmax(logits_NV, dim=-1)
        top_logprobs_NK, top_ids_NK = logprobs_NV.topk(num_top_logprobs, dim=-1)
        logprobs_N = logprobs_NV.gather(-1, targets_N[:, None]).squeeze(-1)
        return logprobs_N, top_logprobs_NK, top_ids_NK

    # ---- prefills of part of a prompt (see the module docstring) ----------------------------

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
        in a forward of their own. The text-only forward runs the text stack compiled where
        `prefill_compile` asks (dynamic in the rows and widths, at least two columns wide); a
        forward over staged inputs runs eagerly."""
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
        num_parts = len(parts)
        compiled = staged is None and self._parts_stack.compiled
        if compiled and num_parts == 1 and self.pad_lone_tokens:
            # A lone part runs beside a copy of itself, or uncompiled (`pad_lone_tokens`).
            compiled = self._copies_lone(parts[0].end - parts[0].start)
            parts = parts * 2 if compiled else parts
        lengths = [p.end - p.start for p in parts]
        # NOTE: compiled, at least two columns: torch.compile specializes a size-1 dimension,
        # and a one-token part (a prompt sent again, past its last full block) would compile
        # the text stack again for that width alone. The pad column is a pad as in any padded
        # row (its key past the row's last real one, its state never reached).
        width = max(*lengths, 2 if compiled else 1)
        slots = [p.slot for p in parts]
        # A pad's position stays within the table's columns (the last one's block is the row's
        # own or the sink).
        last_position = self.max_blocks * self.block_size - 1
        starts_B1 = torch.tensor([p.start for p in parts])[:, None]
        pos_BQ = (starts_B1 + torch.arange(width)).clamp(max=last_position)
        kv_len = int(pos_BQ.max()) + 1
        if compiled:
            # NOTE: keys of more than one block, for the same reason: parts whose keys fit in
            # one block would compile again. The keys past every row's last position are masked.
            kv_len = max(kv_len, min(self.block_size + 1, last_position + 1))
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

        if compiled:
            run_stack = self._parts_stack

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
        return out.logits[:num_parts, -1].float()

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
        cache answers), the stack never runs. The same prompt object staged lately
        (`RecentStaged`) is not staged again."""
        if (recent := self._recent_staged.get(inputs)) is not None:
            return recent
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
        self._recent_staged.put(inputs, staged, delta)
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


def _slot_state_bytes(cache: PagedCache) -> int:
    """The bytes of one row of `cache`'s slot state (a one-row cache after a prefill)."""
    states = [t for s in cache.linear.values() for t in (s.conv, s.recurrent)]
    rings = [
        t[1:]  # the slot's ring, not the sink
        for layer in cache.attention.values()
        if layer.is_initialized and layer.ring_blocks is not None
        for t in (layer.keys, layer.values)
    ]
    return sum(t.numel() * t.element_size() for t in states + rings if t is not None)
