"""Rank 0's GRPO controller: everything a step needs before its ranks train and after.

`Controller.batch(step)` is one step's rollout side, from the sample stream to each rank's
mini-batches: the evaluation when due, the window of rollouts in flight (`rollout.max_staleness`
steps ahead of the one trained on), the oldest of them gathered (retried while lost rollout
workers come back), rewards, advantages, the step's metrics and the ranks' shares.
`Controller.record` writes what the step measured; `Controller.close` runs the last evaluation.
The Ray calls to the rollout workers are `areno.train.rollouts`'.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from areno.data import Sample, SampleStream, load_samples
from areno.data.guard import PrivateDataLeakError, check_private
from areno.data.sample import SampleError
from areno.engine.sampling import SamplingParams
from areno.imports import import_callable
from areno.rewards import combine
from areno.rollout.trajectory import Trajectory
from areno.train import rollouts
from areno.train.batching import MiniBatch, plan_step
from areno.train.config import GRPOConfig
from areno.train.grpo import group_advantages
from areno.train.metrics import MetricsWriter, PhaseTimer
from areno.train.weight_sync import WeightSync

logger = logging.getLogger("areno.train")

# The seed of the evaluation's sampling (the same every evaluation of a run).
EVAL_SEED = 12345


def rollouts_overlap_training(config: GRPOConfig) -> bool:
    """Whether rollouts of later steps run while a step trains (`rollout.max_staleness` > 0):
    then the two compete for a CPU machine's cores."""
    return config.rollout.max_staleness > 0


@dataclass
class StepBatch:
    """What rank 0 hands the ranks for one step: each rank's mini-batches, whether the step
    learns (a step whose advantages are all zero, without a KL term, has no gradient), its
    rollout metrics, and the sample stream's position a run resumed after it starts from."""

    shares: list[list[MiniBatch]]
    learn: bool
    metrics: dict[str, Any]
    data_position: int


@dataclass
class _InFlight:
    """A step's rollout, dispatched and not yet gathered."""

    step: int
    samples: list[Sample]
    seed: int
    dispatched: rollouts.Dispatched
    data_position: int  # the sample stream's position once this step's samples were drawn


