"""The engine core: one step is schedule -> execute -> update (or, overlapped, schedule ->
launch -> update of the step before; see `EngineCore.step`).

`EngineCore` owns the scheduler and the output processor (what tokens become: text, stops,
grammar masks); the executor owns every tensor. It is single-threaded by design: the async
`Generator` calls it from one engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from areno.engine.core.scheduler import ScheduledPrefill, Scheduler, SchedulerConfig
from areno.engine.outputs import AbortCause, RequestOutput, RequestTimings, SampleDelta
from areno.engine.outputs.processor import OutputProcessor
from areno.engine.parallel.executor import Executor
from areno.engine.sampling import SamplingParams
from areno.engine.sequence import Sequence, SequenceGroup
from areno.engine.step import PendingStep, PrefillItem, RowSampling, StepInput, StepOutput
from areno.errors import ConfigError
from areno.processing.types import PromptInputs


class EngineCore:
    """Requests in, per-step `RequestOutput`s out; see the module docstring."""

    def __init__(
        self,
        executor: Executor,
        tokenizer: Any,
        scheduler_config: SchedulerConfig,
        eos_token_ids: Collection[int],
        *,
        overlap: bool = False,
    ):
        """`overlap`: launch each step before reading the previous one's tokens (see `step`);
        needs an executor with `launch` whose worker keeps the sampled tokens (one process)."""
        self.executor = executor
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(scheduler_config)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy_version = 0
        self.overlap = overlap
        self.outputs = OutputProcessor(
            tokenizer,
            self.eos_token_ids,
            lambda: executor.vocab_size,
            self.scheduler.max_context_len,
        )
        # The launched step whose tokens the host has not read: its rows' sequences, in order.
        self._in_flight: tuple[list[Sequence], PendingStep] | None = None
        # Host seconds in `step`: steps that prefilled (their decode rows with them) and
        # decode-only steps (a timeline's prefill and decode; on a GPU, with `overlap`, a
        # step's device work is paid in the next step's wait).
        self.prefill_s = 0.0
        self.decode_s = 0.0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's tokens are still unread (`flush` reads them)."""
        return self._in_flight is not None

    def check_request(self, inputs: PromptInputs, params: SamplingParams) -> None:
        """Raise the error `add_request` would raise for a request that can never run."""
        self.scheduler.check_fits(inputs.num_prompt_tokens)
        executor = self.executor
        executor.adapter_index(params.adapter)  # LoraError: not loaded
        too_large = [t for t, _ in params.logit_bias if t >= executor.vocab_size]
        if too_large:
            raise ConfigError(
                f"logit_bias names token ids {too_large} outside the vocabulary "
                f"(0..{executor.vocab_size - 1})",
                param="logit_bias",
            )
        self.outputs.check(params)  # GrammarError

    def add_request(
        self,
        request_id: str,
        inputs: PromptInputs,
        params: SamplingParams,
        *,
        stream: bool = True,
    ) -> None:
        """Queue a request; its outputs come from later `step()` calls. `stream` False: the
        caller reads its text only from the last output, which then carries all of it
        (decoded once, `OutputText`), and the other outputs carry none."""
        group = SequenceGroup.create(
            request_id,
            inputs.input_ids,
            params,
            inputs=inputs,
            can_chunk=True,
            whole_runs=self.executor.whole_runs(inputs),
        )
        self.scheduler.add(group)
        self.outputs.add(group.seqs, params, stream=stream)

    def abort(self, request_id: str, cause: AbortCause = AbortCause.CALLER) -> RequestOutput | None:
        """Stop a request now; returns its final output, whose unfinished samples end with
        finish_reason "abort" and `cause` (None if unknown or already done)."""
        group = self.scheduler.find(request_id)
        if group is None:
            return None
        unfinished = group.unfinished_seqs()
        self.scheduler.cancel(request_id)
        deltas = [
            SampleDelta(
                seq.sample_index,
                [],
                text=self.outputs.kept_text(seq),
                finish_reason="abort",
                abort_cause=cause,
            )
            for seq in unfinished
        ]
        self.outputs.forget(group.seqs)
        return self._output(group, deltas)

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the news of every request that had any.

        With `overlap`, the step is launched on the device first and the news returned are the
        previous step's: the host reads and processes its tokens (stops, text, outputs) while
        the device runs this one, whose decode rows take their input tokens from the device.
        A sequence that drew a stop token therefore decodes one step more, and that token is
        dropped; max_tokens and the context length are known ahead and cost no extra step.
        While a grammar-bound sequence runs, steps are not overlapped: its matcher must see each
        token before it masks the next (areno/engine/outputs/grammar.py).
        """
        start = time.perf_counter()
        outputs, prefilled = self._step()
        if prefilled:
            self.prefill_s += time.perf_counter() - start
        else:
            self.decode_s += time.perf_counter() - start
        return outputs

    def _step(self) -> tuple[list[RequestOutput], bool]:
        """`step`'s work; also whether it prefilled."""
        early = []
        overlap = self.overlap and not self.outputs.has_grammars
        if self._in_flight is not None and (not overlap or self.scheduler.would_preempt()):
            early = self.flush()  # only a sequence without a token in flight is preempted
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return early + self.flush(), False
        # Decode rows in slot order: running slots are mostly a packed range, which the runner
        # reads through views instead of gathering copies.
        decode = sorted(scheduled.decode, key=lambda seq: seq.slot)
        prefills = bool(scheduled.prefill)
        step = self._step_input(scheduled.prefill, decode, overlap)
        step.state_saves = scheduled.state_saves
        seqs = [seq for item in scheduled.prefill if item.is_final for seq in item.seqs] + decode
        if not overlap:
            return early + self._update(seqs, self.executor.execute(step)), prefills
        pending = self.executor.launch(step)
        outputs = self.flush()
        if pending is not None:  # None: only chunks that do not end their prompts ran
            for seq in seqs:
                seq.num_in_flight += 1
            self._in_flight = (seqs, pending)
        return early + outputs, prefills

    def flush(self) -> list[RequestOutput]:
        """Wait for the step in flight, if any, and return its news."""
        if self._in_flight is None:
            return []
        seqs, pending = self._in_flight
        self._in_flight = None
        result = pending.result()
        for seq in seqs:
            seq.num_in_flight -= 1
        return self._update(seqs, result)

    def _step_input(
        self, prefill: list[ScheduledPrefill], decode: list[Sequence], overlap: bool
    ) -> StepInput:
        step = StepInput(decode_block_tables=[])
        for item in prefill:
            inputs = item.group.inputs
            if item.num_tokens != inputs.num_prompt_tokens:  # a resumed sequence: its tokens too
                inputs = inputs.with_tokens(item.token_ids)
            slots = [seq.slot for seq in item.seqs]
            tables = [list(seq.block_ids) for seq in item.seqs]
            step.prefill.append(
                PrefillItem(
                    inputs,
                    slots,
                    tables,
                    item.start,
                    item.end,
                    item.cached,
                    item.restore_row,
                    item.copy_block,
                    item.saves,
                    item.seqs[0].params.adapter,
                )
            )
            if item.is_final:
                step.rows += [self._row(seq, prefill=True) for seq in item.seqs]
        for seq in decode:
            step.decode_slots.append(seq.slot)
            step.decode_positions.append(seq.next_position)
            step.decode_token_ids.append(seq.last_token_id)
            step.decode_block_tables.append(seq.block_ids)
            step.rows.append(self._row(seq))
        if overlap:
            step.decode_token_ids = None  # the worker's own, on the device (see `step`)
        if self.outputs.has_grammars:
            self.outputs.mask_grammar_rows(
                step, [s for item in prefill if item.is_final for s in item.seqs] + decode
            )
        return step

    def _row(self, seq: Sequence, prefill: bool = False) -> RowSampling:
        """How to sample `seq`'s next token: with its history when a penalised sequence is
        prefilled, and without its stop tokens before min_tokens (never set with a grammar:
        `SamplingParams` refuses the pair)."""
        params = seq.params
        drawn = seq.num_output_tokens + seq.num_in_flight
        row = RowSampling(params, seq.seed, drawn)
        if prefill and params.has_penalties:
            row.history = (list(seq.prompt_token_ids), list(seq.output_token_ids))
        if drawn < params.min_tokens:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= self.eos_token_ids
            row.banned = tuple(sorted(stops))
        return row

    def _update(self, seqs: list[Sequence], result: StepOutput) -> list[RequestOutput]:
        """Append each row's token to its sequence (`seqs` in row order) and check its stops.
        A row whose sequence finished meanwhile (a stop read after this step was launched, or
        an abort) is dropped."""
        deltas: dict[str, list[SampleDelta]] = {}
        finished: list[Sequence] = []
        for row, seq in enumerate(seqs):
            if seq.is_finished:
                continue
            token_id = result.token_ids[row]
            delta = self.outputs.append(
                seq, token_id, result.logprobs[row], result.top_logprobs[row]
            )
            deltas.setdefault(seq.request_id, []).append(delta)
            if delta.finish_reason is not None:
                finished.append(seq)
        groups = {rid: self.scheduler.find(rid) for rid in deltas}
        self.scheduler.update(finished)
        self.outputs.forget(finished)
        return [self._output(groups[rid], request_deltas) for rid, request_deltas in deltas.items()]

    def _output(self, group: SequenceGroup, deltas: list[SampleDelta]) -> RequestOutput:
        now = time.perf_counter()
        if group.first_token_at is None and any(delta.token_ids for delta in deltas):
            group.first_token_at = now
        return RequestOutput(
            request_id=group.request_id,
            samples=deltas,
            num_prompt_tokens=group.num_prompt_tokens,
            policy_version=self.policy_version,
            finished=group.is_finished,
            num_prefill_tokens=group.num_prefill_tokens,
            num_cached_tokens=group.num_cached_tokens,
            timings=_timings(group, now) if group.is_finished else None,
        )


def _timings(group: SequenceGroup, now: float) -> RequestTimings:
    """A finished group's `RequestTimings` (one cut off before admission or before its first
    token spent the rest of its time where it was)."""
    scheduled = group.scheduled_at if group.scheduled_at is not None else now
    first = group.first_token_at if group.first_token_at is not None else now
    return RequestTimings(scheduled - group.added_at, first - scheduled, now - first)
