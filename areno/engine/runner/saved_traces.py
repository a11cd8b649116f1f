"""Dynamo's traces of a compiled forward, saved beside the compile cache so that a later start
loads them instead of tracing the model's Python again.

A warm compile cache (areno/engine/compile_cache.py) holds Inductor's and AOTAutograd's graphs,
but Dynamo still traced the decode step and the batched prefill through the model's code on every
start: most of a warm start's compile (docs/performance.md, "Start-up"). torch's `aot_compile`
(`torch.compile(...).aot_compile`) traces one call into a whole graph and returns a function that
holds its guards, the bytecode around the graph and the backend's compiled artifacts; it saves to
a file, and `torch.compiler.load_compiled_function` loads it in a fresh process in a fraction of
a second. `SavedTraces` keeps those of one forward: a call runs the first one whose guards accept
its inputs; a call none accepts is traced, saved and kept (as Dynamo recompiles).

A trace's directory is `<compile cache>/traces/<key>`: the key names what changes the traced
code and what its saved guards cannot check (`trace_key`). torch saves only the guards it can
rebuild in another process (`_reusable_guards` says which are left out and why). A file that
fails to load (another torch, a changed source, a missing reference) is removed with the
forward's others, which are traced again, with one log line naming why. A forward that cannot
be traced whole (a graph break) compiles as torch.compile does; one whose trace does not save
(an object torch cannot serialize) runs that trace unsaved. Either way its directory's
`unsaved` file says why, and later starts compile as torch.compile does without trying."""

from __future__ import annotations

import builtins
import contextlib
import dis
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import areno
from areno.engine import compile_cache

log = logging.getLogger(__name__)

TRACES_DIR = "traces"
# In a forward's directory: why its traces cannot be saved, so that later starts do not try.
UNSAVED = "unsaved"

# Dynamo's marks of a tensor's dimensions (torch._dynamo.mark_static and its kin), which its
# guards compare with the marks at trace time.
_DIM_MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_weak_dynamic_indices",
    "_dynamo_unbacked_indices",
    "_dynamo_strict_unbacked_indices",
    "_dynamo_static_indices",
)


class NotSaved(Exception):
    """A call's trace could not be made whole or saved (a graph break, a guard or an object
    torch cannot serialize)."""