class Controller:
    """Rank 0's data stream, rollouts, rewards, evaluation and metrics (the module's
    docstring)."""

    def __init__(
        self,
        config: GRPOConfig,
        sync: WeightSync,
        start_step: int,
        data_position: int,
        *,
        world_size: int,
        batched_media: bool,
        packs: bool,
    ):
        data = config.data
        self.config, self.sync, self.workers = config, sync, sync.workers
        self.world_size, self.batched_media, self.packs = world_size, batched_media, packs
        train = list(load_samples(data.loader, **{"split": "train", **data.loader_kwargs}))
        eval_spec = data.eval_loader or data.loader
        eval_kwargs = data.eval_loader_kwargs or {"split": "validation", **data.loader_kwargs}
        self.eval_samples = list(load_samples(eval_spec, **eval_kwargs))[: config.run.eval_size]
        self.stream = SampleStream(
            train, seed=config.run.seed, shuffle=data.shuffle, start_position=data_position
        )
        self.reward_fn = import_callable(config.reward, "reward")
        r = config.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        self.writer = MetricsWriter(
            config.run.run_dir,
            config.run.loggers,
            project=config.run.project,
            config=config.to_dict(),
            start_step=start_step,
        )
        # The rollouts in flight, oldest first, and the next step whose rollout is to start.
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._next_launch = start_step
        # each rollout worker's engine seconds when its last gathered group ended
        self._engine_seen: dict[int, dict[str, float]] = {}
        self._progress = None
        if config.run.progress:
            from tqdm import tqdm

            self._progress = tqdm(
                total=config.run.max_steps, initial=start_step, desc="grpo", unit="step"
            )

    def batch(self, step: int) -> StepBatch:
        """Step `step`'s batch. With `rollout.max_staleness` k the rollouts of steps up to
        step + k are running when it returns: step s's rollout starts once policy s - k is on
        the workers, so no token a step trains on comes from a policy older than k steps
        (counted per token: with rollout.partial_rollouts an episode's later tokens may be a
        newer policy's)."""
        cfg = self.config
        timer = PhaseTimer()
        if cfg.run.eval_every and step % cfg.run.eval_every == 0:
            with timer("eval"):
                self.writer.write(step, self.evaluate())
        last = min(step + cfg.rollout.max_staleness, cfg.run.max_steps - 1)
        # With nothing in flight (a run's first step, or its first after a resume) the trainer
        # can only wait for this step's rollout: it runs alone, and the later steps' start once
        # it is gathered, beside this step's training, instead of competing with it.
        cold = not self._in_flight
        with timer("launch"):
            self._launch_through(step if cold else last)
        this = self._in_flight.popleft()
        trajectories, adv, metrics = self._finish(this, timer)
        metrics["rollouts_ahead"] = float(len(self._in_flight))  # running while this one ended
        with timer("launch"):
            self._launch_through(last)
        with timer("advantages"):
            metrics.update(staleness_metrics(trajectories, step, cfg.rollout.max_staleness))
        with timer("packing"):
            shares = plan_step(
                list(zip(trajectories, adv.tolist(), strict=True)),
                self.world_size,
                cfg.grpo.mini_batches,
                cfg.trainer.micro_batch_tokens,
                batched_media=self.batched_media,
                version=step,
                packs=self.packs,
            )
        learn = cfg.grpo.loss.kl_coef > 0 or bool(adv.ne(0).any())
        metrics["update_skipped"] = float(not learn)
        metrics.update(timer.metrics())
        return StepBatch(shares, learn, metrics, this.data_position)

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Write step `step`'s metrics (the rollout's and the training's)."""
        self.writer.write(step, metrics)
        if self._progress is not None:
            self._progress.update(1)
            self._progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}")

    def close(self, step: int) -> None:
        """The run's last evaluation (at `step`, when evaluation is on), then close the
        writers."""
        if self.config.run.eval_every:
            self.writer.write(step, self.evaluate())
        if self._progress is not None:
            self._progress.close()
        self.writer.close()

    def evaluate(self) -> dict[str, float]:
        if not self.eval_samples:
            return {}
        start = time.perf_counter()
        sampling = dataclasses.replace(self.sampling, temperature=self.config.run.eval_temperature)
        per_prompt = self.config.run.eval_samples_per_prompt
        gathered, _ = self._gather("evaluation", self.eval_samples, per_prompt, sampling, EVAL_SEED)
        self._engine_phases(gathered)  # the evaluation's engine seconds are no step's
        groups, samples = _kept("evaluation", gathered, self.eval_samples)
        score(self.reward_fn, groups, samples, self.config.reward_kwargs)
        metrics = rollout_metrics([t for g in groups for t in g], prefix="eval/")
        metrics["eval_s"] = time.perf_counter() - start
        metrics["eval/skipped_samples"] = float(len(gathered.skipped))
        return metrics

    def _launch_through(self, last: int) -> None:
        """Start the rollouts of the steps up to `last` not started yet."""
        while self._next_launch <= last:
            self._in_flight.append(self._launch(self._next_launch))
            self._next_launch += 1

    def _launch(self, step: int) -> _InFlight:
        """Draw step `step`'s samples and start its rollout on the workers."""
        cfg = self.config
        samples = self.stream.next_batch(cfg.grpo.prompts_per_step)
        seed = cfg.run.seed * 1_000_003 + step * 10_007
        dispatched = rollouts.dispatch(
            self.workers, samples, cfg.grpo.group_size, self.sampling, seed=seed
        )
        return _InFlight(step, samples, seed, dispatched, self.stream.position)

    def _finish(
        self, this: _InFlight, timer: PhaseTimer
    ) -> tuple[list[Trajectory], torch.Tensor, dict[str, Any]]:
        """Gather a launched rollout and score it (with `grpo.dynamic_sampling`, its groups
        without signal replaced): the trajectories to train, their advantages, the metrics
        (`timer`: the phases' seconds on rank 0, the workers' as `time/rollout/*`)."""
        cfg = self.config
        what = f"step {this.step + 1}'s rollout"
        wait_start = time.perf_counter()
        with timer("rollout_wait"):
            gathered, retries = self._gather(
                what, this.samples, cfg.grpo.group_size, self.sampling, this.seed, this.dispatched
            )
        groups, samples = _kept(what, gathered, this.samples)
        reward_s = score(self.reward_fn, groups, samples, cfg.reward_kwargs)
        timer.add("reward", reward_s)
        drawn = Drawn(
            list(groups), gathered.seconds, retries, len(gathered.skipped), this.samples[:]
        )
        kept = groups
        if cfg.grpo.dynamic_sampling:
            with timer("refill"):
                kept = self._fill(this, groups, samples, drawn)
        # NOTE: a step that kept no group trains the groups it drew first (advantages all 0:
        # no update without a KL term), so that its metrics and versions move as any step's
        trained = kept or groups
        idle_s = time.perf_counter() - wait_start
        with timer("advantages"):
            adv = advantages(trained, cfg.grpo.normalize_std)
            trajectories = [t for group in trained for t in group]
            everything = [t for group in drawn.groups for t in group]
            # NOTE: the reward and length metrics are the sampling policy's, over every group
            # drawn: the trained ones alone (dynamic sampling) leave out the all-equal groups.
            metrics: dict[str, Any] = rollout_metrics(everything)
            metrics.update(prefill_metrics(everything))
        generated = sum(t.num_generated_tokens for t in everything)
        metrics.update(
            rollout_s=drawn.seconds,
            idle_s=idle_s,  # the trainer waiting for the rollout
            reward_s=reward_s + drawn.reward_s,
            rollout_tokens_per_s=generated / max(drawn.seconds, 1e-9),
            policy_version=min(t.policy_version for t in trajectories),
            rollout_retries=drawn.retries,
            skipped_samples=float(drawn.skipped),
            sample_ids=[sample.id for sample in drawn.samples],  # the data the step consumed
        )
        metrics.update({f"time/rollout/{k}": v for k, v in gathered.phases.items()})
        metrics.update(self._engine_phases(gathered))
        if cfg.grpo.dynamic_sampling:
            metrics.update(drawn.metrics(len(kept), cfg.grpo.prompts_per_step))
        return trajectories, adv, metrics

    def _engine_phases(self, gathered: rollouts.Gathered) -> dict[str, float]:
        """The rollout workers' engine seconds (`time/rollout/prefill_s`, `decode_s`,
        `media_encode_s`) between the ends of the last groups of this batch and of the one
        gathered before: the step's episodes', and any later step's run meanwhile."""
        totals: dict[str, float] = {}
        for worker, now in gathered.engine.items():
            seen = self._engine_seen.get(worker, {})
            for key, value in now.items():
                before = seen.get(key, 0.0)
                # a restarted worker counts from 0 again
                totals[key] = totals.get(key, 0.0) + (value - before if value >= before else value)
            self._engine_seen[worker] = dict(now)
        return {f"time/rollout/{k}": v for k, v in totals.items()}

    def _fill(
        self, this: _InFlight, groups: list[list[Trajectory]], samples: list[Sample], drawn: Drawn
    ) -> list[list[Trajectory]]:
        """DAPO's dynamic sampling: the step's groups whose rewards differ, a group whose
        rewards are all equal replaced by a group of a newly drawn prompt until there are
        `prompts_per_step` or `grpo.max_extra_prompts` were drawn. The replacements run beside
        the later steps' rollouts in flight, on the current policy."""
        cfg = self.config
        kept = [group for group in groups if has_signal(group)]
        drawn.dropped = [s.id for g, s in zip(groups, samples, strict=True) if not has_signal(g)]
        bound = cfg.grpo.extra_prompts_bound
        extra = 0
        while len(kept) < cfg.grpo.prompts_per_step and extra < bound:
            new = self.stream.next_batch(min(cfg.grpo.prompts_per_step - len(kept), bound - extra))
            extra += len(new)
            drawn.rounds += 1
            what = f"step {this.step + 1}'s replacement rollout {drawn.rounds}"
            seed = this.seed + 7_919 * drawn.rounds
            gathered, retries = self._gather(what, new, cfg.grpo.group_size, self.sampling, seed)
            drawn.add(gathered, retries, new)
            for index, why in gathered.skipped.items():
                logger.warning("areno train: sample %r skipped in %s: %s", new[index].id, what, why)
            ran = [i for i in range(len(new)) if i not in gathered.skipped]
            new_groups = [gathered.groups[i] for i in ran]
            drawn.reward_s += score(
                self.reward_fn, new_groups, [new[i] for i in ran], cfg.reward_kwargs
            )
            for i, group in zip(ran, new_groups, strict=True):
                if has_signal(group):
                    kept.append(group)
                else:
                    drawn.dropped.append(new[i].id)
        if not self._in_flight:
            # no later step has drawn yet: a run resumed after this step draws on from here
            # (with rollouts in flight it redraws theirs, and these replacements, again)
            this.data_position = self.stream.position
        if len(kept) < cfg.grpo.prompts_per_step:
            logger.warning(
                "areno train: step %d kept %d of %d groups (grpo.dynamic_sampling: %d drawn, "
                "%d with all rewards equal; grpo.max_extra_prompts = %d reached); it trains "
                "%s",
                this.step + 1,
                len(kept),
                cfg.grpo.prompts_per_step,
                len(drawn.samples),
                len(drawn.dropped),
                bound,
                "those" if kept else "its first draw's groups, whose advantages are all 0",
            )
        return kept

    def _gather(
        self,
        what: str,
        samples: list[Sample],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        dispatched: rollouts.Dispatched | None = None,
    ) -> tuple[rollouts.Gathered, int]:
        """The groups of `samples` (`dispatched` already, or dispatched now), run again while
        lost rollout workers come back (Ray restarts them, rollout.max_restarts): same samples,
        same seeds, on the current policy. Returns what the attempt that succeeded gathered and
        the number of retries."""
        max_retries = self.config.rollout.max_restarts
        retries = 0
        while True:
            try:
                if dispatched is None or retries:
                    dispatched = rollouts.dispatch(
                        self.workers, samples, group_size, sampling, seed=seed
                    )
                return rollouts.gather(dispatched), retries
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


