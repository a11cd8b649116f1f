"""Sibling projections fused into one matmul (areno/engine/layers/fused_linear.py)."""

from __future__ import annotations

import pytest
import torch

from areno.engine.layers.fused_linear import FusedLinears
from areno.engine.runner.model_runner import ModelRunner
from areno.models.registry import adapter_for_checkpoint
from areno.processing.types import PromptInputs

FAMILIES = ["qwen3_5", "qwen3_vl", "minicpmv4_6", "gemma4"]


def load(tiny_path, family):
    path = tiny_path(family)
    return adapter_for_checkpoint(path).load_model(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_projections_give_the_separate_ones_logits(tiny_path, family):
    """Batched and single prefills, then compiled padded decode steps (one graph, no break):
    the same logits as the unfused runner; the model outside the engine is unchanged, and its
    fused siblings' parameters are views of the fused weights."""
    from torch._dynamo.utils import counters

    plain_model, fused_model = load(tiny_path, family), load(tiny_path, family)
    ids = torch.randint(5, 500, (1, 12))
    reference = plain_model(input_ids=ids).logits
    kwargs = {"num_slots": 4, "max_len": 64, "graphs": "static", "compile": "eager"}
    plain = ModelRunner(plain_model, **kwargs)
    fused = ModelRunner(fused_model, fuse_projections=True, prefill_compile="eager", **kwargs)
    layer_types = plain.layer_types
    kinds = [group.names for group in fused.fused.groups]
    assert kinds.count(("gate_proj", "up_proj")) == len(layer_types)
    assert kinds.count(("q_proj", "k_proj", "v_proj")) == sum(
        t != "linear_attention" for t in layer_types
    )
    assert kinds.count(("in_proj_qkv", "in_proj_b", "in_proj_a", "in_proj_z")) == sum(
        t == "linear_attention" for t in layer_types
    )
    for group in fused.fused.groups:
        storage = group.weight.untyped_storage().data_ptr()
        assert all(m.weight.untyped_storage().data_ptr() == storage for m in group.linears)

    prompts = [PromptInputs(torch.randint(5, 500, (n,)).tolist(), {}) for n in (7, 9, 5)]
    for runner in (plain, fused):
        runner.prefill(prompts[2], [3])
    torch._dynamo.reset()
    counters.clear()
    want = plain.prefill_batch(prompts[:2], [[0], [1]])
    torch.testing.assert_close(fused.prefill_batch(prompts[:2], [[0], [1]]), want)
    positions, tokens = [7, 9, 5], [*want.argmax(-1).tolist(), 11]
    for _ in range(3):
        step = plain.decode([0, 1, 3], positions, tokens)
        torch.testing.assert_close(fused.decode([0, 1, 3], positions, tokens), step)
        positions, tokens = [p + 1 for p in positions], step.argmax(-1).tolist()
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(fused_model(input_ids=ids).logits, reference)


class Siblings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 4)
        self.k_proj = torch.nn.Linear(8, 2)
        self.v_proj = torch.nn.Linear(8, 2)


def test_siblings_called_out_of_order_or_on_other_inputs_compute_their_own():
    torch.manual_seed(0)
    module = Siblings()
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    want = {n: getattr(module, n)(t) for n, t in (("q_proj", x), ("k_proj", y), ("v_proj", x))}
    fused = FusedLinears.of(module)
    assert len(fused.groups) == 1
    with fused:
        got = {"k_proj": module.k_proj(y)}  # before q: its own matmul
        got["q_proj"] = module.q_proj(x)  # the fused matmul of x
        got["v_proj"] = module.v_proj(x)  # x's slice
        assert fused.groups[0].input is None  # the last sibling took the last slice
        got["k_proj_again"] = module.k_proj(y)  # another input: its own
    want["k_proj_again"] = want["k_proj"]
    for name, value in want.items():
        torch.testing.assert_close(got[name], value)


def test_a_weight_copied_into_a_sibling_reaches_the_fused_matmul():
    torch.manual_seed(0)
    module = Siblings()
    fused = FusedLinears.of(module)
    x = torch.randn(3, 8)
    with torch.no_grad():
        module.k_proj.weight.copy_(torch.ones(2, 8))
    with fused:
        module.q_proj(x)
        k = module.k_proj(x)
    torch.testing.assert_close(k, x.sum(-1, keepdim=True).expand(3, 2) + module.k_proj.bias)


def test_one_module_fused_twice_shares_its_groups_and_their_weights():
    """Two runners over one model get one FusedLinears: a weight written into a sibling reaches
    the fused matmul whichever runner steps, and nested `with` blocks keep it on to the last."""
    torch.manual_seed(0)
    module = Siblings()
    first, second = FusedLinears.of(module), FusedLinears.of(module)
    assert first is second and len(first.groups) == 1
    storage = first.groups[0].weight.untyped_storage().data_ptr()
    assert module.k_proj.weight.untyped_storage().data_ptr() == storage
    x = torch.randn(3, 8)
    with torch.no_grad():
        module.k_proj.weight.copy_(torch.ones(2, 8))
    want = x.sum(-1, keepdim=True).expand(3, 2) + module.k_proj.bias
    with first:
        with second:
            module.q_proj(x)
            torch.testing.assert_close(module.k_proj(x), want)
        assert first.active
        module.q_proj(x)
        assert first.groups[0].input is x  # still fused: q computed the group's outputs
        torch.testing.assert_close(module.k_proj(x), want)
    assert not first.active and first.groups[0].input is None
