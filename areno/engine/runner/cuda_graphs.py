"""Decode through CUDA graphs: one captured forward per (row bucket, key-length bucket).

An eager decode step of a 2B model launches ~1,000 small kernels, and the Python that launches them
costs several times the GPU time at batch 64 (measured on an H200: ~28 ms of CPU for ~6 ms of GPU
per step). A CUDA graph replays the whole step with one launch. Graphs need fixed shapes and fixed
addresses, so a step decodes a prefix of the slots, rows 0..R-1 for R the smallest bucket above
the highest decoding slot, with the key length padded to a multiple of `KV_BUCKET` (masked), and
its inputs, block tables included, are copied into static buffers. Row i is slot i, so the
linear-attention states update in place, without gathering copies.

NOTE: rows of slots that are not decoding this step compute garbage: their table is all sink
blocks, so their key lands in the sink, and their linear-attention state and sliding-window
ring take an update. That is safe for a free slot, and for one whose prompt is prefilled this
step (the worker runs the prefill after the decode); a slot between two chunks of its prompt
keeps what its earlier chunks wrote: its state and ring are saved before the step and restored
after it.

The same padded, static-buffer step also runs eagerly (`capture=False`), which is how CPU tests
check it against the plain decode path.

Captured, the step still ran ~1,500 small elementwise kernels (norms, rotary, activations,
residual adds: ~3 ms of a 7.8 ms step of a 1.7B model at 64 rows on an H200). torch.compile
(`compile_backend`) fuses them. One compile with dynamic shapes serves every (rows, key length)
bucket; each bucket is then captured as before, compiled kernels included.
"""

from __future__ import annotations

from typing import Protocol

import torch

from areno.engine.kv.block_manager import SINK_BLOCK, blocks_for
from areno.engine.layers.attention import BLOCK_TABLES_KWARG, KV_LENGTHS_KWARG
from areno.engine.layers.cache import BatchBinding, PagedCache, restore_rows, save_rows
from areno.engine.runner.compiled import CompiledForward
from areno.engine.runner.row_inputs import RowInputs
from areno.engine.runner.slot_tables import SlotTables


class GraphedRunner(Protocol):
    """What the decode graphs read of the runner they step (`ModelRunner`): its model and
    cache, the slots' tables and rope deltas, and the slots between two chunks of a prompt."""

    model: torch.nn.Module
    device: torch.device
    cache: PagedCache
    tables: SlotTables
    row_inputs: RowInputs
    rope_delta: list[int]
    block_size: int
    max_blocks: int

    @property
    def decodes_in_kernel(self) -> bool: ...

    @property
    def chunking_slots(self) -> list[int]: ...


KV_BUCKET = 128
# The shortest key length of a doubling bucket (`DecodeGraphs.kv_len`).
MIN_DOUBLING = 512


def row_buckets(max_rows: int, min_rows: int = 1) -> list[int]:
    """1 (or `min_rows`), 2, 4, 8, 16, then every 16 up to max_rows (and max_rows itself)."""
    buckets = [b for b in (1, 2, 4, 8) if min(min_rows, max_rows) <= b < max_rows]
    buckets += list(range(16, max_rows, 16)) + [max_rows]
    return sorted(set(buckets))