@dataclass
class Drawn:
    """Everything one step's rollout drew: its groups (the first draw's, then every
    replacement round's: `Controller._fill`), samples, seconds, retries and skipped samples,
    and the ids of the samples whose groups dynamic sampling dropped."""

    groups: list[list[Trajectory]]
    seconds: float
    retries: int
    skipped: int
    samples: list[Sample] = dataclasses.field(default_factory=list)
    dropped: list[str | None] = dataclasses.field(default_factory=list)
    rounds: int = 0
    reward_s: float = 0.0

    def add(self, gathered: rollouts.Gathered, retries: int, samples: list[Sample]) -> None:
        self.groups += [g for i, g in enumerate(gathered.groups) if i not in gathered.skipped]
        self.seconds += gathered.seconds
        self.retries += retries
        self.skipped += len(gathered.skipped)
        self.samples += samples

    def metrics(self, num_kept: int, prompts_per_step: int) -> dict[str, Any]:
        return {
            "groups_drawn": float(len(self.samples)),
            "groups_dropped": float(len(self.dropped)),
            "groups_kept": float(num_kept),
            "replacement_rounds": float(self.rounds),
            # 1: the step reached grpo.max_extra_prompts and trains fewer groups
            "dynamic_sampling_unfilled": float(num_kept < prompts_per_step),
            "dropped_sample_ids": list(self.dropped),
        }


