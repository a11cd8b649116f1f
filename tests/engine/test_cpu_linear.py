"""The engine's oneDNN-packed linear layers on CPU: the same logits as transformers' own layers,
in force only inside the engine's forwards, and repacked when the Worker takes new weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from areno.engine.layers.cpu_linear import PackedLinears, can_pack, packed_linear
from areno.engine.parallel.worker import Worker
from areno.engine.runner.model_runner import ModelRunner
from areno.processing.types import PromptInputs

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.fixture(scope="module")
def model(tiny_path):
    from areno.models.registry import adapter_for_checkpoint

    path = tiny_path("qwen3_5")
    return adapter_for_checkpoint(path).load_model(path, dtype=torch.float32).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_packed_layers_give_transformers_logits_and_only_inside_the_context(model):
    assert can_pack(model)
    linears = PackedLinears(model)
    plain_layers = [m for m in model.modules() if type(m) is nn.Linear]
    assert len(linears) == len(plain_layers) > 0
    ids = torch.randint(5, 500, (3, 17), generator=torch.Generator().manual_seed(0))
    reference = logits(model, ids)
    with linears:
        assert all("forward" in vars(m) for m in plain_layers)
        packed = logits(model, ids)
    assert all("forward" not in vars(m) for m in plain_layers)
    torch.testing.assert_close(packed, reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits(model, ids), reference, atol=0, rtol=0)


def fresh_model(tiny_path, family: str = "qwen3_5") -> nn.Module:
    """A model of its own: fusing projections rewires a model's layers for good."""
    from areno.models.registry import adapter_for_checkpoint

    path = tiny_path(family)
    return adapter_for_checkpoint(path).load_model(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("fuse", ["off", "on"])  # on: gate_proj is a sibling of a fused group
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])  # gemma4: lm_head tied, unnamed
def test_worker_repacks_the_weights_it_loads(tiny_path, family, fuse):
    model = fresh_model(tiny_path, family)
    worker = Worker(
        model, num_slots=2, max_len=64, sample=True, packed_linear=True, fuse_projections=fuse
    )
    assert worker.runner.linears is not None
    assert (worker.runner.fused is not None) == (fuse == "on")
    prompt = PromptInputs(torch.randint(5, 500, (9,)).tolist(), {})
    before = torch.tensor(worker.score(prompt).logprobs)

    params = dict(model.named_parameters())
    mlp = next(n for n in params if n.endswith("mlp.down_proj.weight"))
    gate = next(n for n in params if n.endswith("mlp.gate_proj.weight"))
    embed = next(n for n, p in params.items() if p is model.get_input_embeddings().weight)
    torch.manual_seed(1)
    worker.load_weights([(n, torch.randn_like(params[n])) for n in (mlp, gate, embed)])
    after = torch.tensor(worker.score(prompt).logprobs)

    # The reference: the same weights through transformers' own layers (no packed copy at all).
    reference = Worker(model, num_slots=2, max_len=64, sample=True, packed_linear=False)
    assert reference.runner.linears is None
    expected = torch.tensor(reference.score(prompt).logprobs)
    assert not torch.allclose(after, before, atol=1e-3)
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=1e-4)


def test_the_packed_op_is_a_linear_layer():
    """The op names a packed weight by its PackedLinears' number and its index there."""
    gen = torch.Generator().manual_seed(0)
    layers = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16, bias=False))
    linears = PackedLinears(layers)
    x = torch.randn(3, 5, 32, generator=gen)
    first, second = layers
    torch.testing.assert_close(
        packed_linear(x, linears.number, 0, 48, first.bias), x @ first.weight.T + first.bias
    )
    y = torch.randn(4, 48, generator=gen)
    torch.testing.assert_close(packed_linear(y, linears.number, 1, 16, None), y @ second.weight.T)
    # inference only: the engine never differentiates through it
    torch.library.opcheck(packed_linear, (x, linears.number, 0, 48, first.bias.detach()))


