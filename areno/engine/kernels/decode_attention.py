"""Decode attention over the paged KV cache: one query token per row, a grouped-query model's
query heads packed onto their key / value head, each row reading its keys through its block table
and only those its mask lets through. The key range is split over programs only as far as the GPU
needs programs to fill it (flash-decoding): a second kernel combines the splits' partial results,
and with one split per row the first kernel writes the output itself.

Why not SDPA: the only SDPA kernel that takes a per-row mask (memory-efficient attention) runs one
program per (row, head) over the whole padded key length. In the compiled decode step of a
1.7B model at 64 rows on an H200 it took 1.54 ms of an 8.4 ms step, about twice the time to read
the keys and values once.
"""

from __future__ import annotations

import functools

import torch

from areno.engine.kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _split_kernel(
        Q, K, V, T, M, Len, Part, Lse, Out,
        stride_qb, stride_qh, stride_ob, stride_oh,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_tb, stride_mb,
        kv_len, num_pages, scale,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr,
    ):  # fmt: skip
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_kv_heads, num_splits = tl.num_programs(1), tl.num_programs(2)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        q_ptrs = Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=(offs_g < G)[:, None], other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        k_base = K + h * stride_kh
        v_base = V + h * stride_vh
        # A split past the row's keys loops never and stores nothing (the combine skips it): a
        # step padded to a longer key length costs its short rows next to nothing.
        length = tl.load(Len + b)
        end = tl.minimum((s + 1) * SPLIT, length)
        for start in range(s * SPLIT, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            in_range = offs_n < kv_len
            # Masked-off keys are never loaded: a row reads only its own keys.
            valid = tl.load(M + b * stride_mb + offs_n, mask=in_range, other=0) != 0
            # Key n of the row sits at offset n % PAGE of block table[n // PAGE]. Loaded beside
            # the mask, not under it: a block's key loads then wait for one memory round trip
            # instead of two (what a table holds past the row's keys is read, never used).
            page_index = offs_n // PAGE
            page = tl.load(
                T + b * stride_tb + page_index, mask=in_range & (page_index < num_pages), other=0
            )
            k_offs = page.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kn
            v_offs = page.to(tl.int64) * stride_vb + (offs_n % PAGE) * stride_vn
            # Both loads are issued before the products, so a program waits for memory once a
            # block, not twice.
            k = tl.load(
                k_base + k_offs[:, None] + offs_d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            v = tl.load(
                v_base + v_offs[:, None] + offs_d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        has_keys = l_i > 0
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        # Only the group's real query rows are stored: the padding rows would be most of it.
        if DIRECT:
            # One split holds all the row's keys: its result is the output (a row without keys
            # gets zeros, as the combine gives it).
            out_ptrs = Out + b * stride_ob + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :]
            tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=(offs_g < G)[:, None])
        else:
            part = (b * num_kv_heads + h) * num_splits + s
            is_query = (offs_g < G) & (s * SPLIT < length)
            part_ptrs = Part + part * G * D + offs_g[:, None] * D + offs_d[None, :]
            tl.store(part_ptrs, out, mask=is_query[:, None])
            tl.store(Lse + part * G + offs_g, lse, mask=is_query)

    @triton.jit
    def _combine_kernel(
        Part, Lse, Len, Out,
        stride_ob, stride_oh, num_splits,
        G: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr, SPLIT: tl.constexpr,
    ):  # fmt: skip
        b, head = tl.program_id(0), tl.program_id(1)
        num_kv_heads = tl.num_programs(1) // G
        h, g = head // G, head % G
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D)
        has_split = (offs_s < num_splits) & (offs_s * SPLIT < tl.load(Len + b))
        part = (b * num_kv_heads + h) * num_splits + offs_s
        lse = tl.load(Lse + part * G + g, mask=has_split, other=float("-inf"))
        m = tl.max(lse, 0)
        weight = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))
        weight = weight / tl.maximum(tl.sum(weight, 0), 1e-30)
        parts = tl.load(
            Part + part[:, None] * G * D + g * D + offs_d[None, :],
            mask=has_split[:, None],
            other=0.0,
        )
        out = tl.sum(parts * weight[:, None], 0)
        tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))


# Keys per block of the split kernel, and the unit a split is made of. Of 32, 64, 128 and 256 keys
# a split, 128 ran fastest at 64 rows of 257-384 keys on an H200 for both benchmarked head shapes
# (benchmarks/engine_kernels.py) when every row's keys were split that finely.
SPLIT_KEYS = 128

