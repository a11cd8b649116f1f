"""The engine's cache: a pool of fixed-size KV blocks shared by every running sequence, and the
fixed-size conv / recurrent state of linear-attention layers, one row per running sequence.

Attention layers keep keys and values in blocks of `block_size` tokens, storage
(num_blocks + 1, kv_heads, block_size, head_dim) per layer; a sequence's block table lists its
blocks in order, so token position p lives at offset p % block_size of block
table[p // block_size]. Block 0 is a sink nobody owns (areno/engine/kv/block_manager.py): padded
rows write there. Linear-attention layers (Qwen3.5's gated delta net) have no per-token cache:
each running sequence holds a slot, one row of their states, as before paging.

It presents itself to transformers' model code as a `Cache` whose layers act on the rows of the
current batch: before each forward the runner binds the batch's slots, block tables and per-row
positions. Attention layers write new keys / values into their blocks and return what attention
reads: a fresh prefill's own keys and values (everything it attends to is in them), or, when the
binding says `paged`, the block storage itself, which the engine's attention function reads
through the block tables it gets beside it (areno/engine/layers/attention.py). Linear-attention layers
work on gathered copies of the batch's states that `commit` writes back after the forward.

Every storage tensor is allocated at the first forward that reaches its layer (the Generator
runs a one-token prefill at start-up, so that is before any request), after a check that it fits
in the memory left on the device beside a tenth of it kept for the forwards' activations
(`HEADROOM_FRACTION`): a cache too large fails with a `CacheMemoryError` naming its
size and the flags that set it, rather than an out-of-memory error in a request (CUDA) or the
kernel's OOM killer (CPU, where untouched pages are promised freely).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

from areno.engine.kernels import use_triton
from areno.engine.kernels.decode_attention import gather_keys
from areno.engine.kernels.write_kv import write_kv, write_kv_reference
from areno.engine.transfer import to_device
from areno.errors import CacheMemoryError

_GIB = 1 << 30


@dataclass
class BatchBinding:
    """What one forward sees: the rows' slots, block tables and where their new tokens go."""

    slots_B: torch.Tensor  # (B,) long: each row's slot (linear-attention state, rope delta)
    positions_BQ: torch.Tensor  # (B, Q) long: cache position of each new token
    kv_len: int  # keys to read back: max over rows of (last position + 1)
    block_tables_BN: torch.Tensor  # (B, N) long: each row's blocks, the sink (0) past its own
    num_cached: int = 0  # tokens already cached before this forward (0 for a prefill)
    # (lo, hi) when the rows are exactly slots lo..hi-1 in order: state is then read and written
    # through views of the slot storage, without gathering copies.
    slot_range: tuple[int, int] | None = None
    # A prefill of prompts (or of parts of prompts) of unequal lengths, right-padded to the
    # longest: each row's real new-token count (B,). Pad positions write keys that no query
    # reads (past each row's last real position, or in the sink); linear-attention layers keep
    # each row's state at its last real token.
    lengths_B: torch.Tensor | None = None
    # Attention layers return their block storage, read through `block_tables_BN` by the
    # engine's attention function (the runner passes it the tables); else a prefill's own keys.
    paged: bool = False
    # A chunk of a prompt after its first (its sliding-window layers return their keys in order).
    chunk: bool = False
    # With `chunk`: each row's sliding-window layers return its ring's last `ring_window`
    # positions before its first new token, then its new keys (rows starting at different
    # positions: `ModelRunner.prefill_parts`).
    windowed: bool = False

    def rows(self, storage: torch.Tensor) -> torch.Tensor:
        """The batch's rows of a per-slot `storage` tensor: a view when the slots are a range."""
        if self.slot_range is not None:
            return storage[self.slot_range[0] : self.slot_range[1]]
        return storage[self.slots_B]


def _static(storage: torch.Tensor) -> torch.Tensor:
    """A cache storage tensor whose sizes torch.compile keeps static under dynamic=True.

    NOTE: a compiled step otherwise gave each layer's storage its own symbols for the block count
    and the block size (two per tensor, 112 for a 28-layer model's keys and values), and
    reasoning about them was most of the compile's time."""
    torch._dynamo.mark_static(storage)
    return storage


# The share of a device's memory the cache leaves free for the forwards' activations and the
# libraries' workspaces: a cache that fit with nothing to spare made the first forward fail.
HEADROOM_FRACTION = 0.1