def test_a_compiled_forward_over_packed_layers_is_cached_for_the_next_start(tmp_path, monkeypatch):
    """Inductor's and AOTAutograd's caches keep a graph that calls the packed op (one holding
    oneDNN tensors as constants could not be pickled, so each start compiled it again)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    layers = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Linear(48, 16)).eval()
    linears = PackedLinears(layers)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), linears:
        want = layers(x)
        for _ in range(2):  # a start, then a start that finds the cache
            torch._dynamo.reset()
            counters.clear()
            have = torch.compile(layers, backend="inductor")(x)
            torch.testing.assert_close(have, want)
    assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0


@pytest.mark.parametrize("fuse", [False, True])
def test_a_compiled_decode_step_runs_the_packed_layers(model, tiny_path, fuse):
    """A compiled CPU decode keeps the packed matmuls (the custom op, which torch.compile does
    not look into; inductor cannot lower oneDNN's linear on weights it did not freeze) and
    gives the uncompiled step's logits, in one graph. Fused, each group is one packed matmul."""
    from torch._dynamo.utils import counters

    from areno.engine.runner.compiled import CompiledForward

    # Fused, each runner gets a model of its own (the same checkpoint): fusing rewires a model's
    # layers, and two fusings of one model would leave the first group's weight unviewed.
    models = {c: fresh_model(tiny_path) if fuse else model for c in ("off", "eager")}

    targets: list = []

    def recording(graph_module, example_inputs):
        targets.extend(node.target for node in graph_module.graph.nodes)
        return graph_module

    runners = {
        compile: ModelRunner(
            models[compile],
            num_slots=4,
            max_len=64,
            graphs="static",
            compile=compile,
            packed_linear=True,
            fuse_projections=fuse,
        )
        for compile in ("off", "eager")
    }
    compiled = runners["eager"].graphs
    compiled._model = CompiledForward(models["eager"], recording, "the decode step")
    counters.clear()
    logits = {}
    for compile, runner in runners.items():
        assert runner.linears is not None
        for slot in range(3):
            runner.prefill(PromptInputs([5 + slot, 9, 11, 13], {}), [slot])
        logits[compile] = runner.decode([0, 1, 2], [4, 4, 4], [7, 8, 9])
    assert compiled.compiled
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {}
    text_linears = [
        name
        for name, m in models["eager"].named_modules()
        if type(m) is nn.Linear and "visual" not in name
    ]
    fused = runners["eager"].fused
    grouped = sum(len(g.linears) - 1 for g in fused.groups) if fused else 0
    assert grouped > 0 if fuse else grouped == 0
    assert targets.count(torch.ops.areno.packed_linear.default) == len(text_linears) - grouped
    assert torch.ops.mkldnn._linear_pointwise.default not in targets
    torch.testing.assert_close(logits["eager"], logits["off"], atol=1e-5, rtol=1e-5)


def test_a_compiled_decode_step_follows_repacked_weights(tiny_path):
    """A weight update repacks into new tensors: the compiled step must read those, not the
    packed tensors it was traced with."""
    from areno.models.registry import adapter_for_checkpoint

    path = tiny_path("qwen3_5")
    model = adapter_for_checkpoint(path).load_model(path, dtype=torch.float32).eval()
    compiled = ModelRunner(
        model, num_slots=2, max_len=64, graphs="static", compile="aot_eager", packed_linear=True
    )
    plain = ModelRunner(model, num_slots=2, max_len=64)  # aten's matmul on the plain weights

    def step(runner: ModelRunner) -> torch.Tensor:
        for slot in range(2):
            runner.prefill(PromptInputs([5 + slot, 9, 11], {}), [slot])
        return runner.decode([0, 1], [3, 3], [7, 8])

    before = step(compiled)  # the compile
    weight = next(p for n, p in model.named_parameters() if n.endswith("mlp.down_proj.weight"))
    with torch.no_grad():
        weight.copy_(torch.randn_like(weight))
    compiled.linears.repack([weight])
    after = step(compiled)
    assert not torch.allclose(after, before, atol=1e-3)
    torch.testing.assert_close(after, step(plain), atol=1e-4, rtol=1e-4)


def test_the_switch_must_be_a_bool():
    from areno.engine.config import EngineConfig
    from areno.errors import ConfigError

    assert EngineConfig(cpu_packed_linear=False).cpu_packed_linear is False
    with pytest.raises(ConfigError, match="cpu_packed_linear must be true or false; got 'no'"):
        EngineConfig(cpu_packed_linear="no")
