"""The on-off state of a layer routing that is in force only inside the runner's forwards."""

from __future__ import annotations

import threading


class Switch:
    """On inside `with`: the blocks nest (runners over one model share a fused stack's, and a
    forward may enter inside another's), and it stays on until the outermost one exits, which
    calls `switched_off`."""

    def __init__(self):
        self.active = False
        self._depth = 0
        self._lock = threading.Lock()

    def __enter__(self):
        with self._lock:
            self._depth += 1
            self.active = True
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth:
                return
            self.active = False
            self.switched_off()

    def switched_off(self) -> None:
        """What to undo when the outermost block exits (nothing by default)."""
