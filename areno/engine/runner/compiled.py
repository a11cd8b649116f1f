"""A torch.compile'd forward of the engine's (the decode step's, the batched prefill's) that
stays generic in its sizes and falls back to running uncompiled when compiling fails."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
from torch._dynamo.exc import TorchDynamoException

log = logging.getLogger(__name__)


class CompiledForward:
    """`forward` compiled with `backend` (a torch.compile backend, by name or callable; None:
    never compiled) and dynamic sizes.

    A compile error logs a warning naming `what`, and from then on `forward` runs uncompiled:
    compiling happens before the graph runs, so nothing was written yet when it fails.
    """

    def __init__(self, forward: Callable[..., Any], backend: str | Callable | None, what: str):
        self.forward = forward
        self.what = what
        self._compiled = None
        if backend is not None:
            self._compiled = torch.compile(forward, backend=backend, dynamic=True)

    @property
    def compiled(self) -> bool:
        """Whether calls run compiled (False after a compile error fell back)."""
        return self._compiled is not None

    def __call__(self, *args, **kwargs):
        if self._compiled is not None:
            try:
                # NOTE: without duck sizing, one compile stays generic in every size. With it, a
                # size equal to another (2 rows and 2 KV heads, a 128-key bucket and head_dim
                # 128) was made the same symbol and pinned by the static one, and every other
                # shape recompiled (a minute on a GPU).
                # Python floats (a norm's epsilon, an attention scale) stay constants: made
                # symbolic, the one that cannot become a tensor made Dynamo trace the whole
                # forward a second time, specialized, on every start.
                with (
                    fx_config.patch(use_duck_shape=False),
                    dynamo_config.patch(specialize_float=True),
                ):
                    return self._compiled(*args, **kwargs)
            except TorchDynamoException as error:
                log.warning(
                    "compiling %s failed, running it uncompiled: %s",
                    self.what,
                    str(error).splitlines()[0] if str(error) else type(error).__name__,
                )
                self._compiled = None
        return self.forward(*args, **kwargs)
