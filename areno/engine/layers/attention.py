"""The engine's attention function: transformers' SDPA, with one-token grouped-query attention
kept packed under torch.compile, and on CUDA a one-token decode through the engine's own
split-key kernel (`kernels/decode_attention.py`), which reads each row's keys through its block
table, and only those its mask keeps.

A forward over cached keys (a decode step) passes the rows' block tables as the keyword
`areno_block_tables` (B, N), which transformers hands down to every attention call; the cache's
layers then return their block storage as keys and values (areno/engine/layers/cache.py). A model with
sliding-window layers gets a mapping by layer kind instead: its sliding layers read their
slot's ring of blocks, or (None) return their keys in position order (a prompt's chunk). Where the
kernel does not run (CPU, a head shape it does not take), the rows' keys and values are gathered
out of the blocks in position order and attention runs as before.

For a one-token query, transformers' SDPA path folds a grouped-query model's query heads onto
their key / value heads, so the (B, H_kv, groups, D) query reads each cached key once. It skips
that while torch.compile traces, and repeats the keys and values per query head instead: in the
compiled decode step of a 1.7B model at 64 rows on an H200 those copies took 7 of 16 ms. The
function here packs in both cases and hands everything else to transformers' own function.

Its mask function (`engine_sdpa_mask`) is transformers' `sdpa_mask`, except that a plain causal
mask over as many keys as queries, without padding, is never built but left to SDPA's
`is_causal`, also while torch.compile traces. transformers skips it only outside tracing on torch
before 2.14, so a compiled batched prefill materialized a (B, 1, L, L) mask and SDPA ran its
memory-efficient kernel instead of the causal flash kernel.

`EngineAttention(model)` routes a model's text layers through it for the duration of a `with`
block, and only where they use SDPA (an eager or flash-attention model keeps its choice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    sdpa_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from areno.engine.kernels import use_triton
from areno.engine.kernels.decode_attention import decode_attention, gather_keys
from areno.engine.kernels.decode_attention import fits as decode_attention_fits

ENGINE_SDPA = "areno_sdpa"
BLOCK_TABLES_KWARG = "areno_block_tables"
# With the tables, a decode step may pass each row's key count (B,) int32: the kernel's splits
# past it do nothing (a captured step padded to the longest context stays cheap for short rows).
KV_LENGTHS_KWARG = "areno_kv_lengths"


def engine_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, Q, D), key / value
    (B, H_kv, K, D), or with `areno_block_tables` in kwargs block storage (see the module
    docstring); returns (B, Q, H, D)."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, _ = query.shape
    mask_is_shared = attention_mask is None or attention_mask.shape[1] == 1
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    block_tables = kwargs.pop(BLOCK_TABLES_KWARG, None)
    lengths_B = kwargs.pop(KV_LENGTHS_KWARG, None)
    if isinstance(block_tables, dict):  # by layer kind: a sliding layer's ring, or None
        kind = "full_attention" if kwargs.get("sliding_window") is None else "sliding_attention"
        block_tables = block_tables[kind]
    if block_tables is not None:
        if q_len == 1 and plain and _takes_decode_kernel(query, key, attention_mask):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            mask_BK = attention_mask[:, 0, 0]
            out = decode_attention(
                query[:, :, 0], key, value, block_tables, mask_BK, scale, lengths_B
            )
            return out[:, None], None
        kv_len = attention_mask.shape[-1]
        key = gather_keys(key, block_tables, kv_len)
        value = gather_keys(value, block_tables, kv_len)
    if q_len != 1 or groups == 1 or not mask_is_shared or not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # The group axis stands where the query axis was: a (B, 1, 1, K) mask broadcasts over it.
    packed = query.reshape(batch, heads // groups, groups, query.shape[-1])
    out = F.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _takes_decode_kernel(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None
) -> bool:
    """The runner's decode masks: boolean, one (1, 1, K) row per batch row."""
    return (
        use_triton(query)
        and attention_mask is not None
        and attention_mask.dtype == torch.bool
        and attention_mask.shape[0] == query.shape[0]
        and attention_mask.shape[1:3] == (1, 1)
        and decode_attention_fits(query[:, :, 0], key)
    )


def engine_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' `sdpa_mask`, returning None (SDPA's `is_causal`) for a plain causal mask of
    a query block that starts the sequence and sees only its own keys: no padding mask, no
    window, no pattern mixed in (transformers clears `allow_is_causal_skip` when it mixes one).

    A sliding window's mask is always built: transformers skips it for prompts shorter than the
    window only, and a mask that is None for some prompts and a tensor for others made a
    compiled prefill compile again at the first prompt longer than the window."""
    if local_size is not None:
        allow_is_causal_skip = False
    elif (
        allow_is_causal_skip
        and mask_function is causal_mask_function
        and attention_mask is None
        and not isinstance(q_offset, torch.Tensor)
        and q_offset == 0
        and kv_offset == 0
        and q_length == kv_length
    ):
        return None
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


ALL_ATTENTION_FUNCTIONS.register(ENGINE_SDPA, engine_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(ENGINE_SDPA, engine_sdpa_mask)


class EngineAttention:
    """Inside `with`, the model's text layers attend through `engine_sdpa_forward` where they use
    SDPA. Only the text stack's config changes (not the media towers'), and it is restored on
    exit."""

    def __init__(self, model: torch.nn.Module):
        # Layers may hold a copy of the text config (multimodal models build their language model
        # from it), so every text-config object the modules hold is switched.
        text_type = type(model.config.get_text_config())
        configs = {
            id(c): c for m in model.modules() if type(c := getattr(m, "config", None)) is text_type
        }
        # NOTE: the private attribute, not the `_attn_implementation` setter, which would also
        # rewrite every sub-config.
        self.configs = [c for c in configs.values() if c._attn_implementation_internal == "sdpa"]

    def __enter__(self) -> EngineAttention:
        for config in self.configs:
            config._attn_implementation_internal = ENGINE_SDPA
        return self

    def __exit__(self, *exc) -> None:
        for config in self.configs:
            config._attn_implementation_internal = "sdpa"
