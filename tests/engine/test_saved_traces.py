"""Dynamo's traces of the compiled forwards saved in the compile cache
(areno/engine/runner/saved_traces.py): a second start in a fresh process loads them instead of
tracing, and generates what the first start and the uncompiled engine do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from areno.engine.runner.saved_traces import _reusable_guards, unsaved_backend_reason
from tests.engine.generating import FAMILIES

# torch 2.11 cannot save aot_eager's graphs with a trace (`unsaved_backend_reason`): there the
# engines of these tests compile with Inductor (slower), and the tests of aot_eager alone skip.
SAVED = "aot_eager" if unsaved_backend_reason("aot_eager") is None else "inductor"
saves_aot_eager = pytest.mark.skipif(
    unsaved_backend_reason("aot_eager") is not None,
    reason=str(unsaved_backend_reason("aot_eager")),
)
# The engines start where a GPU machine's serve would: on its GPU (decode captured).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# One engine start in a fresh process, as `areno serve` builds it: greedy outputs of a few
# prompts, the start-up line and the trace counts, as one JSON line.
START = """
import asyncio, json, sys
from areno.engine import compile_cache
from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.processing.types import PromptInputs

path, compile, device, options = sys.argv[1:5]
config = EngineConfig(
    max_running_prompts=4, max_context_len=128, device=device, dtype="float32",
    decode_compile=compile, prefill_compile=compile, **json.loads(options),
)
generator = Generator.from_config(path, config)
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompts = [[5, 9, 11, 13], [7, 3], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34]]

async def main():
    outs = await asyncio.gather(*(generator.generate_all(PromptInputs(p, {}), greedy) for p in prompts))
    return [out.samples[0].token_ids for out in outs]

try:
    tokens = asyncio.run(main())
    line = generator.describe_start_up()
finally:
    generator.shutdown()
