"""How many KV blocks the pool holds: from `--kv-cache-gib`, from `--kv-cache-memory-fraction` of
a GPU (after the weights, a measured activation peak and the running sequences' linear-attention
states), or, on CPU without a size, as many as give every slot `--max-context-len` tokens.

The bytes of one block are read off the model's attention layers (areno/engine/layers/cache.py,
`kv_heads_by_layer`): keys and values of `block_size` tokens in every layer that keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from areno.engine.kv.block_manager import blocks_for
from areno.engine.layers.cache import available_bytes, kv_heads_by_layer

_GIB = 1 << 30


@dataclass(frozen=True)
class KVPool:
    """The pool one runner allocates: `num_blocks` blocks of `block_size` tokens."""

    num_blocks: int
    block_size: int
    block_bytes: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def gib(self) -> float:
        return self.num_blocks * self.block_bytes / _GIB

    def max_concurrency(self, max_len: int) -> float:
        """How many sequences of `max_len` tokens fit at once."""
        return self.num_blocks / blocks_for(max_len, self.block_size)

    def describe(self, max_len: int) -> str:
        return (
            f"KV cache pool: {self.num_blocks} blocks of {self.block_size} tokens "
            f"({self.num_tokens} tokens, {self.gib:.2f} GiB); "
            f"{self.max_concurrency(max_len):.1f} sequences at --max-context-len {max_len}"
        )


def block_bytes(model: torch.nn.Module, layer_types: list[str], block_size: int) -> int:
    """Bytes of one block: keys and values of `block_size` tokens in every layer that keeps
    its own (at least 1, for a model without any)."""
    stack = model.get_decoder()
    dtype_size = next(model.parameters()).element_size()
    per_token = sum(
        2 * heads * dim for heads, dim in kv_heads_by_layer(stack, layer_types).values()
    )
    return max(per_token * dtype_size * block_size, 1)


# Memory a measured pool leaves free on the device besides: what the CUDA context and libraries
# take outside PyTorch's allocator as the engine runs (cuBLAS workspaces, graph pools).
MARGIN_BYTES = 1 << 30


def pool_gib(model: torch.nn.Module, num_blocks: int, block_size: int = 16) -> float:
    """The --kv-cache-gib that gives `model` a pool of `num_blocks` blocks (half a block over,
    so that rounding never loses one)."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or (
        ["full_attention"] * config.num_hidden_layers
    )
    return (num_blocks + 0.5) * block_bytes(model, layer_types, block_size) / _GIB


# Bytes per running sequence and vocabulary entry that a step keeps or draws beside the pool:
# the penalty history (int32 counts and a bool prompt mask, `TokenHistory`), the decode graphs'
# float32 logits buffer, and the sampler's float32 copies of the step's logits at its peak (the
# cast, the logprobs, the adjusted, the tempered and filtered, the exponential race's noise).
SAMPLING_BYTES_PER_ENTRY = 4 + 1 + 4 + 5 * 4


def reserved_bytes(
    *, activation: int, states: int, encoder_cache: int, num_slots: int, vocab_size: int
) -> dict[str, int]:
    """What an engine on a GPU uses besides its weights and its KV pool, by what it is for: a
    prefill's activation peak at the step's token budget (measured), the running sequences'
    linear-attention states and sliding rings (measured), the media tower outputs it keeps
    (`encoder_cache_gib`) and the sampling side's per-sequence buffers over the vocabulary.
    NOTE: a media prefill's tower activations are not counted apart: at the same token budget
    they stay within the text prefill's measured peak plus MARGIN_BYTES
    (tests/engine/test_gpu.py checks a media prompt at the budget)."""
    return {
        "prefill activations": activation,
        "running sequences' states": states,
        "media encoder cache": encoder_cache,
        "sampling buffers": num_slots * vocab_size * SAMPLING_BYTES_PER_ENTRY,
    }


def fraction_budget(device: torch.device, fraction: float, reserved: int) -> int:
    """Bytes the pool may take on a GPU so that this engine uses at most `fraction` of the
    device's memory (as vLLM's gpu_memory_utilization: its own share, so that engines and a
    trainer can share a GPU): that share less what this process's PyTorch already holds
    (weights) and the `reserved` bytes (`reserved_bytes`), and never more than is free on the
    device less those and MARGIN_BYTES."""
    available, total = available_bytes(device)
    share = int(fraction * total) - torch.cuda.memory_allocated(device) - reserved
    return min(share, available - reserved - MARGIN_BYTES)


def saved_state_rows(
    cache_bytes: int,
    *,
    block_bytes: int,
    row_bytes: int,
    fraction: float,
    checkpoint_blocks: int,
    num_slots: int,
) -> int:
    """Rows of saved layer state for the prefix cache of a model whose layers keep state
    besides keys, out of `cache_bytes` for KV blocks and saved states together.

    One row for every `checkpoint_blocks` blocks the cache could hold (a resume point for every
    stretch of cached prompt a prefill checkpoints), within `fraction` of `cache_bytes`, and
    never fewer than two per running sequence (where its next turn resumes, and room for the
    prompts that several share)."""
    floor = 2 * num_slots
    if row_bytes <= 0:
        return floor
    share = int(fraction * cache_bytes) // row_bytes
    by_blocks = cache_bytes // (block_bytes * checkpoint_blocks + row_bytes)
    return max(floor, min(share, by_blocks))


def agree_across_ranks(num_blocks: int, device: torch.device) -> int:
    """The smallest of every tensor-parallel rank's count: each rank measured its own memory,
    and rank 0's scheduler hands out block ids that every rank must have (and saved-state rows
    likewise)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return num_blocks
    count = torch.tensor([num_blocks], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())
