"""The engine's Triton kernels against their PyTorch references, alone and inside the runner.

On a GPU the kernels run for real. Elsewhere `test_the_kernels_under_the_triton_interpreter` runs
this module again in a subprocess with TRITON_INTERPRET=1: Triton reads it when a kernel is
defined, so it cannot be switched on inside a process that imported the engine already. The
interpreter has no bfloat16 arithmetic, so bfloat16 is checked on a GPU only.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import areno.engine.kernels.gemv as gemv_kernel
import areno.engine.layers.attention as engine_attention
import areno.engine.layers.linear_attention as engine_linear_attention
from areno.engine.kernels import INTERPRETED, references_only, triton
from areno.engine.kernels.chunked_delta import chunked_gated_delta, chunked_gated_delta_torch
from areno.engine.kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
    launch,
    split_keys,
)
from areno.engine.kernels.gated_delta import gated_delta, gated_delta_reference
from areno.engine.kernels.gemv import row_linear
from areno.engine.kernels.race import filtered_race, race
from areno.engine.kernels.write_kv import write_kv, write_kv_reference
from areno.engine.layers.row_linear import RowLinears
from areno.engine.runner.model_runner import ModelRunner
from areno.engine.sample import sampler
from areno.engine.sample.sampler import SamplingTensors, row_keys, sample
from areno.engine.sampling import SamplingParams
from areno.processing.types import PromptInputs

RUNS_KERNELS = triton is not None and (INTERPRETED or torch.cuda.is_available())
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

needs_kernels = pytest.mark.skipif(
    not RUNS_KERNELS, reason="runs on a GPU, or in the interpreter's subprocess"
)
# NOTE: the interpreter runs a launch's programs one after another in Python, each op about a
# thousand times slower than compiled: its time is programs x loop steps, hardly the tiles'
# sizes. Under it the tests take the fewest rows, heads and tokens that still reach every path
# of a kernel (several programs per dimension of the grid, partial blocks, grouped heads); a GPU
# runs the realistic sizes.


@pytest.mark.skipif(triton is None, reason="this torch build has no Triton")
@pytest.mark.skipif(RUNS_KERNELS, reason="this process runs the kernels itself")
def test_the_kernels_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # Everything ran there but this launcher.
    assert re.match(r"\d+ passed, 1 skipped in", proc.stdout.splitlines()[-1]), proc.stdout


def _paged(batch: int, heads: int, length: int, dim: int, dtype, page: int = 16):
    """Block storage and tables as the paged cache keeps them: every row's blocks scattered
    over the pool (a shuffled permutation), past each table's end more blocks than it uses."""
    num = -(-length // page) + 1
    storage = torch.randn(batch * num + 1, heads, page, dim, dtype=dtype, device=DEVICE)
    order = torch.randperm(batch * num, generator=torch.Generator().manual_seed(1)) + 1
    return storage, order.reshape(batch, num).to(DEVICE)


ATTENTION_SHAPES = [  # heads, kv_heads, dim, window, page
    (16, 8, 128, None, 16),
    (8, 2, 256, None, 16),
    (4, 4, 32, None, 32),
    (4, 1, 64, 48, 16),
    (8, 2, 512, 100, 8),
]
# (shape, padded, keys a split): the op's own plan (on CPU one split a row, written directly),
# splits of one block that a combine joins, and splits of two blocks on the two model shapes.
ATTENTION_CASES = (
    [(shape, padded, None) for shape in ATTENTION_SHAPES for padded in (False, True)]
    + [(shape, True, 128) for shape in ATTENTION_SHAPES]
    + [(shape, True, 256) for shape in ATTENTION_SHAPES[:2]]
)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, padded, split",
    ATTENTION_CASES,
    ids=[
        f"{'-'.join(map(str, shape))}-{'padded' if padded else 'exact'}-{split or 'planned'}"
        for shape, padded, split in ATTENTION_CASES
    ],
)
def test_decode_attention_matches_its_reference(dtype, shape, padded, split):
    """`padded`: the step's key length runs 3 splits past its longest row (a graph captured for
    the whole context) and each row's key count travels: the splits past it read nothing.
    `split`: keys a split program, None for the op's own plan."""
    heads, kv_heads, dim, window, page = shape
    if INTERPRETED and kv_heads > 2:  # a program per KV head: two of them, the group kept
        heads, kv_heads = heads // kv_heads * 2, 2
    torch.manual_seed(0)
    ends = torch.tensor([1, 100, 384, 250, 129], device=DEVICE)  # a row per split boundary
    kv_len = int(ends.max()) + (384 if padded else 0)
    query = torch.randn(len(ends), heads, dim, dtype=dtype, device=DEVICE)
    key, tables = _paged(len(ends), kv_heads, kv_len, dim, dtype, page)
    value = torch.randn_like(key)
    keys = torch.arange(kv_len, device=DEVICE)[None]
    mask = keys < ends[:, None]
    if window:
        mask &= keys >= ends[:, None] - window
    want = decode_attention_reference(query, key, value, tables, mask, dim**-0.5)
    lengths = ends.int() if padded else None
    if split is None:
        have = decode_attention(query, key, value, tables, mask, dim**-0.5, lengths)
    else:
        have = launch(query, key, value, tables, mask, dim**-0.5, lengths, split)
    assert have.shape == want.shape and have.dtype == dtype
    torch.testing.assert_close(have.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


# (out features, in features, bias): blocks of two and four outputs, the last one partial; an
# input of one partial block and of several; on a GPU the Qwen3-8B shape's o product.
GEMV_SHAPES = [(48, 96, False), (41, 200, True), (6, 1500, True)] + (
    [(4096, 4096, False), (4102, 3000, True)] if DEVICE == "cuda" else []
)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features, bias", GEMV_SHAPES)
def test_a_product_of_one_row_matches_f_linear(dtype, out_features, in_features, bias, monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features, dtype=dtype, device=DEVICE) * 0.05
    b = torch.randn(out_features, dtype=dtype, device=DEVICE) if bias else None
    x = torch.randn(1, 1, in_features, dtype=dtype, device=DEVICE)
    calls = {"gemv": 0}
    monkeypatch.setattr(gemv_kernel, "gemv", _counted(gemv_kernel.gemv, "gemv", calls))
    have = row_linear(x, weight, b)
    # Several rows keep F.linear, exactly.
    rows = torch.randn(3, in_features, dtype=dtype, device=DEVICE)
    assert torch.equal(row_linear(rows, weight, b), F.linear(rows, weight, b))
    assert calls["gemv"] == 1
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert have.shape == (1, 1, out_features) and have.dtype == dtype
    # fp32 sums in another order; half precision rounds the output once.
    atol = TOLERANCE[dtype] * float(want.abs().mean())
    torch.testing.assert_close(have.float(), want, atol=atol, rtol=TOLERANCE[dtype])


@needs_kernels
def test_a_compiled_forward_takes_the_one_row_kernel_only_where_it_has_one_row(monkeypatch):
    """One row: torch.compile specializes it, and the graph calls the kernel through its op;
    a graph generic in the rows keeps F.linear. Outside the block the layer is its own."""
    layer = torch.nn.Linear(40, 24).to(DEVICE).requires_grad_(False)  # as the engine runs it
    calls = {"gemv": 0}
    monkeypatch.setattr(gemv_kernel, "gemv", _counted(gemv_kernel.gemv, "gemv", calls))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: layer(x) * 2, backend="aot_eager", fullgraph=True)
    with RowLinears([layer]):
        for rows, kernel_calls in ((1, 1), (3, 1), (5, 1), (1, 2)):
            x = torch.randn(rows, 1, 40, device=DEVICE)
            want = 2 * F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(compiled(x), want, atol=1e-4, rtol=1e-4)
            assert calls["gemv"] == kernel_calls
    x = torch.randn(1, 40, device=DEVICE)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls["gemv"] == 2


