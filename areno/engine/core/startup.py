"""What an engine runs before its first request, and how long each phase took.

`run_steps` allocates the cache and compiles the decode step, the batched prefill and the
prefill of parts of prompts now rather than in a request's time (a minute or more each for a 2B
model on an H200); `prefill_and_drop` is also how `Generator.warm_up` gives each media tower its
first forward. The phases a
Generator records (`Generator.start_up`): load (tokenizer, weights), cache (allocation),
compile (the compiled steps and, on CUDA, their first graph captures; absent when nothing is
compiled), warm-up (media towers). What compiling produces is kept for the next start in the
compile cache (areno/engine/compile_cache.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from areno.engine.kv.block_manager import blocks_for
from areno.engine.sampling import SamplingParams
from areno.engine.step import PrefillItem, RowSampling, StepInput
from areno.processing.types import PromptInputs

# The sampling row of a start-up step, whose token nobody reads.
_DROPPED_ROW = RowSampling(SamplingParams(temperature=0, max_tokens=1))


def run_steps(core: Any, times: dict[str, float], compiles: dict[str, float] | None = None) -> None:
    """A one-token prefill into slot 0 allocates the cache (raising CacheMemoryError where it
    does not fit, areno/engine/layers/cache.py); where they are compiled, a batched prefill of two
    prompts of unequal lengths into slots 0 and 1 (none where whole prompts run as parts:
    `CompiledPaths.batched_prefill`), prefills of parts of prompts
    (`_parts_prefill`), then a decode step of the smallest row bucket and one of the next. The
    compiles are generic in the row count and lengths (see areno/engine/runner/compiled.py);
    should a model's code still pin a size it first saw, the second decode step makes that
    recompile happen here, and a batched prefill of one prompt (a part of one) the compile of
    that batch size, where a lone prompt does not run beside a copy of itself (`_row_counts`).
    Outputs are dropped; the slots are free again after, and their next
    prefills overwrite what these wrote. Records "cache" and "compile" seconds in `times`, and
    in `compiles` the compile's seconds by forward (the batched prefill, the prefill of parts,
    the decode step): which of them a first start spends its time on."""
    paths = core.executor.compiled_paths()
    start = time.perf_counter()
    prefill_and_drop(core, PromptInputs([0], {}))
    times["cache"] = time.perf_counter() - start
    if not (paths.batched_prefill or paths.prefill_parts or paths.decode_buckets):
        return
    start = time.perf_counter()
    try:
        alone = not paths.lone_padded
        if paths.batched_prefill:
            _timed(compiles, "batched prefill", _batched_prefill, core, paths.num_blocks, alone)
        if paths.prefill_parts:
            _timed(compiles, "prefill of parts", _parts_prefill, core, paths.num_blocks, alone)
        if paths.decode_buckets:
            _timed(compiles, "decode step", _decode_steps, core, paths.decode_buckets)
    finally:
        times["compile"] = time.perf_counter() - start


def _timed(seconds: dict[str, float] | None, name: str, step, *args) -> None:
    began = time.perf_counter()
    step(*args)
    if seconds is not None:
        seconds[name] = time.perf_counter() - began


def _row_counts(core: Any, alone: bool) -> tuple[int, ...]:
    """The rows of the compiled prefills the start-up runs: two, then one where a lone prompt
    runs a graph of its own (`alone`; the compiled text stack specializes a batch of one, as
    torch.compile does every size-1 dimension, unless a lone prompt runs beside a copy of
    itself: `lone_padded`); one alone where one prompt runs at a time."""
    if core.scheduler.config.max_running_prompts == 1:
        return (1,)
    return (2, 1) if alone else (2,)


def _batched_prefill(core: Any, num_blocks: int, alone: bool) -> None:
    """Two prompts of unequal lengths, and one alone (`_row_counts`)."""
    for num_rows in _row_counts(core, alone):
        prompts = [PromptInputs([0] * n, {}) for n in (2, 3)[:num_rows]]
        # Blocks 1 and 2, or the sink for a pool of one block: nobody reads them after.
        tables = [[min(slot + 1, num_blocks)] for slot in range(len(prompts))]
        step = StepInput(
            prefill=[PrefillItem(p, [slot], [tables[slot]]) for slot, p in enumerate(prompts)],
            rows=[_DROPPED_ROW] * len(prompts),
        )
        core.executor.execute(step)


def _parts_prefill(core: Any, num_blocks: int, alone: bool) -> None:
    """Prompts prefilled in two parts each, as a long prompt's chunks and a resumption from the
    prefix cache are (`ModelRunner.prefill_parts`): two prompts together, and one alone
    (`_row_counts`). Each part reads more than one block, as every size the compile sees is
    more than one: it then stays generic in the parts' widths and starts and in their keys'
    length (a part's width is never one)."""
    config = core.scheduler.config
    num_tokens = min(2 * config.block_size + 2, config.max_context_len)
    cut = num_tokens // 2
    if cut < 2:
        return  # no part of a prompt this short is two tokens wide
    per_slot = blocks_for(num_tokens, config.block_size)
    for num_rows in _row_counts(core, alone):
        prompts = [PromptInputs([0] * num_tokens, {}) for _ in range(num_rows)]
        # Blocks past the sink, or the sink for a small pool: nobody reads them after.
        tables = [
            [min(1 + slot * per_slot + i, num_blocks) for i in range(per_slot)]
            for slot in range(num_rows)
        ]
        for start, end in ((0, cut), (cut, num_tokens)):
            items = [
                PrefillItem(p, [slot], [tables[slot]], start=start, end=end)
                for slot, p in enumerate(prompts)
            ]
            rows = [_DROPPED_ROW] * num_rows if end == num_tokens else []
            core.executor.execute(StepInput(prefill=items, rows=rows))


def _decode_steps(core: Any, buckets: list[int]) -> None:
    # One row decodes the smallest bucket; buckets[0] + 1 rows decode the next one.
    row_counts = [1] if len(buckets) == 1 else [1, buckets[0] + 1]
    for num_rows in row_counts:
        core.executor.execute(
            StepInput(
                decode_slots=list(range(num_rows)),
                decode_positions=[1] * num_rows,
                decode_token_ids=[0] * num_rows,
                rows=[_DROPPED_ROW] * num_rows,
            )
        )


def prefill_and_drop(core: Any, prompt: PromptInputs) -> None:
    """Prefill `prompt` into slot 0, which no request holds yet, and drop its token (the
    start-up runs; the next real prefill of slot 0 overwrites what it wrote)."""
    block_size = core.scheduler.config.block_size
    table = list(range(1, blocks_for(prompt.num_prompt_tokens, block_size) + 1))
    step = StepInput(prefill=[PrefillItem(prompt, [0], [table])], rows=[_DROPPED_ROW])
    core.executor.execute(step)


def describe(
    times: dict[str, float],
    cache: Path | None,
    cache_files: int,
    traces: Mapping[str, int] | None = None,
    compiles: Mapping[str, float] | None = None,
) -> str:
    """The phases with their seconds, and the compile cache where something was compiled: how
    many files it held, how many of Dynamo's traces it gave (`traces`: "loaded", "traced"), and
    the compile's seconds by forward (`compiles`)."""
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items())
    line = f"{phases} (total {sum(times.values()):.1f} s)"
    if "compile" in times and cache is not None:
        warmth = f"{cache_files} files" if cache_files else "empty"
        line += f"; compile cache {cache} ({warmth} at start)"
        if traces:
            line += f"; Dynamo traces {traces['loaded']} loaded, {traces['traced']} traced"
    if compiles:
        line += "; compiles: " + ", ".join(f"{name} {s:.1f} s" for name, s in compiles.items())
    return line
