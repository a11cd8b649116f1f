"""Rank 0's side of the GRPO loop: the sample stream, the rollouts it launches and finishes
(several in flight with `rollout.max_staleness`), rewards, evaluation and metrics, and the
staleness of what a step trains on."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from areno.data import SampleStream, load_samples
from areno.data.sample import SampleError
from areno.engine.sampling import SamplingParams
from areno.imports import import_callable
from areno.rollout.trajectory import Trajectory
from areno.train import rollouts
from areno.train.config import GRPOConfig
from areno.train.metrics import MetricsWriter
from areno.train.weight_sync import WeightSync

logger = logging.getLogger("areno.train")


@dataclass
class PendingRollout:
    """A step's rollout, launched and not yet finished (`Coordinator.launch`)."""

    step: int
    samples: list
    seed: int
    dispatched: rollouts.Dispatched
    data_position: int  # the sample stream's position once this step's samples were drawn


class Coordinator:
    """Rank 0's data stream, rollouts, rewards, evaluation and metrics."""

    def __init__(self, config: GRPOConfig, sync: WeightSync, state: Any):
        data = config.data
        self.config, self.sync, self.workers = config, sync, sync.workers
        train = list(load_samples(data.loader, **{"split": "train", **data.loader_kwargs}))
        eval_spec = data.eval_loader or data.loader
        eval_kwargs = data.eval_loader_kwargs or {"split": "validation", **data.loader_kwargs}
        self.eval_samples = list(load_samples(eval_spec, **eval_kwargs))[: config.run.eval_size]
        self.stream = SampleStream(
            train, seed=config.run.seed, shuffle=data.shuffle, start_position=state.data_position
        )
        self.reward_fn = import_callable(config.reward, "reward")
        r = config.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        self.writer = MetricsWriter(config.run.run_dir)
        # the workers' prompt token counters when the last rollout was gathered
        self._counts = rollouts.prompt_token_counts(self.workers)

    def launch(self, step: int) -> PendingRollout:
        """Start step `step`'s rollout on the workers (its samples drawn now); `finish` it."""
        cfg = self.config
        samples = self.stream.next_batch(cfg.grpo.prompts_per_step)
        seed = cfg.run.seed * 1_000_003 + step * 10_007
        dispatched = rollouts.dispatch(
            self.workers, samples, cfg.grpo.group_size, self.sampling, seed=seed
        )
        return PendingRollout(step, samples, seed, dispatched, self.stream.position)

    def finish(
        self, pending: PendingRollout
    ) -> tuple[list[Trajectory], torch.Tensor, dict[str, float]]:
        """Wait for a launched rollout (retried while lost workers come back), score it."""
        cfg = self.config
        what = f"step {pending.step + 1}'s rollout"
        wait_start = time.perf_counter()
        gathered, retries = self._collect(
            what, pending.samples, cfg.grpo.group_size, self.sampling, pending.seed, pending
        )
        idle_s = time.perf_counter() - wait_start
        counts = rollouts.prompt_token_counts(self.workers)
        prefill = rollouts.prefill_metrics(self._counts, counts)
        self._counts = counts
        groups, samples = _kept(what, gathered, pending.samples)
        reward_s = rollouts.score(self.reward_fn, groups, samples, cfg.reward_kwargs)
        adv = rollouts.advantages(groups, cfg.grpo.normalize_std)
        trajectories = [t for group in groups for t in group]
        metrics = rollouts.rollout_metrics(trajectories)
        generated = sum(t.num_generated_tokens for t in trajectories)
        metrics.update(prefill)
        metrics.update(
            rollout_s=gathered.seconds,
            idle_s=idle_s,  # the trainer waiting for the rollout
            reward_s=reward_s,
            rollout_tokens_per_s=generated / max(gathered.seconds, 1e-9),
            policy_version=min(t.policy_version for t in trajectories),
            rollout_retries=retries,
            skipped_samples=float(len(gathered.skipped)),
            sample_ids=[sample.id for sample in pending.samples],  # the data the step consumed
        )
        return trajectories, adv, metrics

    def _collect(
        self,
        what: str,
        samples: list,
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        pending: PendingRollout | None = None,
    ) -> tuple[rollouts.Gathered, int]:
        """rollouts.collect (or the gathering of `pending`, already dispatched), retried while
        lost rollout workers come back (Ray restarts them, rollout.max_restarts): same samples,
        same seeds, on the current policy. Returns what the attempt that succeeded gathered and
        the number of retries."""
        max_retries = self.config.rollout.max_restarts
        retries = 0
        while True:
            try:
                if pending is not None and not retries:
                    return rollouts.gather(pending.dispatched), retries
                gathered = rollouts.collect(self.workers, samples, group_size, sampling, seed=seed)
                return gathered, retries
            except rollouts.RolloutWorkerLostError as error:
                if retries == max_retries:
                    raise
                retries += 1
                logger.warning(
                    "areno train: %s is retried (retry %d of at most %d) because %s; same "
                    "samples and seeds, and the restarted workers get policy version %s first",
                    what,
                    retries,
                    max_retries,
                    error,
                    self.sync.version,
                )
                self.sync.restore()

    def evaluate(self) -> dict[str, float]:
        if not self.eval_samples:
            return {}
        start = time.perf_counter()
        sampling = dataclasses.replace(self.sampling, temperature=self.config.run.eval_temperature)
        per_prompt = self.config.run.eval_samples_per_prompt
        before = rollouts.prompt_token_counts(self.workers)
        gathered, _ = self._collect("evaluation", self.eval_samples, per_prompt, sampling, 12345)
        groups, samples = _kept("evaluation", gathered, self.eval_samples)
        # NOTE: the step's prefill metrics leave the evaluation's prompts out (approximately,
        # when rollouts run meanwhile: rollout.max_staleness > 0).
        after = rollouts.prompt_token_counts(self.workers)
        self._counts = [
            (a0 + a2 - a1, c0 + c2 - c1)
            for (a0, c0), (a1, c1), (a2, c2) in zip(self._counts, before, after, strict=True)
        ]
        rollouts.score(self.reward_fn, groups, samples, self.config.reward_kwargs)
        metrics = rollouts.rollout_metrics([t for g in groups for t in g], prefix="eval/")
        metrics["eval_s"] = time.perf_counter() - start
        metrics["eval/skipped_samples"] = float(len(gathered.skipped))
        return metrics