def available_bytes(device: torch.device) -> tuple[int, int] | None:
    """(memory a new tensor can take on `device`, the device's total): on CUDA the driver's
    free memory plus what PyTorch's allocator holds unused; on a Linux CPU the kernel's
    MemAvailable and MemTotal; None elsewhere."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + unused, total
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                fields = dict(line.split(":", 1) for line in meminfo if ":" in line)
            kib = {k: int(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "MemTotal")}
            return kib["MemAvailable"], kib["MemTotal"]
        except (OSError, KeyError, ValueError):
            pass
    return None


def kv_heads_by_layer(text_stack: torch.nn.Module, layer_types: list[str]) -> dict[int, tuple]:
    """{layer index: (kv heads on this rank, head dim)} of the attention layers whose keys and
    values live in the pool: not linear-attention layers, not sliding-window ones where the
    model has a window (they keep a ring per slot, `PagedAttentionLayer`), not Gemma's
    KV-sharing ones; read off their key projections (a tensor-parallel shard's local heads)."""
    window = getattr(text_stack.config, "sliding_window", None)
    specs = {}
    for i, layer in enumerate(text_stack.layers):
        if layer_types[i] == "linear_attention" or (
            window and layer_types[i] == "sliding_attention"
        ):
            continue
        attn = layer.self_attn
        if getattr(attn, "is_kv_shared_layer", False):
            continue
        weight = attn.k_proj.weight
        rows = weight.to_local().shape[0] if isinstance(weight, DTensor) else weight.shape[0]
        specs[i] = (rows // attn.head_dim, attn.head_dim)
    return specs


class CacheAllocator:
    """Allocates a cache's storage tensors, each after checking that it fits (module docstring),
    and counts their bytes."""

    def __init__(
        self, num_blocks: int, block_size: int, num_slots: int, headroom: float = HEADROOM_FRACTION
    ):
        self.num_blocks, self.block_size, self.num_slots = num_blocks, block_size, num_slots
        self.headroom = headroom
        self.num_bytes = 0

    def zeros(
        self,
        shape: tuple[int, ...],
        like: torch.Tensor,
        what: str,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """A zeroed static storage tensor of `dtype` (None: `like`'s) on `like`'s device; raises
        CacheMemoryError naming `what` where it does not fit."""
        dtype = dtype or like.dtype
        num_bytes = math.prod(shape) * dtype.itemsize
        # NOTE: not while tracing (a compiled prefill that allocates): dynamo cannot trace the
        # file read, and the Generator's eager start-up prefill has allocated everything by then.
        free = None
        if not torch.compiler.is_compiling() and (memory := available_bytes(like.device)):
            available, total = memory
            free = max(available - int(self.headroom * total), 0)
        if free is not None and num_bytes > free:
            raise self._error(what, num_bytes, free, like.device)
        try:
            storage = _zeros_or_retry(shape, dtype, like.device)
        except torch.OutOfMemoryError:
            raise self._error(what, num_bytes, free, like.device) from None
        self.num_bytes += num_bytes
        return _static(storage)

    def _error(self, what: str, num_bytes: int, free: int | None, device) -> CacheMemoryError:
        left = f"{free / _GIB:.2f} GiB" if free is not None else "less than that"
        return CacheMemoryError(
            f"the engine's cache does not fit in {device} memory: {num_bytes / _GIB:.2f} GiB "
            f"for {what} ({self.num_blocks} blocks of {self.block_size} tokens, "
            f"--kv-cache-gib / --kv-cache-memory-fraction, and {self.num_slots} running "
            f"sequences' states, --max-running-prompts), with {left} left after the model, "
            f"{self.num_bytes / _GIB:.2f} GiB for the cache's earlier layers and "
            f"{self.headroom:.0%} of the device kept for activations; lower --kv-cache-gib "
            "or --kv-cache-memory-fraction",
            param="kv_cache_gib",
        )


def _zeros_or_retry(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """torch.zeros; on a GPU that is out of memory, again once after PyTorch's allocator gave
    back what it holds unused: `available_bytes` counts that memory, but in blocks a tensor
    larger than each cannot take (an earlier engine's pool, freed in this process)."""
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except torch.OutOfMemoryError:
        if device.type != "cuda":
            raise
        torch.cuda.empty_cache()
        return torch.zeros(shape, dtype=dtype, device=device)


@torch.library.custom_op("areno::write_kv_", mutates_args=("keys", "values"))
def write_kv_(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    blocks_BQ: torch.Tensor,
    offsets_BQ: torch.Tensor,
) -> None:
    """Write new keys / values (B, H, Q, D) into block storage at [block, :, offset, :].

    NOTE: a custom op, so that a compiled step calls it in place rather than inductor
    generating the scatter as a kernel of its own: inductor benchmarks such a kernel's launch
    configs on copies of the tensors it mutates, and a copy of a pool of 62 GiB failed the
    first compiled decode on an H200 with an out-of-memory error. On CUDA one Triton kernel
    writes both (`kernels.write_kv`)."""
    if use_triton(keys):
        write_kv(keys, values, key_states, value_states, blocks_BQ, offsets_BQ)
    else:
        write_kv_reference(keys, values, key_states, value_states, blocks_BQ, offsets_BQ)


@write_kv_.register_fake
def _(keys, values, key_states, value_states, blocks_BQ, offsets_BQ) -> None:
    return None


def ring_tables(slots_B: torch.Tensor, ring_blocks: int, num_cols: int) -> torch.Tensor:
    """Block tables (B, num_cols) of sliding-window layers, whose slot s owns the ring of blocks
    1 + s * ring_blocks ...: position p lives in its block (p // block_size) % ring_blocks.
    Logical blocks behind the window map to blocks that newer positions took (masked)."""
    cols = torch.arange(num_cols, device=slots_B.device) % ring_blocks
    return 1 + slots_B[:, None] * ring_blocks + cols[None, :]


def ring_window(ring_blocks: int, block_size: int) -> int:
    """How many positions before a chunk's first token its sliding layers read from the ring in
    a windowed chunk (`BatchBinding.windowed`): all the ring holds intact, the window and more."""
    return (ring_blocks - 1) * block_size


def ring_keys_before(
    storage: torch.Tensor, slots_B: torch.Tensor, starts_B: torch.Tensor, ring_blocks: int
) -> torch.Tensor:
    """Each row's keys (or values) at positions starts_B[b] - W .. starts_B[b] - 1 (W =
    `ring_window`) out of its slot's ring, in position order, (B, H, W, D); a position before 0
    reads whatever the ring holds there (masked)."""
    blocks_BR = (
        1 + slots_B[:, None] * ring_blocks + torch.arange(ring_blocks, device=slots_B.device)
    )
    rows = storage[blocks_BR]  # (B, ring, H, block, D)
    batch, _, heads, block_size, dim = rows.shape
    rows = rows.transpose(1, 2).reshape(batch, heads, ring_blocks * block_size, dim)
    width = ring_window(ring_blocks, block_size)
    pos_BW = starts_B[:, None] - width + torch.arange(width, device=starts_B.device)
    index_BW = (pos_BW // block_size) % ring_blocks * block_size + pos_BW % block_size
    return rows.gather(2, index_BW[:, None, :, None].expand(batch, heads, width, dim))


class PagedAttentionLayer(CacheLayerMixin):
    """KV block storage (num_blocks + 1, kv_heads, block_size, head_dim), allocated on first
    write.

    A sliding-window layer (`ring_blocks` set) keeps only its window: each slot owns a ring of
    `ring_blocks` blocks (storage num_slots * ring_blocks + 1), the window's blocks and one
    more, and a position overwrites the one `ring_blocks` blocks before it (`ring_tables`).
    A forward writes only each row's newest ring of positions (older ones, read by nobody
    after, go to the sink, so that no two writes share a place). A chunk of a prompt reads the
    ring's keys before it writes its own, and returns both, in position order (a windowed
    chunk: only each row's `ring_window` positions before it)."""

    is_sliding = False
    is_compileable = False

    def __init__(
        self, allocator: CacheAllocator, max_len: int, what: str, ring_blocks: int | None = None
    ):
        super().__init__()
        self.allocator, self.max_len, self.what = allocator, max_len, what
        self.ring_blocks = ring_blocks
        self.binding: BatchBinding | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, head_dim = key_states.shape
        a = self.allocator
        blocks = a.num_blocks if self.ring_blocks is None else a.num_slots * self.ring_blocks
        shape = (blocks + 1, heads, a.block_size, head_dim)
        self.keys = a.zeros(shape, key_states, f"{self.what}'s keys")
        self.values = a.zeros(shape, value_states, f"{self.what}'s values")
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b = self.binding
        block_size = self.allocator.block_size
        positions_BQ, offsets_BQ = b.positions_BQ, b.positions_BQ % block_size
        if self.ring_blocks is None:
            blocks_BQ = b.block_tables_BN.gather(1, positions_BQ // block_size)
            write_kv_(self.keys, self.values, key_states, value_states, blocks_BQ, offsets_BQ)
            if b.paged:
                return self.keys, self.values
            assert b.num_cached == 0, "a forward over cached keys reads them paged"
            return key_states, value_states
        ring = self.ring_blocks
        last_B = (
            positions_BQ[:, -1] if b.lengths_B is None else positions_BQ[:, 0] + b.lengths_B - 1
        )
        newest_BQ = (positions_BQ <= last_B[:, None]) & (
            positions_BQ > last_B[:, None] - ring * block_size
        )
        blocks_BQ = 1 + b.slots_B[:, None] * ring + (positions_BQ // block_size) % ring
        blocks_BQ = torch.where(newest_BQ, blocks_BQ, 0)
        older = None
        if b.chunk and b.windowed:  # each row's window before its first new token
            starts_B = positions_BQ[:, 0]
            older = (
                ring_keys_before(self.keys, b.slots_B, starts_B, ring),
                ring_keys_before(self.values, b.slots_B, starts_B, ring),
            )
        elif b.chunk:  # the ring's keys before the chunk writes its own
            tables = ring_tables(b.slots_B, ring, -(-b.num_cached // block_size))
            older = (
                gather_keys(self.keys, tables, b.num_cached),
                gather_keys(self.values, tables, b.num_cached),
            )
        write_kv_(self.keys, self.values, key_states, value_states, blocks_BQ, offsets_BQ)
        if older is not None:
            keys = torch.cat([older[0], key_states.to(older[0].dtype)], dim=2)
            return keys, torch.cat([older[1], value_states.to(older[1].dtype)], dim=2)
        if b.paged:
            return self.keys, self.values
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.binding.kv_len, 0

    def get_seq_length(self) -> int:
        return self.binding.num_cached if self.binding is not None else 0

    def get_max_length(self) -> int:
        return self.max_len


class SlotLinearState:
    """Conv / recurrent state storage for one linear-attention layer, one row per slot."""

    def __init__(
        self,
        num_slots: int,
        allocator: CacheAllocator,
        what: str,
        state_dtype: torch.dtype | None = None,
    ):
        """`state_dtype`: the recurrent state's storage dtype (None: the dtype the layer's
        first prefill produced, fp32)."""
        self.num_slots = num_slots
        self.allocator, self.what = allocator, what
        self.state_dtype = state_dtype
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        self.kernel_size: int | None = None

    def bind(self, binding: BatchBinding, is_prefill: bool) -> LinearAttentionLayer:
        layer = LinearAttentionLayer()
        if is_prefill or self.conv is None:
            return layer  # a fresh state: transformers' own prefill path fills it
        # transformers updates these tensors in place (copy_), so views write straight back.
        layer.conv_states[0] = binding.rows(self.conv)
        layer.recurrent_states[0] = binding.rows(self.recurrent)
        layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = True
        layer.conv_kernel_size[0] = self.kernel_size
        layer.device, layer.dtype = self.conv.device, self.conv.dtype
        return layer

    def commit(self, binding: BatchBinding, layer: LinearAttentionLayer, is_prefill: bool) -> None:
        conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
        if self.conv is None:
            self.kernel_size = layer.conv_kernel_size[0]
            zeros = self.allocator.zeros
            self.conv = zeros((self.num_slots, *conv.shape[1:]), conv, f"{self.what}'s conv state")
            self.recurrent = zeros(
                (self.num_slots, *recurrent.shape[1:]),
                recurrent,
                f"{self.what}'s state",
                self.state_dtype,
            )
        if binding.slot_range is not None and not is_prefill:
            return  # the layer worked on views of our storage
        self.conv[binding.slots_B] = conv
        self.recurrent[binding.slots_B] = recurrent.to(self.recurrent.dtype)


class PagedCache(Cache):
    """The engine's cache for all layers of one model's text stack."""

    def __init__(
        self,
        layer_types: list[str],
        *,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        max_len: int,
        headroom: float = HEADROOM_FRACTION,
        ring_blocks: int | None = None,
        linear_state_dtype: torch.dtype | None = None,
    ):
        """`headroom`: the share of the device's memory the cache leaves free (module
        docstring); 0 where the pool was sized from measured memory (kv_pool.py).
        `ring_blocks`: the blocks of each slot's ring in sliding-window layers (None: they page
        like full-attention layers). `linear_state_dtype`: the storage dtype of the
        linear-attention layers' recurrent states (None: fp32, as computed)."""
        self.layer_types = list(layer_types)
        self.block_size = block_size
        self.ring_blocks = ring_blocks
        self.allocator = CacheAllocator(num_blocks, block_size, num_slots, headroom)
        self.attention = {
            i: PagedAttentionLayer(
                self.allocator,
                max_len,
                f"layer {i}",
                ring_blocks if t == "sliding_attention" else None,
            )
            for i, t in enumerate(layer_types)
            if t != "linear_attention"
        }
        self.linear = {
            i: SlotLinearState(num_slots, self.allocator, f"layer {i}", linear_state_dtype)
            for i, t in enumerate(layer_types)
            if t == "linear_attention"
        }
        super().__init__(layers=[None] * len(layer_types))
        self._binding: BatchBinding | None = None
        self._is_prefill = False

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def bind(self, binding: BatchBinding, *, is_prefill: bool) -> None:
        self._binding, self._is_prefill = binding, is_prefill
        for i, layer in self.attention.items():
            layer.binding = binding
            self.layers[i] = layer
        for i, state in self.linear.items():
            self.layers[i] = state.bind(binding, is_prefill)

    @property
    def binding(self) -> BatchBinding | None:
        """The batch of the forward in progress (see `bind`)."""
        return self._binding

    def commit(self) -> None:
        """Write the linear-attention states of the bound batch back to their slots."""
        for i, state in self.linear.items():
            state.commit(self._binding, self.layers[i], self._is_prefill)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False


def fork(cache: PagedCache, src_slot: int, dst_slots: list[int], block_copies) -> None:
    """Fork a prefilled sequence (n > 1 samples): copy slot `src_slot`'s linear-attention state
    and sliding ring into `dst_slots`, and each (source, destination) block of `block_copies`
    (the samples' own copies of the prompt's last, partial block; its full blocks are shared)."""
    copy_blocks(cache, block_copies)
    if dst_slots:
        copy_rows(cache, [src_slot] * len(dst_slots), dst_slots)


def copy_blocks(cache: PagedCache, pairs) -> None:
    """Copy each (source, destination) KV block in every layer that pages (not the rings)."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs])
    dst = torch.tensor([d for _, d in pairs])
    for layer in cache.attention.values():
        if layer.is_initialized and layer.ring_blocks is None:
            src, dst = to_device(src, layer.keys.device), to_device(dst, layer.keys.device)
            layer.keys[dst] = layer.keys[src]
            layer.values[dst] = layer.values[src]


def copy_rows(cache: PagedCache, src_rows: list[int], dst_rows: list[int]) -> None:
    """Copy the slot state of each row of `src_rows` into the row of `dst_rows` beside it:
    linear-attention conv and recurrent states, sliding-window rings (rows past the running
    slots are saved states, areno/engine/kv/state_cache.py)."""
    ring = cache.ring_blocks
    for layer in cache.attention.values():
        if layer.is_initialized and layer.ring_blocks is not None:
            for src_row, dst_row in zip(src_rows, dst_rows, strict=True):
                src = slice(1 + src_row * ring, 1 + (src_row + 1) * ring)
                dst = slice(1 + dst_row * ring, 1 + (dst_row + 1) * ring)
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]
    src, dst = torch.tensor(src_rows), torch.tensor(dst_rows)
    for state in cache.linear.values():
        if state.conv is not None:
            src, dst = to_device(src, state.conv.device), to_device(dst, state.conv.device)
            state.conv[dst] = state.conv[src]
            state.recurrent[dst] = state.recurrent[src]


def clear_rows(cache: PagedCache, slots: list[int]) -> None:
    """Zero the linear-attention conv and recurrent states of `slots`: a prompt's first part,
    prefilled over bound slot states (`ModelRunner.prefill_parts`), starts from zero states."""
    for state in cache.linear.values():
        if state.conv is not None:
            rows = to_device(torch.tensor(slots), state.conv.device)
            state.conv[rows] = 0
            state.recurrent[rows] = 0


def save_rows(cache: PagedCache, slots: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a decode over `slots` (consecutive) overwrites besides the sink block (their
    linear-attention states and sliding-window rings): (storage view, copy) pairs for
    `restore_rows` (around a CUDA-graph warm-up forward, and around a padded step for the
    slots in its rows that do not decode)."""
    views = []
    for layer in cache.attention.values():
        if layer.is_initialized and layer.ring_blocks is not None:
            ring = layer.ring_blocks
            rows = slice(1 + slots.start * ring, 1 + slots.stop * ring)
            views += [layer.keys[rows], layer.values[rows]]
    for state in cache.linear.values():
        if state.conv is not None:
            views += [
                state.conv[slots.start : slots.stop],
                state.recurrent[slots.start : slots.stop],
            ]
    return [(view, view.clone()) for view in views]


def restore_rows(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for view, copy in saved:
        view.copy_(copy)