# (out features, in features): several programs and a partial block (a gate and up of 24 and of
# 5); on a GPU the Qwen3-1.7B shape's gate_up and o products.
MLP_SHAPES = [(48, 96), (10, 1500)] + ([(12288, 2048), (2048, 2048)] if DEVICE == "cuda" else [])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features", MLP_SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_a_layers_fused_products_match_the_operators_they_replace(
    dtype, out_features, in_features, offset
):
    """The residual add, rms norm and product of `add_norm_row_linear` (and with a gate and up,
    their activation), the norm and product of `norm_row_linear`, and the product and residual
    add of `residual_row_linear`, against the same operators one by one."""
    torch.manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, dtype=dtype, device=DEVICE) * scale

    def close(have, want):
        assert have.dtype == dtype
        atol = TOLERANCE[dtype] * float(want.abs().mean())
        torch.testing.assert_close(have.float(), want, atol=atol, rtol=TOLERANCE[dtype])

    a, residual = rand(1, 1, in_features), rand(1, 1, in_features)
    norm_weight = rand(in_features, scale=0.2)
    weight = rand(out_features, in_features, scale=in_features**-0.5)
    floats = [t.float() for t in (a, residual, norm_weight)]
    for gated in (False, True):
        have, summed = gemv_kernel.add_norm_row_linear(
            a, residual, norm_weight, 1e-6, offset, weight, gated
        )
        want, want_summed = gemv_kernel.add_norm_linear_reference(
            *floats, 1e-6, offset, weight.float(), gated
        )
        if gated:
            # Gate, up and activation rounded as the unfused operators round them: in fp32 a
            # product near zero from a large up differs by more than the tolerance.
            gate, up = gemv_kernel.norm_linear_reference(
                (a + residual).float(), floats[2], 1e-6, offset, weight.float()
            ).chunk(2, dim=-1)
            rounded = (t.to(dtype).float() for t in (F.silu(gate.to(dtype).float()), up))
            want = torch.mul(*rounded)
        assert have.shape == (1, 1, out_features // 2 if gated else out_features)
        close(have, want)
        # The sum is rounded once, as the unfused add rounds it (the interpreter rounds toward
        # zero).
        torch.testing.assert_close(summed.float(), want_summed, atol=0, rtol=TOLERANCE[dtype])
        if dtype == torch.float32 or DEVICE == "cuda":
            assert torch.equal(summed, a + residual)
    close(
        gemv_kernel.norm_row_linear(a, norm_weight, 1e-6, offset, weight),
        gemv_kernel.norm_linear_reference(floats[0], floats[2], 1e-6, offset, weight.float()),
    )
    down = rand(in_features, out_features, scale=out_features**-0.5)
    x = rand(1, 1, out_features)
    close(
        gemv_kernel.residual_row_linear(x, down, a),
        gemv_kernel.residual_linear_reference(x.float(), down.float(), a.float()),
    )


def _tiny_qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(DEVICE).requires_grad_(False)


def _one_row_greedy(model, row_layer: bool, **runner) -> tuple[list[int], torch.Tensor]:
    """A lone request decoding 3 tokens: its tokens and its last step's logits."""
    runner = ModelRunner(
        model, num_slots=1, max_len=64, fuse_projections=True, one_row_gemv=True,
        row_layer=row_layer, **runner,
    )  # fmt: skip
    ids = list(range(5, 17))
    tokens = [int(runner.prefill(PromptInputs(ids, {}), [0]).argmax())]
    for step in range(3):
        logits = runner.decode([0], [len(ids) + step], [tokens[-1]])
        tokens.append(int(logits[0].argmax()))
    return tokens, logits


@needs_kernels
@pytest.mark.parametrize("family, graphs", [("qwen3", "off"), ("qwen3_5", "static")])
def test_a_one_row_step_runs_each_layer_in_its_fused_kernels(
    tiny_path, family, graphs, monkeypatch
):
    """Qwen3's layers at one row eagerly, Qwen3.5's (linear and full attention) compiled into a
    static step (on a GPU captured): each layer's input projections with its norm, its gate_up
    with the residual add, norm and activation, its down with the residual add (three fused
    kernels a layer a step), giving the unfused step's tokens."""
    from areno.models import get_adapter
    from areno.models.registry import read_model_type

    if family == "qwen3":
        model = _tiny_qwen3()
    else:
        path = tiny_path(family)
        model = get_adapter(read_model_type(path)).load_model(path, dtype=torch.float32)
        model = model.to(DEVICE)
    calls = {"norm_gemv": 0, "add_norm_gemv": 0, "residual_gemv": 0}
    for name in calls:
        monkeypatch.setattr(gemv_kernel, name, _counted(getattr(gemv_kernel, name), name, calls))
    runner = {"graphs": "off", "compile": "off"}
    if graphs != "off":
        on_cuda = DEVICE == "cuda"
        runner = {
            "graphs": "capture" if on_cuda else "static",
            "compile": "inductor" if on_cuda else "aot_eager",
        }
    want_tokens, want = _one_row_greedy(model, row_layer=False, **runner)
    assert not any(calls.values())
    torch._dynamo.reset()
    have_tokens, have = _one_row_greedy(model, row_layer=True, **runner)
    assert have_tokens == want_tokens
    torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
    layers = model.config.get_text_config().num_hidden_layers
    if runner["graphs"] == "capture":  # launched while capturing, replayed since
        assert calls["norm_gemv"] == calls["add_norm_gemv"] == calls["residual_gemv"] > 0
    else:
        assert calls == dict.fromkeys(calls, 3 * layers)


@needs_kernels
def test_layers_with_adapter_slots_keep_their_own_code(monkeypatch):
    """LoRA hooks the layers' products (adding to each from its input), which the fused kernels
    would skip or feed another input: a runner with adapter slots routes no layer there."""
    calls = {"norm_gemv": 0, "add_norm_gemv": 0}
    for name in calls:
        monkeypatch.setattr(gemv_kernel, name, _counted(getattr(gemv_kernel, name), name, calls))
    tokens, _ = _one_row_greedy(_tiny_qwen3(), row_layer=True, graphs="off", max_loras=1)
    assert len(tokens) == 4 and not any(calls.values())


def _keys(rows: int, seed: int | None = 0) -> torch.Tensor:
    """A key a row: seeds seed, seed + 1, ... (None: unseeded rows' random keys)."""
    seeds = [None] * rows if seed is None else [seed + i for i in range(rows)]
    return row_keys(seeds, [0] * rows, DEVICE)


def _not(rows: int) -> torch.Tensor:
    return torch.zeros(rows, dtype=torch.bool, device=DEVICE)


@needs_kernels
def test_the_race_draws_from_the_tempered_softmax():
    """Rows of one distribution at temperature 2, each with its own key: the tokens'
    frequencies are its probabilities; a key gives the same token again, alone or among other
    rows."""
    rows = 1_500 if INTERPRETED else 100_000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], device=DEVICE)
    logits = (2 * probs.log()).expand(rows, -1).contiguous()
    keys, temperature = _keys(rows), torch.full((rows,), 2.0, device=DEVICE)
    tokens = race(logits, keys, _not(rows), temperature)
    seen = torch.bincount(tokens, minlength=4).float() / rows
    assert torch.allclose(seen, probs, atol=0.04 if INTERPRETED else 0.01), seen
    assert torch.equal(race(logits, keys, _not(rows), temperature), tokens)
    assert torch.equal(race(logits[7:8], keys[7:8], _not(1), temperature[7:8]), tokens[7:8])


