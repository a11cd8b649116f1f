"""A completions request's prompts on the Generator deployment, side by side: each prompt is its
own Generator request (so a batch spreads over the replicas), and all of them answer or the
first failure cancels the rest (their engine work stops) and is the reply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from areno.engine.outputs import RequestOutput, TokenScores
from areno.serve.completions import PreparedCompletion
from areno.serve.errors import unwrap


def _cancel(responses: Sequence[Any]) -> None:
    for response in responses:
        response.cancel()


async def _gather(responses: Sequence[Any], awaitables: Sequence[Any] | None = None) -> list:
    """The results of `awaitables` (by default the Serve responses themselves), in order; on a
    failure (or cancellation, or a Refused result) every response is cancelled."""
    try:
        results = await asyncio.gather(*(responses if awaitables is None else awaitables))
        return [unwrap(result) for result in results]
    except BaseException:
        _cancel(responses)
        raise


class PromptBatch:
    """One request's prompts on the Generator handles (`unary` for whole replies, `streaming`
    for per-step outputs); request ids `<request_id>-<prompt index>`."""

    def __init__(self, unary: Any, streaming: Any, prepared: PreparedCompletion, request_id: str):
        self.unary, self.streaming = unary, streaming
        self.prepared, self.request_id = prepared, request_id
        self.streams: list[Any] = []
        self.calls: list[Any] = []  # every Generator call made, for `cancel`

    def cancel(self) -> None:
        """Cancel every Generator call of the batch (a server that stops cuts it off)."""
        _cancel(self.calls)

    def _started(self, calls: list[Any]) -> list[Any]:
        self.calls += calls
        return calls

    async def scores(self) -> list[TokenScores | None]:
        """Each prompt's TokenScores when its logprobs are echoed (None each otherwise)."""
        prepared = self.prepared
        if not prepared.scores_prompts:
            return [None] * len(prepared.prompts)
        num_top = prepared.request.logprobs
        return await _gather(
            self._started(
                [
                    self.unary.score.remote(p.inputs, prepared.adapter, num_top)
                    for p in prepared.prompts
                ]
            )
        )

    async def outputs(self) -> list[RequestOutput | None]:
        """Each prompt's merged output (None each when nothing is generated)."""
        params = self.prepared.params
        if params is None:
            return [None] * len(self.prepared.prompts)
        return await _gather(
            self._started(
                [
                    self.unary.generate_all.remote(p.inputs, params, f"{self.request_id}-{i}")
                    for i, p in enumerate(self.prepared.prompts)
                ]
            )
        )

    async def open_streams(self) -> list[RequestOutput]:
        """Start each prompt's stream and return its first output: a request-level error (too
        long, queue full) surfaces here, before any byte of the reply is sent."""
        params = self.prepared.params
        if params is None:
            return []
        self.streams = self._started(
            [
                self.streaming.generate.remote(p.inputs, params, f"{self.request_id}-{i}")
                for i, p in enumerate(self.prepared.prompts)
            ]
        )
        return await _gather(self.streams, [stream.__anext__() for stream in self.streams])

    async def rest(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of the streams' remaining outputs as they come. A failure of
        one, or the consumer leaving early (a client gone), cancels them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: Any) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((i, unwrap(output)))
            except Exception as error:  # noqa: BLE001 - the consumer raises it
                queue.put_nowait((i, error))
                return
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(self.streams)]
        num_open = len(tasks)
        try:
            while num_open:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    num_open -= 1
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            _cancel(self.streams)