# Programs a launch aims for per streaming multiprocessor. Splitting a row's keys further than the
# GPU needs to fill itself costs a partial result written and read back, and a second launch:
# at 256 rows of the Qwen3-8B shape the combine alone took 0.91 ms of a 12 ms step.
PROGRAMS_PER_SM = 4

# Software-pipelining stages of a split that loops over several blocks (one block leaves nothing
# to pipeline and runs on one stage).
STAGES = 2


def split_keys(rows: int, kv_heads: int, kv_len: int, programs: int) -> int:
    """Keys per split program: whole SPLIT_KEYS blocks, as few splits as leave at least `programs`
    programs over `rows` x `kv_heads` (one split when those alone are enough: no combine)."""
    most = -(-kv_len // SPLIT_KEYS)
    splits = min(most, max(1, -(-programs // (rows * kv_heads))))
    return SPLIT_KEYS * -(-most // splits)


@functools.cache
def target_programs(device: torch.device) -> int:
    """Programs a launch on `device` aims for: PROGRAMS_PER_SM per multiprocessor on CUDA; on CPU
    (Triton's interpreter) one, so each row's keys take one program."""
    if device.type != "cuda":
        return 1
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def split_launch(dim: int, keys: int = SPLIT_KEYS) -> dict:
    """The split kernel's key block (BLOCK_N) and launch options for head dim `dim` and `keys`
    keys a split.

    Up to head dim 128 a block is 128 keys on four warps, and a split of several blocks
    pipelines them over STAGES; wider heads keep 8192 // dim keys a block (32 at 256) and
    Triton's pipelining. Of the launches benchmarks/engine_kernels.py sweeps at the plan's
    splits on an H200 (16-128 keys a block, 4 or 8 warps, 1-3 stages; 64 and 256 rows of
    257-384 keys) these were the fastest or within 1 us of it on every row."""
    if dim <= 128:
        return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1 if keys <= 128 else STAGES}
    return {"BLOCK_N": max(16, 8192 // dim)}


def fits(query_BHD: torch.Tensor, key_NHPD: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes (`fits_heads`)."""
    return key_NHPD.shape[-1] == query_BHD.shape[-1] and fits_heads(
        query_BHD.shape[-1], query_BHD.shape[1], key_NHPD.shape[1]
    )


def fits_heads(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether the kernel takes a head shape: a power-of-two head dim of at least 16 (tl.dot's
    smallest tile), at most 512, and whole query groups per key / value head."""
    return 16 <= head_dim <= 512 and head_dim & (head_dim - 1) == 0 and heads % kv_heads == 0


def gather_keys(storage_NHPD: torch.Tensor, block_tables_BT: torch.Tensor, kv_len: int):
    """Rows' keys (or values) in position order, (B, H, kv_len, D), copied out of block storage
    (num_blocks, H, page, D) through their block tables (B, T >= kv_len / page)."""
    _, heads, page, dim = storage_NHPD.shape
    if torch.compiler.is_compiling():
        # NOTE: by token, where compiled: the block-wise copy's last slice is a view of all it
        # gathered exactly when kv_len is a multiple of the page, and the compiled graph
        # guarded on which, so a length of the other kind compiled it again. Eager, block-wise
        # is 10-25% faster on CPU.
        pos_K = torch.arange(kv_len, device=storage_NHPD.device)
        return storage_NHPD[block_tables_BT[:, pos_K // page], :, pos_K % page].transpose(1, 2)
    num = -(-kv_len // page)
    blocks = storage_NHPD[block_tables_BT[:, :num]]  # (B, num, H, page, D)
    batch = block_tables_BT.shape[0]
    return blocks.transpose(1, 2).reshape(batch, heads, num * page, dim)[:, :, :kv_len]


def decode_attention_reference(
    query_BHD: torch.Tensor,
    key_NHPD: torch.Tensor,
    value_NHPD: torch.Tensor,
    block_tables_BT: torch.Tensor,
    mask_BK: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain PyTorch: query (B, H, D), key / value block storage (num_blocks, H_kv, page, D),
    each row's block table (B, T), boolean mask (B, K) of the keys (positions) each row attends
    to. Returns (B, H, D) in the query's dtype."""
    batch, heads, dim = query_BHD.shape
    groups = heads // key_NHPD.shape[1]
    kv_len = mask_BK.shape[-1]
    key_BHKD = gather_keys(key_NHPD, block_tables_BT, kv_len)
    value_BHKD = gather_keys(value_NHPD, block_tables_BT, kv_len)
    q = query_BHD.float().reshape(batch, -1, groups, dim)
    scores = torch.einsum("bhgd,bhkd->bhgk", q, key_BHKD.float()) * scale
    scores = scores.masked_fill(~mask_BK[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgk,bhkd->bhgd", scores.softmax(-1), value_BHKD.float())
    return out.reshape(batch, heads, dim).to(query_BHD.dtype)


@torch.library.custom_op("areno::decode_attention", mutates_args=())
def decode_attention(
    query_BHD: torch.Tensor,
    key_NHPD: torch.Tensor,
    value_NHPD: torch.Tensor,
    block_tables_BT: torch.Tensor,
    mask_BK: torch.Tensor,
    scale: float,
    lengths_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention_reference`'s arithmetic in Triton (see the module docstring), split as
    `split_keys` plans for the device. `lengths_B` (int32): how many keys of each row may be let
    through (its mask is False past them); None: all K. A custom op, so a compiled decode step
    calls it without a graph break; the plan depends on shapes only, so a captured graph keeps
    it."""
    batch, heads, _ = query_BHD.shape
    keys = split_keys(
        batch, key_NHPD.shape[1], mask_BK.shape[-1], target_programs(query_BHD.device)
    )
    return launch(query_BHD, key_NHPD, value_NHPD, block_tables_BT, mask_BK, scale, lengths_B, keys)


def launch(
    query_BHD: torch.Tensor,
    key_NHPD: torch.Tensor,
    value_NHPD: torch.Tensor,
    block_tables_BT: torch.Tensor,
    mask_BK: torch.Tensor,
    scale: float,
    lengths_B: torch.Tensor | None,
    keys: int,
    options: dict | None = None,
) -> torch.Tensor:
    """The kernels with `keys` keys a split (a multiple of SPLIT_KEYS) and `split_launch`'s
    options (or `options`): the split kernel alone when one split covers the key length, else
    the split kernel and the combine."""
    batch, heads, dim = query_BHD.shape
    kv_heads, page = key_NHPD.shape[1], key_NHPD.shape[2]
    kv_len = mask_BK.shape[-1]
    groups = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(groups))
    num_splits = triton.cdiv(kv_len, keys)
    query_BHD, key_NHPD, value_NHPD = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (query_BHD, key_NHPD, value_NHPD)
    )
    mask_BK = mask_BK if mask_BK.stride(-1) == 1 else mask_BK.contiguous()
    tables = block_tables_BT if block_tables_BT.stride(-1) == 1 else block_tables_BT.contiguous()
    if lengths_B is None:
        lengths_B = torch.full((batch,), kv_len, dtype=torch.int32, device=query_BHD.device)
    out = torch.empty_like(query_BHD, memory_format=torch.contiguous_format)
    direct = num_splits == 1
    # Unused by a direct launch (its partial results are the output): a pointer to pass.
    part_shape = (1,) if direct else (batch, kv_heads, num_splits, groups, dim)
    part = query_BHD.new_empty(part_shape, dtype=torch.float32)
    lse = query_BHD.new_empty(part_shape[:-1] or (1,), dtype=torch.float32)
    _split_kernel[(batch, kv_heads, num_splits)](
        query_BHD, key_NHPD, value_NHPD, tables, mask_BK, lengths_B, part, lse, out,
        query_BHD.stride(0), query_BHD.stride(1), out.stride(0), out.stride(1),
        key_NHPD.stride(0), key_NHPD.stride(1), key_NHPD.stride(2),
        value_NHPD.stride(0), value_NHPD.stride(1), value_NHPD.stride(2),
        tables.stride(0), mask_BK.stride(0),
        kv_len, tables.shape[1], scale,
        G=groups, G_PAD=group_pad, D=dim, PAGE=page,
        SPLIT=keys, IEEE=query_BHD.dtype == torch.float32, DIRECT=direct,
        **(options if options is not None else split_launch(dim, keys)),
    )  # fmt: skip
    if not direct:
        _combine_kernel[(batch, heads)](
            part, lse, lengths_B, out, out.stride(0), out.stride(1), num_splits,
            G=groups, D=dim, S_PAD=max(2, triton.next_power_of_2(num_splits)), SPLIT=keys,
        )  # fmt: skip
    return out


@decode_attention.register_fake
def _(query_BHD, key_NHPD, value_NHPD, block_tables_BT, mask_BK, scale, lengths_B=None):
    return torch.empty_like(query_BHD, memory_format=torch.contiguous_format)