@needs_kernels
def test_greedy_rows_of_the_race_take_the_argmax():
    rows, vocab = (24, 5_000) if INTERPRETED else (256, 151_936)
    logits = torch.randn(rows, vocab, device=DEVICE) * 3
    greedy = torch.arange(rows, device=DEVICE) % 2 == 0
    tokens = race(logits, _keys(rows), greedy)
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    assert not torch.equal(tokens[~greedy], logits[~greedy].argmax(-1))  # the others sample


@needs_kernels
@pytest.mark.parametrize(
    "other",
    [SamplingParams(temperature=0), SamplingParams(top_k=1)],
    ids=["greedy beside (no filter: the temperature in the race)", "top-k 1 beside (filters)"],
)
def test_the_sampler_draws_through_the_race(other):
    """`sample` on the kernels' path: greedy rows and rows a filter leaves one token take the
    argmax, the others sample; the same keys give the same tokens."""
    torch.manual_seed(0)
    rows, vocab = 30, 3_000
    logits = torch.randn(rows, vocab, device=DEVICE) * 3
    params = [other if i % 2 else SamplingParams(temperature=1.3) for i in range(rows)]
    tensors = SamplingTensors.from_params(params, DEVICE)
    keys = _keys(rows)
    tokens = sample(logits, tensors, keys).token_ids_B
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))
    assert not torch.equal(tokens[0::2], logits[0::2].argmax(-1))  # 15 rows sample
    assert torch.equal(sample(logits, tensors, keys).token_ids_B, tokens)