class SavedTraces:
    """The saved traces of `method` (a model's bound forward, `what` it is) compiled with
    `backend` and dynamic sizes, under the compile cache `root`. At the first call (in the
    engine's compile phase, when the runner has put its layers into the model) the key is taken
    and the traces there are loaded; new ones are saved as they are traced.

    Calling it runs the first trace whose guards accept the call (tracing one when none does).
    Where a trace cannot be made, or could not be saved at a previous start (its `unsaved`
    file), it raises `NotSaved`; the caller then compiles the way torch.compile does. A trace
    made but not saved runs this process's calls unsaved (`_keep_unsaved`)."""

    def __init__(self, method: types.MethodType, backend: str, root: Path, what: str):
        self.method = method
        self.backend = backend
        self.root = root
        self.what = what
        self.directory: Path | None = None
        self.traces: list[Any] | None = None
        self.num_loaded = 0
        self.num_traced = 0
        # False once a trace could not be saved: later ones run unsaved too.
        self.saves = True

    def __call__(self, *args, **kwargs):
        if self.traces is None:
            self.directory = (
                self.root / TRACES_DIR / trace_key(self.what, self.method, self.backend)
            )
            if (reason := unsaved_reason(self.directory)) is not None:
                raise NotSaved(f"a start before could not save it ({self.directory}): {reason}")
            self._load()
        owner = self.method.__self__
        for trace in self.traces:
            if _accepts(trace, owner, args, kwargs):
                return trace(owner, *args, **kwargs)
        if self.traces:
            reason = " | ".join(
                f"{i}: {_first_failure(trace, owner, args, kwargs)}"
                for i, trace in enumerate(self.traces)
            )
            log.info("%s: no trace accepts this call (%s), tracing it", self.directory, reason)
        try:
            trace = self._trace(args, kwargs)
        except Exception as error:
            reason = f"{type(error).__name__}: {_first_line(error)}"
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / UNSAVED).write_text(reason + "\n")
            raise NotSaved(reason) from error
        return trace(owner, *args, **kwargs)

    def __reduce__(self):
        # NOTE: a trace saves the guards' view of its inputs, the model's own attributes
        # included; during a prefill the text stack's patched forward reaches this object
        # (batched_prefill.last_real_positions), whose traces' guard managers do not pickle.
        # Nothing is guarded on it: it saves as nothing.
        return _nothing, ()

    def _trace(self, args: tuple, kwargs: dict) -> Any:
        if len(self.traces) >= torch._dynamo.config.recompile_limit:
            raise RuntimeError(f"more than {len(self.traces)} traces of one forward")
        if (reason := unsaved_backend_reason(self.backend)) is not None:
            raise RuntimeError(reason)
        with _aot_compile_enabled():
            compiled = torch.compile(
                self.method,
                backend=self.backend,
                dynamic=True,
                fullgraph=True,
                options={"guard_filter_fn": _reusable_guards},
            )
        with _dim_marks_kept():
            trace = compiled.aot_compile((args, kwargs))
        if self.saves:
            try:
                self._save(trace, len(self.traces))
            except Exception as error:  # noqa: BLE001 - any failure: keep the trace unsaved
                self._keep_unsaved(error)
        trace.disable_guard_check()  # __call__ checks them first
        self.traces.append(trace)
        self.num_traced += 1
        compile_cache.traces["traced"] += 1
        return trace

    def _keep_unsaved(self, error: Exception) -> None:
        """A trace was made but not saved: it still runs this process's calls (compiling it
        again through torch.compile would double the compile), and the directory's `unsaved`
        file keeps later starts from tracing to save."""
        reason = f"{type(error).__name__}: {_first_line(error)}"
        log.warning("the trace of %s is not saved, running it unsaved: %s", self.what, reason)
        self.saves = False
        for partial in self.directory.glob(f"*.{os.getpid()}.tmp"):
            partial.unlink(missing_ok=True)
        for path in self.directory.glob("*.json"):
            if not path.with_suffix(".bin").exists():
                path.unlink(missing_ok=True)
        (self.directory / UNSAVED).write_text(reason + "\n")

    def _save(self, trace: Any, index: int) -> None:
        """`<index>.json` names the modules the trace's bytecode reads as globals of its own
        (Dynamo installs them by object id, which another process does not have); `<index>.bin`,
        written after it and atomically, is the trace."""
        self.directory.mkdir(parents=True, exist_ok=True)
        func_globals = self.method.__func__.__globals__
        modules = {
            instruction.argval: func_globals[instruction.argval].__name__
            for instruction in dis.get_instructions(trace.fn.__code__)
            if instruction.opname == "LOAD_GLOBAL"
            and isinstance(func_globals.get(instruction.argval), types.ModuleType)
        }
        names = self.directory / f"{index}.json"
        partial = names.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(modules))
        partial.replace(names)
        # torch 2.11 writes the file in place (later ones write it atomically): a start that
        # stopped midway, or another reading it meanwhile, would find it cut short.
        path = self.directory / f"{index}.bin"
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        trace.save_compiled_function(str(partial), external_data=self._external_data())
        partial.replace(path)

    def _load(self) -> None:
        self.traces = []
        for path in sorted(self.directory.glob("*.bin"), key=lambda p: int(p.stem)):
            try:
                trace = self._load_one(path)
            except Exception as error:  # noqa: BLE001 - any failure means: trace it again
                log.warning(
                    "the saved trace %s could not be used, tracing again: %s: %s",
                    path, type(error).__name__, _first_line(error),
                )  # fmt: skip
                for stale in self.directory.iterdir():
                    stale.unlink(missing_ok=True)
                self.traces = []
                return
            trace.disable_guard_check()
            self.traces.append(trace)
        self.num_loaded = len(self.traces)
        compile_cache.traces["loaded"] += self.num_loaded

    def _load_one(self, path: Path) -> Any:
        names = json.loads(path.with_suffix(".json").read_text())
        modules = {name: importlib.import_module(module) for name, module in names.items()}
        with path.open("rb") as file:
            trace = torch.compiler.load_compiled_function(
                file,
                f_globals={**self.method.__func__.__globals__, **modules},
                external_data=self._external_data(),
            )
        _check_sources(trace)
        return trace

    def _external_data(self) -> dict[str, Any]:
        """What a trace refers to but must not hold: the model (its weights are the running
        engine's), and the cells of the forward's closure (a decorated forward's inner function,
        which pickling by name would resolve to the decorated one)."""
        cells = self.method.__func__.__closure__ or ()
        return {"self": self.method.__self__} | {
            f"cell{i}": cell.cell_contents for i, cell in enumerate(cells)
        }


@functools.cache
def supported() -> bool:
    """Whether this torch traces a forward to save it and loads it back (`aot_compile`,
    `torch.compiler.load_compiled_function`); logs once where it does not."""
    # Asked of a whole-graph compile, the kind `_trace` makes.
    with _aot_compile_enabled():
        compiled = torch.compile(_nothing, fullgraph=True)
    can = callable(getattr(compiled, "aot_compile", None)) and hasattr(
        torch.compiler, "load_compiled_function"
    )
    if not can:
        log.info("torch %s does not save Dynamo traces: each start traces again", torch.__version__)
    return can