def _kept(what: str, gathered: rollouts.Gathered, samples: list) -> tuple[list, list]:
    """The groups that ran and their samples; each skipped sample is logged with the error
    that skipped it (a sample's own media or length, `RolloutWorker.run_group`). Raises
    SampleError when every sample was skipped: then the data or the limits are wrong."""
    for index, why in gathered.skipped.items():
        logger.warning("areno train: sample %r skipped in %s: %s", samples[index].id, what, why)
    kept = [i for i in range(len(samples)) if i not in gathered.skipped]
    if not kept:
        first = min(gathered.skipped)
        raise SampleError(
            f"every sample of {what} was skipped ({len(samples)}); sample "
            f"{samples[first].id!r}: {gathered.skipped[first]}"
        )
    return [gathered.groups[i] for i in kept], [samples[i] for i in kept]


def staleness_metrics(
    trajectories: list[Trajectory], step: int, config: GRPOConfig
) -> dict[str, float]:
    """How many versions behind policy `step` (the one being trained) each sampled token's
    policy was: a histogram of token counts ("staleness/k") and the largest. Raises if a token
    is older than `rollout.max_staleness` allows (the loop's own invariant)."""
    counts: collections.Counter[int] = collections.Counter()
    for traj in trajectories:
        counts.update(step - version for version in traj.token_versions)
    oldest = max(counts, default=0)
    if oldest > config.rollout.max_staleness:
        raise RuntimeError(
            f"step {step + 1} trains on tokens {oldest} policy versions old; "
            f"rollout.max_staleness is {config.rollout.max_staleness}"
        )
    metrics = {f"staleness/{k}": float(n) for k, n in sorted(counts.items())}
    metrics["staleness_max"] = float(oldest)
    return metrics