@needs_kernels
def test_the_race_never_picks_a_removed_or_far_less_likely_token():
    """Three tokens left in a vocabulary of several chunks win about a third of the rows each,
    at 0 and next to the last chunk's end; the removed ones (-inf) and one 40 below never
    win. On a GPU, a real vocabulary: a uniform number rounding to 1 anywhere in a row would
    show as a far token winning."""
    rows, vocab = (300, 5_000) if INTERPRETED else (512, 151_936)
    logits = torch.full((rows, vocab), float("-inf"), device=DEVICE)
    kept = [0, vocab // 2, vocab - 1]
    logits[:, kept] = 0.0
    far = torch.full((rows, vocab), -40.0, device=DEVICE)
    far[:, 3] = 0.0
    for seed in (0, None):
        tokens = race(logits, _keys(rows, seed), _not(rows))
        counts = torch.bincount(tokens, minlength=vocab)
        assert counts.sum() == counts[kept].sum() and counts[kept].min() > rows / 5
        assert torch.all(race(far, _keys(rows, seed), _not(rows)) == 3)


def _sorted_then_min_p(logits, tensors):
    """What the filters keep of each row, the slow way: top-k and top-p over its sorted whole,
    then min-p over what they left."""
    filtered = sampler._sorted_filter(logits, tensors)
    probs = filtered.softmax(-1)
    floor = tensors.min_p_B[:, None] * probs.amax(-1, keepdim=True)
    return filtered.masked_fill(probs < floor, float("-inf"))


@needs_kernels
@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])
def test_the_filtered_race_draws_what_the_race_draws_over_the_sorted_filter(scale):
    """Rows with a top-p, a min-p, both, neither, and greedy ones, flat (scale 1) to peaked,
    over a vocabulary of several blocks, each with several keys: the token raced within the
    filters is the race's over the row the whole sort filtered (a flat row with a top-p of 0.5
    takes several rounds)."""
    rows, vocab = 12, 5_000 if INTERPRETED else 151_936
    params = [
        SamplingParams(top_p=0.9), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2),
        SamplingParams(top_p=0.8, min_p=0.05), SamplingParams(temperature=0), SamplingParams(),
    ] * 2  # fmt: skip
    generator = torch.Generator(device=DEVICE).manual_seed(int(scale))
    logits = torch.randn(rows, vocab, device=DEVICE, generator=generator) * scale
    tensors = SamplingTensors.from_params(params, DEVICE)
    filtered = _sorted_then_min_p(logits, tensors)
    assert filtered.isinf().any(-1)[[0, 1, 2, 3]].all()  # every filter removes something
    for seed in range(3):
        keys = _keys(rows, 100 * seed)
        have = filtered_race(logits, keys, tensors.greedy_B, tensors.top_p_B, tensors.min_p_B)
        assert torch.equal(have, race(filtered, keys, tensors.greedy_B))


