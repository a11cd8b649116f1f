"""A torch.compile'd forward of the engine's (the decode step's, the batched prefill's) that
stays generic in its sizes, reuses Dynamo's traces a previous start saved, and falls back to
running uncompiled when compiling fails."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
from torch._dynamo.exc import TorchDynamoException

from areno.engine import compile_cache
from areno.engine.runner.saved_traces import NotSaved, SavedTraces, supported, traced_method

log = logging.getLogger(__name__)

# The backends whose compiled graphs torch saves with a trace (AOTAutograd's, Inductor's);
# "eager" hands back the traced graph module itself, which it does not.
SAVED_BACKENDS = ("inductor", "aot_eager")


class CompiledForward:
    """`forward` compiled with `backend` (a torch.compile backend, by name or callable; None:
    never compiled) and dynamic sizes.

    Where AReno keeps a compile cache (areno/engine/compile_cache.py), its Dynamo traces are
    saved there and a later start loads them (`SavedTraces`); a trace that cannot be saved or
    loaded leaves the forward to torch.compile as before, with one log line saying why.
    A compile error logs a warning naming `what`, and from then on `forward` runs uncompiled:
    compiling happens before the graph runs, so nothing was written yet when it fails.
    """

    def __init__(self, forward: Callable[..., Any], backend: str | Callable | None, what: str):
        self.forward = forward
        self.what = what
        self._compiled = None
        self.saved: SavedTraces | None = None
        if backend is not None:
            self._compiled = torch.compile(forward, backend=backend, dynamic=True)
            self.saved = _saved_traces(forward, backend, what)

    @property
    def compiled(self) -> bool:
        """Whether calls run compiled (False after a compile error fell back)."""
        return self._compiled is not None

    def __call__(self, *args, **kwargs):
        if self._compiled is not None:
            try:
                with _generic_sizes():
                    if self.saved is not None:
                        return self._run_saved(args, kwargs)
                    return self._compiled(*args, **kwargs)
            except TorchDynamoException as error:
                log.warning(
                    "compiling %s failed, running it uncompiled: %s", self.what, _first_line(error)
                )
                self._compiled = None
        return self.forward(*args, **kwargs)

    def _run_saved(self, args: tuple, kwargs: dict) -> Any:
        """The call through a saved trace (tracing and saving one where none accepts it); where
        tracing or saving fails, through torch.compile from then on."""
        try:
            return self.saved(*args, **kwargs)
        except NotSaved as error:
            log.warning("the trace of %s is not saved, compiling it unsaved: %s", self.what, error)
            self.saved = None
            return self._compiled(*args, **kwargs)


def _saved_traces(forward: Callable, backend: str | Callable, what: str) -> SavedTraces | None:
    """The saved traces of `forward` in the compile cache; None without a compile cache, for a
    backend whose graphs torch cannot save (`SAVED_BACKENDS`; a test's recorder, which nothing
    names across processes), where a saved trace could not stand for a call
    (`traced_method`), or where this torch cannot save one (`supported`)."""
    root = compile_cache.current()
    method = traced_method(forward)
    if root is None or backend not in SAVED_BACKENDS or method is None or not supported():
        return None
    return SavedTraces(method, backend, root, what)


@contextlib.contextmanager
def _generic_sizes():
    # NOTE: without duck sizing, one compile stays generic in every size. With it, a size equal
    # to another (2 rows and 2 KV heads, a 128-key bucket and head_dim 128) was made the same
    # symbol and pinned by the static one, and every other shape recompiled (a minute on a GPU).
    # Python floats (a norm's epsilon, an attention scale) stay constants: made symbolic, the
    # one that cannot become a tensor made Dynamo trace the whole forward a second time,
    # specialized, on every start.
    with fx_config.patch(use_duck_shape=False), dynamo_config.patch(specialize_float=True):
        yield


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