class DecodeGraphs:
    """Padded, static-shape decode for one runner; see the module docstring."""

    def __init__(
        self, runner: GraphedRunner, *, max_rows: int, capture: bool, compile_backend: str | None
    ):
        self.runner = runner
        self.capture = capture
        # A compiled step never runs 1 row: torch.compile specializes a size-1 dimension, which
        # would cost a second compile of the whole model for that bucket alone.
        self.buckets = row_buckets(max_rows, min_rows=1 if compile_backend is None else 2)
        device = runner.device
        self.slots_B = torch.arange(max_rows, device=device)
        # The step's inputs travel in one host-to-device copy of a pinned buffer: rows of
        # positions, token ids, rope deltas, and the decoding slots (to pick their logits).
        self._inputs_4R = torch.zeros((4, max_rows), dtype=torch.long, device=device)
        self.positions_B, self.token_ids_B, self.rope_delta_B, self._row_slots_B = self._inputs_4R
        on_cuda = device.type == "cuda"
        self._host_4R = torch.zeros((4, max_rows), dtype=torch.long, pin_memory=on_cuda)
        # The rows' block tables: slot i's in row i, sink blocks in rows not decoding.
        # NOTE: one column more than a table can reach, so that the columns a step reads are
        # always a strict slice, never the whole buffer: a compiled step decided from its first
        # key bucket that the slice is not contiguous, and compiled again (in the middle of
        # serving) for the first bucket that was all of it.
        shape = (max_rows, runner.max_blocks + 1)
        self.tables_RN = torch.zeros(shape, dtype=torch.long, device=device)
        self._host_tables_RN = torch.zeros(shape, dtype=torch.long, pin_memory=on_cuda)
        self._copied = torch.cuda.Event() if on_cuda else None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Every graph writes its logits into rows of this one buffer (allocated at the first
        # capture, outside the graphs' pool): a graph's own output would stay allocated as long
        # as the graph, and with a row bucket for each key-length bucket of a long context those
        # outputs alone grew to gigabytes (docs/performance.md, "Decode graphs").
        self._logits_RV: torch.Tensor | None = None
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.doubling = capture and runner.decodes_in_kernel
        self._model = CompiledForward(runner.model, compile_backend, "the decode step")

    def kv_len(self, num_keys: int) -> int:
        """The padded key length of a step whose longest row has `num_keys` keys. Where the
        paged decode kernel reads every attention layer (its splits past a row's keys do next
        to nothing), the next power of two from `MIN_DOUBLING` up: a graph per doubling of the
        context, not per `KV_BUCKET`, at most twice the keys' masks. Elsewhere the next multiple
        of `KV_BUCKET`. Never past the whole context; a whole number of blocks, so gathering the
        keys (CPU) never slices one."""
        whole = self.runner.max_blocks * self.runner.block_size
        if self.doubling:
            return min(max(MIN_DOUBLING, 1 << (num_keys - 1).bit_length()), whole)
        return min(-(-num_keys // KV_BUCKET) * KV_BUCKET, whole)

    @property
    def compiled(self) -> bool:
        """Whether the step runs compiled (False after a compile error fell back)."""
        return self._model.compiled

    @property
    def num_captured(self) -> int:
        """How many (rows, key length) buckets have a captured graph."""
        return len(self._graphs)

    def release(self) -> None:
        """Drop the captured graphs once the device is idle; later decodes capture afresh.

        A TP rank releases them before leaving its NCCL group: the graphs hold the communicator's
        collectives, and destroying a group under live graphs hung on the lent H200s.
        """
        if self._graphs:
            torch.cuda.synchronize(self.runner.device)
            self._graphs.clear()

    def decode(
        self, slots: list[int], positions: list[int], token_ids: list[int] | torch.Tensor
    ) -> torch.Tensor:
        """Like `ModelRunner.decode`; returns logits (B, V)."""
        rows = next(b for b in self.buckets if b > max(slots))
        kv_len = self.kv_len(max(positions) + 1)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the pinned buffer
        host = self._host_4R
        host[:, :rows] = 0  # rows not decoding read position 0 (see the module docstring)
        index = torch.tensor(slots)
        host[0, index] = torch.tensor(positions)
        by_slot = isinstance(token_ids, torch.Tensor)
        if not by_slot:
            host[1, index] = torch.tensor(token_ids)
        host[2, index] = torch.tensor([self.runner.rope_delta[s] for s in slots])
        host[3, : len(slots)] = index
        self._inputs_4R.copy_(host, non_blocking=True)
        tables = self._host_tables_RN
        tables[:rows] = SINK_BLOCK
        tables[index, : self.runner.max_blocks] = self.runner.tables.tables_SN[index]
        self.tables_RN[:rows].copy_(tables[:rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if by_slot:  # row i is slot i: the first rows of the per-slot tokens, on the device
            self.token_ids_B[:rows].copy_(token_ids[:rows])
        # Slots in the padded rows between two chunks of their prompts (see the module docstring).
        decoding = set(slots)
        between = [s for s in self.runner.chunking_slots if s < rows and s not in decoding]
        saved = [pair for s in between for pair in save_rows(self.runner.cache, range(s, s + 1))]
        if self.capture:
            graph, logits = self._graphs.get((rows, kv_len)) or self._capture(rows, kv_len)
            graph.replay()
        else:
            logits = self._forward(rows, kv_len)
        restore_rows(saved)
        if len(slots) == rows and slots == list(range(rows)):
            return logits  # every row decodes, in slot order (a full batch)
        return logits[self._row_slots_B[: len(slots)]]

    def _forward(self, rows: int, kv_len: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """The padded step's logits (rows, V) in float32, written `into` a buffer if given."""
        runner = self.runner
        slots_B, pos_B = self.slots_B[:rows], self.positions_B[:rows]
        tables = self.tables_RN[:rows, : blocks_for(kv_len, runner.block_size)]
        binding = BatchBinding(
            slots_B, pos_B[:, None], kv_len, tables, slot_range=(0, rows), paged=True
        )
        runner.cache.bind(binding, is_prefill=False)
        inputs = {
            "input_ids": self.token_ids_B[:rows, None],
            "position_ids": runner.row_inputs.position_ids(pos_B, self.rope_delta_B[:rows]),
            "attention_mask": runner.row_inputs.masks(pos_B, kv_len),
            "past_key_values": runner.cache,
            "use_cache": True,
            BLOCK_TABLES_KWARG: runner.row_inputs.attention_tables(tables, slots_B),
            KV_LENGTHS_KWARG: (pos_B + 1).int(),
        }
        out = self._model(**inputs)
        runner.cache.commit()
        if into is None:
            return out.logits[:, -1].float()
        return into.copy_(out.logits[:, -1])

    def _capture(self, rows: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up forward really runs (capture only records) and would advance the decoding
        # rows' state a step: their cache rows are saved and restored around it, and their
        # inputs restored before the replay.
        buffers = (self.positions_B, self.token_ids_B, self.tables_RN)
        saved = [b[:rows].clone() for b in buffers]
        saved_state = save_rows(self.runner.cache, range(rows))
        self.positions_B[:rows] = 0
        self.token_ids_B[:rows] = 0
        self.tables_RN[:rows] = SINK_BLOCK  # the warm-up's keys go to the sink
        device = self.runner.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            warm_logits = self._forward(rows, kv_len)
        torch.cuda.current_stream(device).wait_stream(stream)
        restore_rows(saved_state)
        if self._logits_RV is None:
            self._logits_RV = warm_logits.new_empty((len(self.slots_B), warm_logits.shape[-1]))
        del warm_logits
        graph = torch.cuda.CUDAGraph()
        # NOTE: the capture stream is named: torch.cuda.graph's default one is a single stream of
        # the whole process, made on whichever GPU captured first. A runner on another GPU
        # (rank 0 of a TP group beside a TP=1 engine) then captured on a stream of the wrong
        # device: its kernels, collectives included, ran eagerly instead of being recorded, and
        # its ranks' graphs held different collectives (a hang on the lent H200s).
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=self._pool, stream=stream):
            logits = self._forward(rows, kv_len, into=self._logits_RV[:rows])
        for buffer, values in zip(buffers, saved, strict=True):
            buffer[:rows].copy_(values)
        self._graphs[(rows, kv_len)] = (graph, logits)
        return graph, logits