def has_signal(group: Sequence[Trajectory]) -> bool:
    """Whether a group's rewards differ (dynamic sampling keeps it): equal rewards give every
    episode advantage 0."""
    return len({t.reward for t in group}) > 1


def _kept(what: str, gathered: rollouts.Gathered, samples: list[Sample]) -> tuple[list, list]:
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


def score(
    reward_fn: Callable[..., Any],
    groups: Sequence[Sequence[Trajectory]],
    samples: Sequence[Sample],
    reward_kwargs: dict | None = None,
) -> float:
    """Set each trajectory's reward (and components) from its sample's private metadata; the
    seconds it took. Private metadata never leaves rank 0: the workers got `Sample.public()`.
    An agent program's episode is scored once, on its first part, after the leak guard has read
    what the program sent (`check_program_calls`); its other parts carry that reward."""
    start = time.perf_counter()
    for group, sample in zip(groups, samples, strict=True):
        firsts = {}
        for traj in group:
            if traj.part:
                continue
            check_program_calls(traj, sample)
            value = reward_fn(traj, sample.private, **(reward_kwargs or {}))
            if isinstance(value, dict):
                traj.reward_components = {k: float(v) for k, v in value.items()}
                traj.reward = float(combine(traj.reward_components))
            else:
                traj.reward = float(value)
            firsts[traj.episode_index] = traj
        for traj in group:
            if traj.part:
                first = firsts[traj.episode_index]
                traj.reward, traj.reward_components = first.reward, dict(first.reward_components)
    return time.perf_counter() - start


