"""Where a chat request's time went on its way through the server, hop by hop, sent back in the
standard `Server-Timing` response header (W3C Server Timing: `name;dur=milliseconds`, which
browsers' developer tools and `benchmarks/serve_timeline.py` read).

The Ingress times its own stages one after another (`lap`) and adds what the replicas it called
measured themselves (`add`): the MediaDecoder's decoding and the Processor's encoding of a
request with media, and the engine's queue, prefill and decode of every request. What a hop
costs beyond the work at its end is the difference: `prompt` - `media-decode` -
`media-process`, and `generate` - the three `engine-*` entries.

    read            the body, from Serve's HTTP proxy
    parse           the request parsed, checked, its sampling parameters built
    encode | prompt a text prompt encoded here | a prompt with media through MediaDecoder and
                    Processor (media-decode, media-process: their own work)
    generate        the Generator replica called until the whole reply came back (non-streamed;
                    engine-queue, engine-prefill, engine-decode: the engine's own times)
    first-token     the Generator replica called until its first token came back (streamed: the
                    header leaves before the rest is known)
    reply           the reply built and recorded
    total           the request's arrival to its reply (or its stream's start)
"""

from __future__ import annotations

import time

from areno.engine.outputs import RequestTimings

HEADER = "Server-Timing"


class HopTimes:
    """A request's timing entries, from its arrival (time.perf_counter) on."""

    def __init__(self, arrival: float):
        self.arrival = arrival
        self._last = arrival
        self._entries: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        """The time since the last lap (or the arrival) was spent on `name`."""
        now = time.perf_counter()
        self._entries.append((name, now - self._last))
        self._last = now

    def add(self, name: str, seconds: float) -> None:
        """A part of the last lap that a replica measured itself."""
        self._entries.append((name, seconds))

    def add_engine(self, timings: RequestTimings | None) -> None:
        if timings is not None:
            self.add("engine-queue", timings.queue_s)
            self.add("engine-prefill", timings.prefill_s)
            self.add("engine-decode", timings.decode_s)

    def header(self) -> dict[str, str]:
        """The `Server-Timing` header of the entries so far and the total."""
        total = time.perf_counter() - self.arrival
        parts = [f"{name};dur={seconds * 1e3:.3f}" for name, seconds in self._entries]
        parts.append(f"total;dur={total * 1e3:.3f}")
        return {HEADER: ", ".join(parts)}


def parse_header(value: str) -> dict[str, float]:
    """A `Server-Timing` header's entries: name -> milliseconds (entries without a duration
    are left out)."""
    entries = {}
    for part in value.split(","):
        name, *params = (piece.strip() for piece in part.split(";"))
        for param in params:
            key, _, number = param.partition("=")
            if key == "dur" and name:
                entries[name] = float(number)
    return entries