def unsaved_backend_reason(backend: str) -> str | None:
    """Why this torch cannot save a trace compiled with `backend`; None where it can.

    NOTE: a trace saves AOTAutograd's graphs as its cache does, which demands that the backend's
    compiled forward be an `OutputCode`. Inductor's is; aot_eager's is in later torches
    (`AOTEagerOutputCode`, 2.13 has it), but torch 2.11's is a plain function and its
    `aot_compile` fails with "expected OutputCode" after the whole trace. Said before tracing,
    it costs nothing."""
    debugging = importlib.import_module("torch._dynamo.backends.debugging")
    if backend == "aot_eager" and not hasattr(debugging, "AOTEagerOutputCode"):
        return f"torch {torch.__version__} cannot save aot_eager's graphs (no AOTEagerOutputCode)"
    return None


def _runtime_env_with_builtins() -> None:
    """NOTE: torch before 2.12 keeps out of a trace's saved globals the builtins its bytecode
    reads, then checks that every global it reads is among them: a forward reading `type`
    (transformers' code does) failed to trace ("Missing required external references:
    ['type']"; on an H100 with torch 2.11 no trace was made). Later torches add the builtins
    themselves. Here the environment torch builds for a trace gets them added too: each by
    the name it has in `builtins`, which pickles by that name."""
    from torch._dynamo import convert_frame

    capture = getattr(convert_frame, "GraphCaptureOutput", None)
    runtime_env = getattr(capture, "get_runtime_env", None)
    if runtime_env is None or getattr(runtime_env, "adds_builtins", False):
        return
    if torch.__version__ >= (2, 12):
        return

    @functools.wraps(runtime_env)
    def with_builtins(self):
        env = runtime_env(self)
        imported = getattr(env, "import_sources", {})
        for instruction in dis.get_instructions(env.bytecode):
            name = instruction.argval
            if (
                instruction.opname == "LOAD_GLOBAL"
                and name not in env.used_globals
                and name not in imported
                and hasattr(builtins, name)
            ):
                env.used_globals[name] = getattr(builtins, name)
        return env

    with_builtins.adds_builtins = True
    capture.get_runtime_env = with_builtins


def _aot_compile_enabled() -> contextlib.AbstractContextManager:
    """Within the block, `torch.compile` gives its whole-graph compiles an `aot_compile`.

    NOTE: torch attaches `aot_compile` to a compiled function as it makes it, and only while
    `torch._dynamo.config.enable_aot_compile` is set: off by default in torch 2.11 (whose
    `aot_compile`, `save_compiled_function` and `torch.compiler.load_compiled_function` are
    otherwise those `SavedTraces` uses), on in 2.13 and later. Set only around the compiles
    made here: every other compile keeps torch's default."""
    _runtime_env_with_builtins()
    if getattr(torch._dynamo.config, "enable_aot_compile", True):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(enable_aot_compile=True)


def traced_method(forward: Callable) -> types.MethodType | None:
    """The bound forward Dynamo traces for `forward` (a module or a module's bound forward);
    None where a saved trace could not stand for the call: a module with hooks, or a forward
    that is not a bound method."""
    if isinstance(forward, torch.nn.Module):
        module = forward
        if module._forward_hooks or module._forward_pre_hooks:
            return None
        forward = module.forward
    if not inspect.ismethod(forward) or not isinstance(forward.__self__, torch.nn.Module):
        return None
    return forward


def trace_key(what: str, method: types.MethodType, backend: str) -> str:
    """A short name for what a forward's traces depend on beyond torch's saved guards: which
    forward (`what`) and backend; the rank of a tensor-parallel group (whose shards have the same
    shapes); the model's configuration and structure (each module's path, class and its own
    patched forward, each parameter's and buffer's name, shape, dtype and device); and the source
    of AReno's engine and models. The versions of Python, torch and transformers and the device
    kind are the compile cache directory's own key."""
    module = method.__self__
    rank = "0/1"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = f"{torch.distributed.get_rank()}/{torch.distributed.get_world_size()}"
    parts = [
        what,
        backend,
        rank,
        f"{type(module).__module__}.{type(module).__qualname__}.{method.__func__.__qualname__}",
        _config_json(module),
        _structure(module),
        _areno_source_hash(),
    ]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return f"{what.replace(' ', '-')}-{digest}"


def _config_json(module: torch.nn.Module) -> str:
    config = getattr(module, "config", None)
    return config.to_json_string() if hasattr(config, "to_json_string") else repr(config)