traces = {key: compile_cache.traces[key] for key in ("loaded", "traced")}
print(json.dumps({"tokens": tokens, "traces": traces, "line": line}))
"""


def start(path, compile: str, cache, **options) -> dict:
    env = dict(os.environ, ARENO_COMPILE_CACHE=str(cache))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", START, str(path), compile, DEVICE, json.dumps(options)],
        env=env, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"log": done.stderr}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_start_loads_the_traces_and_generates_the_same(tiny_path, tmp_path, family):
    path = tiny_path(family)
    eager = start(path, "off", tmp_path / "eager-cache")
    first = start(path, SAVED, tmp_path / "cache")
    second = start(path, SAVED, tmp_path / "cache")

    assert first["traces"]["loaded"] == 0 and first["traces"]["traced"] > 0
    # Every graph the first start traced, the second loaded, and it traced none.
    assert second["traces"] == {"loaded": first["traces"]["traced"], "traced": 0}
    assert f"Dynamo traces {first['traces']['traced']} loaded, 0 traced" in second["line"]
    assert second["tokens"] == first["tokens"]
    # aot_eager runs the uncompiled operators: the same tokens as the engine without compiling.
    # Inductor's kernels round otherwise, which can flip a random model's near tie.
    if SAVED == "aot_eager":
        assert first["tokens"] == eager["tokens"]
    assert not list((tmp_path / "eager-cache").glob("*/traces/*"))


@pytest.mark.gpu  # on a GPU machine: its torch, its CUDA defaults; on CPU: their layers
def test_the_traces_of_a_gpu_engines_layers_save_and_load(tiny_path, tmp_path):
    """The layer routing a GPU engine runs by default (fused projections, products of one row
    on their op, the CPU's packed layers off) saves its traces too: Dynamo's saved guards
    pickle the routed forwards, and a closure over the router took its lock with it ("cannot
    pickle '_thread.lock' object": on an H100 no trace of the engine saved). Where a GPU is
    present the engines start on it with its torch: torch before 2.12 made no trace of a
    forward that reads a builtin ("Missing required external references: ['type']")."""
    path = tiny_path("qwen3_5")
    options = {"fuse_projections": "on", "one_row_gemv": "on", "cpu_packed_linear": False}
    first = start(path, SAVED, tmp_path / "cache", **options)
    second = start(path, SAVED, tmp_path / "cache", **options)
    assert "not saved" not in first["log"] and "could not be used" not in second["log"]
    assert first["traces"]["traced"] > 0
    assert second["traces"] == {"loaded": first["traces"]["traced"], "traced": 0}
    assert second["tokens"] == first["tokens"]


@pytest.mark.slow
def test_a_saved_trace_that_does_not_load_is_traced_again(tiny_path, tmp_path):
    """A damaged file: the start says so once, traces that forward again and generates what
    the start that saved it did."""
    path = tiny_path("qwen3_5")
    first = start(path, SAVED, tmp_path / "cache")
    (saved,) = (tmp_path / "cache").glob("*/traces/the-decode-step-*/0.bin")
    saved.write_bytes(saved.read_bytes()[:100])
    second = start(path, SAVED, tmp_path / "cache")
    assert second["traces"] == {"loaded": first["traces"]["traced"] - 1, "traced": 1}
    assert second["log"].count("could not be used, tracing again") == 1
    assert second["tokens"] == first["tokens"]


def test_no_trace_is_saved_with_the_compile_cache_off(tiny_path, tmp_path, monkeypatch):
    """ARENO_COMPILE_CACHE=off: the forwards compile as torch.compile does, nothing saved."""
    from areno.engine import compile_cache
    from areno.engine.runner.compiled import CompiledForward

    monkeypatch.setenv(compile_cache.ENV, "off")
    module = torch.nn.Linear(2, 2)
    forward = CompiledForward(module, "aot_eager", "a linear")
    assert forward.compiled and forward.saved is None


def test_a_torch_that_cannot_save_traces_compiles_as_torch_compile_does(
    tmp_path, monkeypatch, caplog
):
    """A torch without `torch.compiler.load_compiled_function`: the forward compiles unsaved
    from the start, nothing is written under the compile cache, and the engine says why once."""
    from areno.engine import compile_cache
    from areno.engine.runner import saved_traces
    from areno.engine.runner.compiled import CompiledForward

    (tmp_path / ".areno").touch()
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delattr(torch.compiler, "load_compiled_function")
    saved_traces.supported.cache_clear()
    try:
        with caplog.at_level("INFO", logger=saved_traces.__name__):
            module = _Breaking()
            forward = CompiledForward(module, "aot_eager", "a forward")
            again = CompiledForward(module, "aot_eager", "another forward")
    finally:
        saved_traces.supported.cache_clear()
    x = torch.randn(3, 4)
    assert forward.saved is None and again.saved is None and forward.compiled
    assert torch.allclose(forward(x), module(x))
    assert not (tmp_path / "traces").exists()
    assert caplog.text.count("does not save Dynamo traces") == 1


def test_a_trace_keeps_no_guard_another_process_cannot_rebuild():
    from torch._dynamo.types import GuardFilterEntry

    def entry(name: str, guard_type: str, is_global: bool = False, derived=()) -> object:
        return GuardFilterEntry(
            name=name, has_value=False, value=None, guard_type=guard_type,
            derived_guard_types=derived, is_global=is_global, orig_guard=None,
        )  # fmt: skip

    entries = [
        entry("L['input_ids']", "TENSOR_MATCH"),
        entry("L['self'].config.hidden_size", "CONSTANT_MATCH"),
        entry("G['torch'].x", "CONSTANT_MATCH", is_global=True),
        entry("L['self'].__class__", "CLASS_MATCH", derived=("ID_MATCH",)),
        entry("L['func'].__code__", "CONSTANT_MATCH", derived=("ID_MATCH",)),
        entry("L['func'].__defaults__", "SEQUENCE_LENGTH"),
        entry("L['self'].forward.__func__.__closure__[1].cell_contents.active", "CONSTANT_MATCH"),
    ]
    assert _reusable_guards(entries) == [True, True] + [False] * 5


class _Breaking(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        x = self.linear(x)
        torch._dynamo.graph_break()
        return x.relu()


@saves_aot_eager
def test_a_forward_that_breaks_compiles_unsaved_and_later_starts_do_not_try(tmp_path, monkeypatch):
    """A graph break leaves no whole graph to save: the call runs through torch.compile, and the
    forward's directory says so, so that the next start compiles it unsaved at once."""
    from areno.engine import compile_cache
    from areno.engine.runner.compiled import CompiledForward

    (tmp_path / ".areno").touch()
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    module = _Breaking()
    x = torch.randn(3, 4)
    forward = CompiledForward(module, "aot_eager", "a breaking forward")
    assert forward.saved is not None
    assert torch.allclose(forward(x), module(x))
    assert forward.compiled and forward.saved is None
    (unsaved,) = tmp_path.glob("traces/*/unsaved")
    assert "graph_break" in unsaved.read_text() or "Unsupported" in unsaved.read_text()
    traced = compile_cache.traces["traced"]
    again = CompiledForward(module, "aot_eager", "a breaking forward")
    assert torch.allclose(again(x), module(x))
    assert again.saved is None and compile_cache.traces["traced"] == traced


@saves_aot_eager
def test_a_trace_that_does_not_save_runs_unsaved_and_later_starts_do_not_try(tmp_path, monkeypatch):
    """A trace made whole whose saving fails (on an H100 the engine's traces raised "cannot
    pickle '_thread.lock' object") still runs the calls of its process, without compiling the
    forward again through torch.compile; its directory says why, and the next start compiles
    it as torch.compile does at once."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    from areno.engine import compile_cache
    from areno.engine.runner.compiled import CompiledForward

    (tmp_path / ".areno").touch()
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def unpicklable(self, path, external_data=None):
        with open(path, "wb") as file:
            file.write(b"cut short")
        raise TypeError("cannot pickle '_thread.lock' object")

    monkeypatch.setattr(AOTCompiledFunction, "save_compiled_function", unpicklable)
    module = _Small()
    x = torch.randn(3, 4)
    forward = CompiledForward(module, "aot_eager", "an unsaved forward")
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    assert torch.equal(forward(x), module(x)) and torch.equal(forward(2 * x), module(2 * x))
    assert forward.saved is not None and forward.saved.num_traced == 1
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames  # torch.compile never ran
    (unsaved,) = tmp_path.glob("traces/*/unsaved")
    assert "cannot pickle" in unsaved.read_text()
    assert [p.name for p in unsaved.parent.iterdir()] == ["unsaved"]  # nothing cut short
    again = CompiledForward(module, "aot_eager", "an unsaved forward")
    assert torch.equal(again(x), module(x))
    assert again.compiled and again.saved is None


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, scale: float = 1.0):
        return self.linear(x).relu() * scale


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("aot_eager", marks=saves_aot_eager),
        pytest.param("inductor", marks=pytest.mark.slow),
    ],
)
def test_a_loaded_trace_reads_the_weights_the_model_has_now(tmp_path, backend):
    """The weights are the trace's inputs, not its constants: a weight update (copied in place,
    as `update_weights` does) reaches a trace loaded before it; other shapes get a trace of
    their own, saved beside the first."""
    from areno.engine.runner.saved_traces import SavedTraces

    module = _Small()
    x = torch.randn(3, 4)
    first = SavedTraces(module.forward, backend, tmp_path, "a small forward")
    with torch.no_grad():
        assert torch.equal(first(x), module(x))
    loaded = SavedTraces(module.forward, backend, tmp_path, "a small forward")
    with torch.no_grad():
        module.linear.weight.mul_(-2.0)
        assert torch.equal(loaded(x), module(x))
        assert loaded.num_loaded == 1 and loaded.num_traced == 0
        y = torch.randn(2, 5, 4)
        assert torch.equal(loaded(y), module(y))
    assert loaded.num_traced == 1
    assert sorted(p.name for p in loaded.directory.glob("*.bin")) == ["0.bin", "1.bin"]


def test_traces_save_and_load_where_torch_offers_aot_compile_only_when_asked(tmp_path):
    """torch 2.11 gives a compiled function `aot_compile` only while
    `torch._dynamo.config.enable_aot_compile` is set, and it is off there by default (as here):
    traces are made, saved and loaded all the same, and compiles made elsewhere keep the
    default."""
    from areno.engine.runner import saved_traces
    from areno.engine.runner.saved_traces import SavedTraces

    default = torch._dynamo.config.enable_aot_compile
    # NOTE: through the config's own patch: monkeypatch's undo deletes the entry (it reads it
    # back as absent), which hides it from torch itself for the rest of the process.
    with torch._dynamo.config.patch(enable_aot_compile=False):
        saved_traces.supported.cache_clear()
        try:
            assert saved_traces.supported()
        finally:
            saved_traces.supported.cache_clear()
        backend = "aot_eager" if unsaved_backend_reason("aot_eager") is None else "inductor"
        module = _Small()
        x = torch.randn(3, 4)
        with torch.no_grad():
            first = SavedTraces(module.forward, backend, tmp_path, "a small forward")
            assert torch.equal(first(x), module(x)) and first.num_traced == 1
            loaded = SavedTraces(module.forward, backend, tmp_path, "a small forward")
            assert torch.equal(loaded(x), module(x))
        assert loaded.num_loaded == 1 and loaded.num_traced == 0
        assert not torch._dynamo.config.enable_aot_compile
        assert not hasattr(torch.compile(module.forward, fullgraph=True), "aot_compile")
    assert torch._dynamo.config.enable_aot_compile == default
