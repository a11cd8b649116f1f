"""The model runner: all tensor work of the engine (prefill with media, batched decode).

It reuses transformers' modules and weights and supplies what their generate loop lacks for
continuous batching: a slot cache, per-row positions (including Qwen's multimodal rope offset) and
per-row attention masks (a sliding-window mask for Gemma 4's sliding layers).
"""

from __future__ import annotations

import torch

from areno.engine.cache import BatchBinding, SlotCache, copy_slot
from areno.processing.types import PromptInputs


class ModelRunner:
    """Runs one model over a fixed set of cache slots. Never decides policy."""

    def __init__(self, model: torch.nn.Module, *, num_slots: int, max_len: int):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.text_config = model.config.get_text_config()
        num_layers = self.text_config.num_hidden_layers
        self.layer_types = getattr(self.text_config, "layer_types", None) or (
            ["full_attention"] * num_layers
        )
        self.sliding_window = getattr(self.text_config, "sliding_window", None)
        self.cache = SlotCache(self.layer_types, num_slots=num_slots, max_len=max_len)
        # Qwen-style multimodal rope: text positions after media are offset by a per-request delta.
        self.uses_mrope = hasattr(model.model, "rope_deltas")
        self.rope_delta = [0] * num_slots

    @torch.inference_mode()
    def prefill(self, inputs: PromptInputs, slots: list[int]) -> torch.Tensor:
        """Run the prompt (media towers included) into `slots[0]`, fork it into the other slots,
        and return the last position's logits (V,)."""
        n = inputs.num_prompt_tokens
        positions = torch.arange(n, device=self.device)[None]
        first_slot = torch.tensor(slots[:1], device=self.device)
        self.cache.bind(BatchBinding(first_slot, positions, n), is_prefill=True)
        if self.uses_mrope:
            self.model.model.rope_deltas = None
        model_inputs = {k: v.to(self.device) for k, v in inputs.model_inputs().items()}
        out = self.model(**model_inputs, past_key_values=self.cache, use_cache=True)
        self.cache.commit()
        delta = 0
        if self.uses_mrope and self.model.model.rope_deltas is not None:
            delta = int(self.model.model.rope_deltas[0, 0])
        for slot in slots:
            self.rope_delta[slot] = delta
        if len(slots) > 1:
            copy_slot(self.cache, slots[0], slots[1:])
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def decode(self, slots: list[int], positions: list[int], token_ids: list[int]) -> torch.Tensor:
        """One token for each row: `token_ids[i]` sits at cache position `positions[i]` of
        `slots[i]`. Returns logits (B, V)."""
        slots_B = torch.tensor(slots, device=self.device)
        pos_B = torch.tensor(positions, device=self.device)
        kv_len = max(positions) + 1
        self.cache.bind(
            BatchBinding(slots_B, pos_B[:, None], kv_len, min(positions)), is_prefill=False
        )
        out = self.model(
            input_ids=torch.tensor(token_ids, device=self.device)[:, None],
            position_ids=self._position_ids(slots, pos_B),
            attention_mask=self._masks(pos_B, kv_len),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache.commit()
        return out.logits[:, -1].float()

    def _position_ids(self, slots: list[int], pos_B: torch.Tensor) -> torch.Tensor:
        if not self.uses_mrope:
            return pos_B[:, None]
        shifted = pos_B + torch.tensor([self.rope_delta[s] for s in slots], device=self.device)
        # (text, temporal, height, width) positions; a text token has the same value in all three.
        return torch.stack([pos_B, shifted, shifted, shifted])[:, :, None]

    def _masks(self, pos_B: torch.Tensor, kv_len: int) -> torch.Tensor | dict[str, torch.Tensor]:
        keys = torch.arange(kv_len, device=self.device)[None, :]
        full = (keys <= pos_B[:, None])[:, None, None, :]
        if not self.sliding_window or "sliding_attention" not in self.layer_types:
            return full
        recent = (keys > pos_B[:, None] - self.sliding_window)[:, None, None, :]
        return {"full_attention": full, "sliding_attention": full & recent}

    @torch.inference_mode()
    def score(self, inputs: PromptInputs) -> torch.Tensor:
        """Log-probabilities of tokens 1..N-1 of `inputs` under the model, from one full forward
        without the slot cache (N-1,)."""
        if self.uses_mrope:
            self.model.model.rope_deltas = None
        model_inputs = {k: v.to(self.device) for k, v in inputs.model_inputs().items()}
        logits_NV = self.model(**model_inputs, use_cache=False).logits[0, :-1].float()
        targets_N = model_inputs["input_ids"][0, 1:]
        return torch.log_softmax(logits_NV, dim=-1).gather(-1, targets_N[:, None]).squeeze(-1)
