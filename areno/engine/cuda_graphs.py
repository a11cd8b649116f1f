"""Decode through CUDA graphs: one captured forward per (row bucket, key-length bucket).

An eager decode step of a 2B model launches ~1,000 small kernels, and the Python that launches them
costs several times the GPU time at batch 64 (measured on an H200: ~28 ms of CPU for ~6 ms of GPU
per step). A CUDA graph replays the whole step with one launch. Graphs need fixed shapes and fixed
addresses, so a step is padded up to a bucket of rows (padding rows decode a scratch slot) and of
key length (a multiple of `KV_BUCKET`, masked), and its inputs are copied into static buffers.

The same padded, static-buffer step also runs eagerly (`capture=False`), which is how CPU tests
check it against the plain decode path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from areno.engine.cache import BatchBinding

if TYPE_CHECKING:
    from areno.engine.runner import ModelRunner

KV_BUCKET = 256


def row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to max_rows (and max_rows itself)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_rows]
    buckets += list(range(16, max_rows, 16)) + [max_rows]
    return sorted(set(buckets))


class DecodeGraphs:
    """Padded, static-shape decode for one runner; see the module docstring."""

    def __init__(self, runner: ModelRunner, *, max_rows: int, scratch_slot: int, capture: bool):
        self.runner = runner
        self.capture = capture
        self.scratch_slot = scratch_slot
        self.buckets = row_buckets(max_rows)
        device = runner.device
        self.slots_B = torch.full((max_rows,), scratch_slot, dtype=torch.long, device=device)
        self.positions_B = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.token_ids_B = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.rope_delta_B = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def decode(self, slots: list[int], positions: list[int], token_ids: list[int]) -> torch.Tensor:
        """Like `ModelRunner.decode`; returns logits (B, V)."""
        num_rows = len(slots)
        rows = next(b for b in self.buckets if b >= num_rows)
        kv_len = min(-(-(max(positions) + 1) // KV_BUCKET) * KV_BUCKET, self.runner.max_len)
        pad = rows - num_rows
        deltas = [self.runner.rope_delta[s] for s in slots]
        host = torch.tensor(
            [
                slots + [self.scratch_slot] * pad,
                positions + [0] * pad,
                token_ids + [0] * pad,
                deltas + [0] * pad,
            ],
            dtype=torch.long,
        )
        staged = host.to(self.runner.device, non_blocking=True)
        for buffer, values in zip(
            (self.slots_B, self.positions_B, self.token_ids_B, self.rope_delta_B),
            staged,
            strict=True,
        ):
            buffer[:rows].copy_(values)
        if not self.capture:
            return self._forward(rows, kv_len)[:num_rows]
        graph, logits = self._graphs.get((rows, kv_len)) or self._capture(rows, kv_len)
        graph.replay()
        return logits[:num_rows]

    def _forward(self, rows: int, kv_len: int) -> torch.Tensor:
        runner = self.runner
        slots_B, pos_B = self.slots_B[:rows], self.positions_B[:rows]
        runner.cache.bind(BatchBinding(slots_B, pos_B[:, None], kv_len), is_prefill=False)
        out = runner.model(
            input_ids=self.token_ids_B[:rows, None],
            position_ids=runner.position_ids(pos_B, self.rope_delta_B[:rows]),
            attention_mask=runner.masks(pos_B, kv_len),
            past_key_values=runner.cache,
            use_cache=True,
        )
        runner.cache.commit()
        return out.logits[:, -1].float()

    def _capture(self, rows: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up and capture on dummy rows (the scratch slot at position 0): capture records
        # but does not run, and the warm-up must not advance any real sequence's state.
        saved = [b[:rows].clone() for b in (self.slots_B, self.positions_B, self.token_ids_B)]
        self.slots_B[:rows] = self.scratch_slot
        self.positions_B[:rows] = 0
        self.token_ids_B[:rows] = 0
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(rows, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(rows, kv_len)
        for buffer, values in zip(
            (self.slots_B, self.positions_B, self.token_ids_B), saved, strict=True
        ):
            buffer[:rows].copy_(values)
        self._graphs[(rows, kv_len)] = (graph, logits)
        return graph, logits