def check_program_calls(traj: Trajectory, sample: Sample) -> None:
    """The leak guard on what an agent program sent in each call (its messages but the
    assistant's, which the policy wrote, and its tools): a private value there means the program
    reads what the reward holds. Raises PrivateDataLeakError naming the call."""
    for index, call in enumerate(traj.calls):
        sent = [m for m in call.messages if m.get("role") != "assistant"]
        if not sent:
            continue
        try:
            check_private(Sample(sent, call.tools, sample.private, sample.id))
        except PrivateDataLeakError as error:
            raise PrivateDataLeakError(
                f"agent program, episode {traj.episode_index}, call {index}: {error.message}",
                param=error.param,
            ) from None


def advantages(groups: Sequence[Sequence[Trajectory]], normalize_std: bool) -> torch.Tensor:
    """Group-normalised advantages, one per episode: the later parts of an agent program's
    episode (`Trajectory.part`, after its first) count once in their group's statistics and
    share their first part's advantage."""
    rewards: list[float] = []
    group_ids: list[int] = []
    owners: list[int] = []  # the episode (its index in `rewards`) of each trajectory
    for g, group in enumerate(groups):
        firsts: dict[int, int] = {}
        for traj in group:
            if traj.part:
                owners.append(firsts[traj.episode_index])
                continue
            firsts[traj.episode_index] = len(rewards)
            owners.append(len(rewards))
            rewards.append(traj.reward)
            group_ids.append(g)
    values = torch.tensor(rewards, dtype=torch.float32)
    per_episode = group_advantages(values, group_ids, normalize_std=normalize_std)
    return per_episode[torch.tensor(owners, dtype=torch.long)]


def prefill_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Prompt tokens the step's episodes asked the engines to prefill, those they computed (the
    rest the prefix cache held) and the hit rate, as each episode's requests reported them."""
    requested = sum(t.num_prefill_tokens for t in trajectories)
    cached = sum(t.num_cached_tokens for t in trajectories)
    return {
        "prefill_tokens_requested": float(requested),
        "prefill_tokens_computed": float(requested - cached),
        "prefix_hit_rate": cached / requested if requested else 0.0,
    }


