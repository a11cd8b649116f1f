"""What a forward's rows hand the model besides their tokens: position ids (Qwen's multimodal rope
offset included), per-row masks over the cached keys (windowed for sliding layers), and the block
tables attention reads through (the rows' rings for sliding layers). The eager decode, the
captured decode graphs and the chunked prefill build them the same way."""

from __future__ import annotations

import torch

from areno.engine.layers.cache import ring_tables


class RowInputs:
    """`uses_mrope`: position ids are Qwen's (4, B, 1) rope positions; `sliding_window`: the
    window of the model's sliding layers (None without any); `ring_blocks`: blocks of a
    sliding layer's ring per row (None without sliding layers)."""

    def __init__(
        self,
        *,
        uses_mrope: bool,
        sliding_window: int | None,
        ring_blocks: int | None,
        device: torch.device,
    ):
        self.uses_mrope = uses_mrope
        self.sliding_window = sliding_window
        self.ring_blocks = ring_blocks
        self.device = device

    def attention_tables(self, tables_BN: torch.Tensor, slots_B: torch.Tensor | None):
        """The block tables a forward's attention reads through: `tables_BN`, or with
        sliding-window layers a mapping by layer kind whose sliding tables are the rows' rings
        (`slots_B`; None where those layers return their keys in order, a chunk's)."""
        if self.ring_blocks is None:
            return tables_BN
        rings = None
        if slots_B is not None:
            rings = ring_tables(slots_B, self.ring_blocks, tables_BN.shape[1])
        return {"full_attention": tables_BN, "sliding_attention": rings}

    def position_ids(self, pos_B: torch.Tensor, rope_delta_B: torch.Tensor) -> torch.Tensor:
        """Decode position ids: (B, 1), or Qwen's (4, B, 1) multimodal rope positions."""
        if not self.uses_mrope:
            return pos_B[:, None]
        shifted = pos_B + rope_delta_B
        # (text, temporal, height, width) positions; a text token has the same value in all three.
        return torch.stack([pos_B, shifted, shifted, shifted])[:, :, None]

    def part_position_ids(self, pos_BQ: torch.Tensor, rope_delta_B: torch.Tensor) -> torch.Tensor:
        """Position ids of Q tokens a row: (B, Q), or Qwen's (4, B, Q) multimodal rope
        positions."""
        batch, width = pos_BQ.shape
        ids = self.position_ids(pos_BQ.reshape(-1), rope_delta_B.repeat_interleave(width))
        return ids.reshape(*ids.shape[:-2], batch, width)

    def masks(self, pos_B: torch.Tensor, kv_len: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Per-row masks over `kv_len` cached keys: causal, and windowed for sliding layers."""
        keys = torch.arange(kv_len, device=self.device)[None, :]
        full = (keys <= pos_B[:, None])[:, None, None, :]
        if self.sliding_window is None:
            return full
        recent = (keys > pos_B[:, None] - self.sliding_window)[:, None, None, :]
        return {"full_attention": full, "sliding_attention": full & recent}