def _structure(module: torch.nn.Module) -> str:
    lines = []
    for name, child in module.named_modules():
        patched = vars(child).get("forward")
        own = getattr(getattr(patched, "__func__", patched), "__qualname__", "")
        lines.append(f"{name} {type(child).__module__}.{type(child).__qualname__} {own}")
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        lines.append(f"{name} {tuple(tensor.shape)} {tensor.dtype} {tensor.device}")
    return "\n".join(lines)


@functools.cache
def _areno_source_hash() -> str:
    """The source of AReno's engine and models (what a forward runs), hashed: AReno's version
    alone does not change with an edit. The functions a trace inlined are checked again as it
    loads (`_check_sources`), wherever they live."""
    digest = hashlib.sha256()
    root = Path(areno.__file__).parent
    for path in sorted([*(root / "engine").rglob("*.py"), *(root / "models").rglob("*.py")]):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _reusable_guards(entries: Sequence[Any]) -> list[bool]:
    """Which of a trace's guards are saved with it: not those torch cannot serialize (object
    identities, dict versions, closures), nor those on globals (torch leaves them out of every
    saved trace by default), nor those on functions' code and defaults or the cells of a
    module's own patched forward (`forward.__func__.__closure__`), which torch rebuilds as its
    class's forward in another process and so cannot check there.

    NOTE: what those would check is fixed by the trace's key (the source, the module structure)
    or by the engine: the patched forwards' cells hold the engine's kernels, linears and adapters,
    whose `active` flag is set around every compiled call (`ModelRunner._engine_context`)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [
        not (
            entry.is_global
            or entry.guard_type in unsupported
            or unsupported.intersection(entry.derived_guard_types)
            or ".__code__" in entry.name
            or ".__defaults__" in entry.name
            or ".__func__.__closure__" in entry.name
        )
        for entry in entries
    ]


def _check_sources(trace: Any) -> None:
    """Raises where a source the trace inlined changed since it was traced."""
    from torch._dynamo.package import _hash_sourcelines

    for source in trace.source_info().inlined_sources:
        module = importlib.import_module(source.module)
        if _hash_sourcelines(module, source.firstlineno, source.lastlineno) != source.checksum:
            raise RuntimeError(
                f"{source.module} changed (lines {source.firstlineno}-{source.lastlineno})"
            )


def unsaved_reason(directory: Path) -> str | None:
    """Why a previous start could not save the traces kept in `directory`; None if it could."""
    path = directory / UNSAVED
    return path.read_text().strip() if path.is_file() else None


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0][:300] if str(error) else ""


def _accepts(trace: Any, owner: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the trace's guards accept the call; a guard that cannot even be evaluated on
    these inputs does not."""
    try:
        return trace.guard_check(owner, *args, **kwargs)
    except Exception:  # noqa: BLE001 - a guard that fails to evaluate rejects the call
        return False


def _first_failure(trace: Any, owner: Any, args: tuple, kwargs: dict) -> str:
    try:
        f_locals = trace.prepare_f_locals(owner, *args, **kwargs)
        debug = trace._artifacts.guard_manager.check_verbose(f_locals)
        return "; ".join(debug.verbose_code_parts)[:200]
    except Exception as error:  # noqa: BLE001 - only for the log line
        return type(error).__name__


def _nothing() -> None:
    return None


def _unpickle_marked(unpickle: Callable, args: tuple, marks: dict[str, Any]) -> torch.Tensor:
    tensor = unpickle(*args)
    for name, value in marks.items():
        setattr(tensor, name, value)
    return tensor


class _dim_marks_kept:
    """Within the block, the guards a trace saves keep its input tensors' dimension marks.

    NOTE: torch saves the guards' view of the inputs with tensors rebuilt on the meta device,
    without the marks `torch._dynamo.mark_static` set (the KV cache's storage has them,
    areno/engine/layers/cache.py); rebuilt in the next process, each tensor guard then demanded
    that the tensor have none, and no call passed."""

    def __enter__(self) -> None:
        from torch._dynamo.guards import GuardsStatePickler

        self._reduce = reduce = GuardsStatePickler.reducer_override

        def reducer_override(pickler, obj):
            out = reduce(pickler, obj)
            if isinstance(obj, torch.Tensor) and isinstance(out, tuple):
                marks = {name: getattr(obj, name) for name in _DIM_MARKS if hasattr(obj, name)}
                if marks and out[0] == GuardsStatePickler._unpickle_tensor:
                    return _unpickle_marked, (out[0], out[1], marks)
            return out

        GuardsStatePickler.reducer_override = reducer_override

    def __exit__(self, *exc) -> None:
        from torch._dynamo.guards import GuardsStatePickler

        GuardsStatePickler.reducer_override = self._reduce