def rollout_metrics(trajectories: Sequence[Trajectory], prefix: str = "") -> dict[str, float]:
    """Reward, accuracy, lengths and tool use over a list of trajectories (reward and accuracy
    per episode: an agent program's episode split into parts counts once), and an agent
    program's episodes (`program_metrics`)."""
    n = max(len(trajectories), 1)
    episodes = [t for t in trajectories if not t.part]
    num_episodes = max(len(episodes), 1)
    rewards = torch.tensor([t.reward or 0.0 for t in episodes], dtype=torch.float64)
    metrics = {
        "episodes": float(len(episodes)),
        "reward_mean": rewards.mean().item() if episodes else 0.0,
        "reward_std": rewards.std(unbiased=False).item() if episodes else 0.0,
        "accuracy": sum(_is_correct(t) for t in episodes) / num_episodes,
        "response_len_mean": sum(t.num_generated_tokens for t in trajectories) / n,
        "episode_len_mean": sum(t.num_tokens for t in trajectories) / n,
        "turns_mean": sum(t.num_turns for t in trajectories) / n,
        "tool_calls_per_episode": sum(len(t.tool_calls) for t in trajectories) / num_episodes,
        "malformed_tool_calls": float(sum(t.num_malformed_tool_calls for t in trajectories)),
        "aborted_episodes": float(sum(t.finish == "aborted" for t in trajectories)),
    }
    names = sorted({k for t in episodes for k in t.reward_components})
    for name in names:
        metrics[f"reward/{name}"] = (
            sum(t.reward_components.get(name, 0.0) for t in episodes) / num_episodes
        )
    metrics.update(program_metrics(trajectories))
    return {f"{prefix}{k}": v for k, v in metrics.items()}


def program_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """How an agent program's episodes were trained: as one multi-turn trajectory (every call
    extended the one before) or split into transitions (a call rewrote the history), how many
    transitions, calls per episode, and the episodes that ended in an error or a timeout.
    Empty for an areno Agent's episodes."""
    episodes = [t for t in trajectories if t.calls and not t.part]
    if not episodes:
        return {}
    return {
        "program_multi_turn_episodes": float(sum(t.num_parts == 1 for t in episodes)),
        "program_split_episodes": float(sum(t.num_parts > 1 for t in episodes)),
        "program_transitions": float(sum(t.num_parts for t in episodes if t.num_parts > 1)),
        "program_calls_per_episode": sum(len(t.calls) for t in episodes) / len(episodes),
        "program_failed_episodes": float(sum(t.finish in ("error", "timeout") for t in episodes)),
    }


def _is_correct(traj: Trajectory) -> bool:
    if "accuracy" in traj.reward_components:
        return traj.reward_components["accuracy"] >= 0.5
    return (traj.reward or 0.0) >= 1.0 - 1e-6


def staleness_metrics(
    trajectories: list[Trajectory], step: int, max_staleness: int
) -> dict[str, float]:
    """How many versions behind policy `step` (the one being trained) each sampled token's
    policy was: a histogram of token counts ("staleness/k"), the largest, and the episodes
    whose tokens more than one policy sampled ("partial_episodes": new weights landed while
    they ran, rollout.partial_rollouts). Raises if a token is older than `max_staleness`
    allows (the window's own invariant, counted per token)."""
    counts: collections.Counter[int] = collections.Counter()
    for traj in trajectories:
        counts.update(step - version for version in traj.token_versions)
    partial = sum(len(set(traj.token_versions)) > 1 for traj in trajectories)
    oldest = max(counts, default=0)
    if oldest > max_staleness:
        raise RuntimeError(
            f"step {step + 1} trains on tokens {oldest} policy versions old; "
            f"rollout.max_staleness is {max_staleness}"
        )
    metrics = {f"staleness/{k}": float(n) for k, n in sorted(counts.items())}
    metrics["staleness_max"] = float(oldest)
    metrics["partial_episodes"] = float(partial)
    return metrics