@needs_kernels
def test_the_sampler_filters_without_a_sort_where_the_kernels_run(whole_sorts):
    """`sample` on the kernels' path, rows with and without a top_k beside min-p and greedy
    rows: no row sorted, the same tokens as the race over the whole sort's filter."""
    params = [
        SamplingParams(temperature=1.3, top_p=0.9), SamplingParams(top_k=20, top_p=0.8),
        SamplingParams(top_k=5, min_p=0.3), SamplingParams(temperature=0),
        SamplingParams(top_p=0.7, min_p=0.1), SamplingParams(top_k=50),
    ] * 3  # fmt: skip
    rows = len(params)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(rows, 3_000, device=DEVICE, generator=generator) * 4
    tensors = SamplingTensors.from_params(params, DEVICE)
    keys = _keys(rows, 7)
    tokens = sample(logits, tensors, keys).token_ids_B
    assert whole_sorts["n"] == 0
    tempered = logits / tensors.temperature_B[:, None]
    assert torch.equal(tokens, race(_sorted_then_min_p(tempered, tensors), keys, tensors.greedy_B))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, dim, page", [(8, 128, 16), (3, 48, 4), (1, 512, 8)])
@pytest.mark.parametrize("q_len", [1, 21])
def test_writing_keys_and_values_matches_its_reference(dtype, heads, dim, page, q_len):
    """Rows of q_len new tokens each (the states laid out as projections leave them, a
    transposed view), written through scattered tables; every place differs but the sink."""
    torch.manual_seed(0)
    batch = 3
    storage, tables = _paged(batch, heads, 2 * q_len + page, dim, dtype, page)
    start = torch.tensor([0, 5, q_len + 2], device=DEVICE)
    positions = start[:, None] + torch.arange(q_len, device=DEVICE)[None]
    blocks = tables.gather(1, positions // page)
    blocks[0, -1] = 0  # a position a sliding layer sends to the sink
    offsets = positions % page
    states = [
        torch.randn(batch, q_len, heads, dim, dtype=torch.float32, device=DEVICE)
        .to(dtype)
        .transpose(1, 2)
        for _ in range(2)
    ]
    want = [storage.clone(), storage.clone()]
    write_kv_reference(*want, *states, blocks, offsets)
    have = [storage.clone(), storage.clone()]
    write_kv(*have, *states, blocks, offsets)
    for h, w in zip(have, want, strict=True):
        assert torch.equal(h[1:], w[1:])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
# Under the interpreter a prompt of 5 tokens: its loop, and the last token's prefetch.
@pytest.mark.parametrize("num_tokens", [1, 5 if INTERPRETED else 37])
@pytest.mark.parametrize("prefetch", [True, False])
def test_gated_delta_matches_its_reference_and_updates_the_state_in_place(
    dtype, num_tokens, prefetch
):
    torch.manual_seed(0)
    batch, num_k, num_v, dk, dv = 2 if INTERPRETED else 3, 2, 4, 128, 64
    query = F.normalize(torch.randn(batch, num_tokens, num_k, dk, device=DEVICE), dim=-1) * dk**-0.5
    key = F.normalize(torch.randn(batch, num_tokens, num_k, dk, device=DEVICE), dim=-1)
    value = torch.randn(batch, num_tokens, num_v, dv, device=DEVICE).to(dtype)
    beta = torch.rand(batch, num_tokens, num_v, device=DEVICE).to(dtype)
    decay = torch.rand(batch, num_tokens, num_v, device=DEVICE) * 0.5 + 0.5
    storage = torch.randn(batch + 2, num_v, dk, dv, device=DEVICE)
    state = storage[1 : batch + 1]  # the slot cache's rows, a view
    want_out, want_state = gated_delta_reference(state, query, key, value, beta, decay)
    have_out, have_state = gated_delta(state, query, key, value, beta, decay, prefetch=prefetch)
    assert have_state is state
    torch.testing.assert_close(have_out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(storage[1 : batch + 1], want_state, atol=1e-4, rtol=1e-4)

    fresh_out, fresh_state = gated_delta(None, query, key, value, beta, decay, prefetch=prefetch)
    want_out, want_state = gated_delta_reference(None, query, key, value, beta, decay)
    torch.testing.assert_close(fresh_out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fresh_state, want_state, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("num_tokens", [1, 5 if INTERPRETED else 37])
def test_gated_delta_keeps_a_bf16_state_in_bf16_and_computes_in_fp32(num_tokens):
    """A bf16 stored state (`linear_state_dtype`) is read into fp32, run through every token in
    fp32 and rounded once when written back: the result is the fp32 rule's from the same start,
    within one bf16 step (the interpreter truncates where a GPU rounds to nearest)."""
    torch.manual_seed(0)
    batch, num_k, num_v, dk, dv = 2, 2, 4, 128, 64
    query = F.normalize(torch.randn(batch, num_tokens, num_k, dk, device=DEVICE), dim=-1) * dk**-0.5
    key = F.normalize(torch.randn(batch, num_tokens, num_k, dk, device=DEVICE), dim=-1)
    value = torch.randn(batch, num_tokens, num_v, dv, device=DEVICE).to(torch.bfloat16)
    beta = torch.rand(batch, num_tokens, num_v, device=DEVICE).to(torch.bfloat16)
    decay = torch.rand(batch, num_tokens, num_v, device=DEVICE) * 0.5 + 0.5
    state = torch.randn(batch, num_v, dk, dv, device=DEVICE).to(torch.bfloat16)
    want_out, want_state = gated_delta_reference(state.float(), query, key, value, beta, decay)
    have_out, have_state = gated_delta(state, query, key, value, beta, decay)
    assert have_state is state and state.dtype == torch.bfloat16
    torch.testing.assert_close(have_out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.float(), want_state, atol=1e-6, rtol=2**-7)


CHUNKED_CASES = [
    (37, 16, 2, 4, 128, 64),
    (64, 32, 1, 2, 32, 128),
    (5, 32, 2, 2, 64, 64),
    (100, 64, 1, 1, 16, 16),
    # The engine's launch at Qwen3.5's head dims (whole chunks and a partial one).
    (40 if INTERPRETED else 70, None, 2, 4, 128, 128),
]
# Under the interpreter half precision only at the engine's launch: its path (the loads' casts,
# the TF32 products) is the same at every shape, which float32 covers.
CHUNKED_KERNEL_CASES = [
    (dtype, *case)
    for dtype in DTYPES
    for case in CHUNKED_CASES
    if not (INTERPRETED and dtype != torch.float32 and case[1] is not None)
]


@needs_kernels
@pytest.mark.parametrize(
    "dtype, num_tokens, chunk, num_k, num_v, dk, dv",
    CHUNKED_KERNEL_CASES,
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None,
)
def test_the_chunked_delta_rule_matches_the_token_by_token_reference(
    dtype, num_tokens, chunk, num_k, num_v, dk, dv
):
    launch = {} if chunk is None else {"chunk": chunk, "block_v": min(32, dv)}
    # TF32 products for a half-precision model (finer than its activations), fp32 otherwise.
    tolerance = 1e-4 if dtype == torch.float32 or DEVICE == "cpu" else 2e-2
    rule = functools.partial(chunked_gated_delta, **launch)
    _check_chunked_rule(rule, dtype, num_tokens, num_k, num_v, dk, dv, tolerance)


@pytest.mark.parametrize("num_tokens, chunk, num_k, num_v, dk, dv", CHUNKED_CASES)
def test_the_chunked_delta_rule_in_pytorch_matches_the_token_by_token_reference(
    num_tokens, chunk, num_k, num_v, dk, dv
):
    """The CPU prefill's form of the rule (no kernels: runs everywhere)."""
    launch = {} if chunk is None else {"chunk": chunk}
    rule = functools.partial(chunked_gated_delta_torch, **launch)
    _check_chunked_rule(rule, torch.float32, num_tokens, num_k, num_v, dk, dv, 1e-4)


# 64: whole chunks of the PyTorch form. The token kernel (on CUDA, under the interpreter) has no
# chunks, so under the interpreter 37 takes the same path.
@pytest.mark.parametrize("split", [1, 37] if INTERPRETED else [1, 37, 64])
def test_a_prefill_rule_continues_a_state_as_one_rule_over_the_whole(split):
    """A prompt's later chunk: the rule over tokens split.. from the state after ..split gives
    the whole prompt's outputs and state (the Triton token kernel on CUDA and under the
    interpreter, the PyTorch chunked form elsewhere), and leaves the state it was given."""
    from areno.engine.layers.linear_attention import prefill_delta_rule

    torch.manual_seed(0)
    batch, num_tokens, num_k, num_v, dk, dv = 2, 80, 2, 4, 32, 16
    query = F.normalize(torch.randn(batch, num_tokens, num_k, dk, device=DEVICE), dim=-1) * dk**-0.5
    key = F.normalize(torch.randn(batch, num_tokens, num_k, dk, device=DEVICE), dim=-1)
    value = torch.randn(batch, num_tokens, num_v, dv, device=DEVICE)
    beta = torch.rand(batch, num_tokens, num_v, device=DEVICE)
    log_decay = -torch.rand(batch, num_tokens, num_v, device=DEVICE)
    args = (query, key, value, beta, log_decay)
    want_out, want_state = prefill_delta_rule(*args)
    head_out, head_state = prefill_delta_rule(*(t[:, :split] for t in args))
    given = head_state.clone()
    tail_out, tail_state = prefill_delta_rule(*(t[:, split:] for t in args), head_state)
    assert torch.equal(head_state, given)
    torch.testing.assert_close(torch.cat([head_out, tail_out], 1), want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(tail_state, want_state, atol=2e-5, rtol=1e-4)


def _check_chunked_rule(rule, dtype, num_tokens, num_k, num_v, dk, dv, tolerance) -> None:
    """Chunk sizes that divide the prompt and ones that leave a partial last chunk, grouped
    value heads, and right padding: a row whose last tokens have beta 0 and log-decay 0 ends
    in the state of its last real token."""
    torch.manual_seed(0)
    batch = 2 if INTERPRETED else 3
    query = F.normalize(torch.randn(batch, num_tokens, num_k, dk, device=DEVICE), dim=-1) * dk**-0.5
    key = F.normalize(torch.randn(batch, num_tokens, num_k, dk, device=DEVICE), dim=-1)
    value = torch.randn(batch, num_tokens, num_v, dv, device=DEVICE).to(dtype)
    beta = torch.rand(batch, num_tokens, num_v, device=DEVICE).to(dtype)
    log_decay = -torch.rand(batch, num_tokens, num_v, device=DEVICE)
    real = num_tokens - 3 if num_tokens > 3 else num_tokens
    last = batch - 1  # the last row is padded after `real` tokens
    beta[last, real:], log_decay[last, real:] = 0, 0
    want_out, want_state = gated_delta_reference(None, query, key, value, beta, log_decay.exp())
    have_out, have_state = rule(query, key, value, beta, log_decay)
    torch.testing.assert_close(have_out, want_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(have_state, want_state, atol=tolerance, rtol=tolerance)
    _, real_state = gated_delta_reference(
        None, *(t[last:, :real] for t in (query, key, value, beta, log_decay.exp()))
    )
    torch.testing.assert_close(have_state[last:], real_state, atol=tolerance, rtol=tolerance)


@needs_kernels
def test_the_prefill_rule_picks_its_kernel_per_call_inside_one_compiled_graph(monkeypatch):
    """Short prompts take the token-by-token kernel, long ones the chunked form, and a compiled
    caller traces the choice as one opaque op: one graph for both lengths, no recompile."""
    from torch._dynamo.testing import CompileCounter

    monkeypatch.setattr(engine_linear_attention, "CHUNKED_MIN_TOKENS", 48)
    calls = {"gated_delta": 0, "chunked_gated_delta": 0}
    for name in calls:
        counted = _counted(getattr(engine_linear_attention, name), name, calls)
        monkeypatch.setattr(engine_linear_attention, name, counted)
    rule = engine_linear_attention.prefill_delta_rule
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(rule, backend=counter, dynamic=True, fullgraph=True)
    for num_tokens, kernel in [(20, "gated_delta"), (70, "chunked_gated_delta")]:
        torch.manual_seed(num_tokens)
        query = F.normalize(torch.randn(2, num_tokens, 2, 32, device=DEVICE), dim=-1) * 32**-0.5
        key = F.normalize(torch.randn(2, num_tokens, 2, 32, device=DEVICE), dim=-1)
        value = torch.randn(2, num_tokens, 4, 32, device=DEVICE)
        beta = torch.rand(2, num_tokens, 4, device=DEVICE)
        log_decay = -torch.rand(2, num_tokens, 4, device=DEVICE)
        before = dict(calls)
        have_out, have_state = compiled(query, key, value, beta, log_decay)
        assert calls[kernel] == before[kernel] + 1
        want_out, want_state = gated_delta_reference(None, query, key, value, beta, log_decay.exp())
        torch.testing.assert_close(have_out, want_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(have_state, want_state, atol=1e-4, rtol=1e-4)
    assert counter.frame_count == 1


def staggered_greedy(model, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """Requests join one per step into scattered slots while the others decode."""
    graphs = "capture" if DEVICE == "cuda" else "off"
    runner = ModelRunner(
        model, num_slots=8, max_len=512, graphs=graphs, compile="off", one_row_gemv=True
    )
    slots, running, done = [7, 2, 5, 0, 3], [], {}
    for index, ids in [*enumerate(prompts), *[(None, None)] * num_new]:
        if ids is not None:
            logits = runner.prefill(PromptInputs(ids, {}), [slots[index]])
            running.append({"i": index, "pos": len(ids), "out": [int(logits.argmax())]})
        if not running:
            break
        logits = runner.decode(
            [slots[r["i"]] for r in running],
            [r["pos"] for r in running],
            [r["out"][-1] for r in running],
        )
        for row, r in enumerate(running):
            r["out"].append(int(logits[row].argmax()))
            r["pos"] += 1
        done.update({r["i"]: r["out"][:num_new] for r in running if len(r["out"]) >= num_new})
        running = [r for r in running if len(r["out"]) < num_new]
    return [done[i] for i in range(len(prompts))]


def _counted(kernel, name: str, calls: dict[str, int]):
    def call(*args, **kwargs):
        calls[name] += 1
        return kernel(*args, **kwargs)

    return call


@needs_kernels
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_the_runner_decodes_the_same_tokens_with_its_kernels(tiny_path, family, monkeypatch):
    from areno.models import get_adapter
    from areno.models.registry import read_model_type

    calls = {"decode_attention": 0, "gated_delta": 0, "chunked_gated_delta": 0, "gemv": 0}
    for module, name in [
        (gemv_kernel, "gemv"),
        (engine_attention, "decode_attention"),
        (engine_linear_attention, "gated_delta"),
        (engine_linear_attention, "chunked_gated_delta"),
    ]:
        monkeypatch.setattr(module, name, _counted(getattr(module, name), name, calls))
    # The 140-token prompt prefills in chunks, the others token by token.
    monkeypatch.setattr(engine_linear_attention, "CHUNKED_MIN_TOKENS", 64)
    path = tiny_path(family)
    model = get_adapter(read_model_type(path)).load_model(path, dtype=torch.float32).to(DEVICE)
    torch.manual_seed(0)
    # 140 tokens: that row's keys cross a split of the attention kernel.
    prompts = [torch.randint(5, 500, (n,)).tolist() for n in (9, 40, 17, 140, 3)]
    # Under the interpreter 4 tokens a request: the last to join still decodes beside the others.
    num_new = 4 if INTERPRETED else 8
    with references_only():
        want = staggered_greedy(model, prompts, num_new)
    assert not any(calls.values())
    have = staggered_greedy(model, prompts, num_new)
    assert have == want
    assert calls["decode_attention"] > 0  # every family has full-attention layers
    # A prompt's logits, and the first request's decode step alone.
    assert calls["gemv"] > 0
    # Qwen3.5's linear attention: decode steps and short prefills token by token, the long
    # prefill in chunks.
    assert (calls["gated_delta"] > 0) == (family == "qwen3_5")
    assert (calls["chunked_gated_delta"] > 0) == (family == "qwen3_5")


def test_splits_are_as_few_as_fill_the_programs():
    """Keys a split: whole 128-key blocks; one split a row once rows x KV heads reach the
    programs wanted (no combine), else as many as fill them, never finer than a block."""
    assert split_keys(rows=256, kv_heads=8, kv_len=512, programs=528) == 512
    assert split_keys(rows=64, kv_heads=8, kv_len=384, programs=528) == 256  # 2 splits
    assert split_keys(rows=1, kv_heads=8, kv_len=4096, programs=528) == 128  # 32: every block
    assert split_keys(rows=1, kv_heads=2, kv_len=100, programs=528) == 128
    assert split_keys(rows=4, kv_heads=2, kv_len=1000, programs=1) == 1024
