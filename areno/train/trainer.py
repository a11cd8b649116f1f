"""The GRPO loop each Ray Train worker runs: rollout (rank 0) -> reward (rank 0) -> train (all
ranks, DeepSpeed) -> weight sync -> checkpoint. One optimizer step per training step."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from areno.data import SampleStream, load_samples
from areno.engine.encoder_cache import EncoderCache
from areno.engine.sampling import SamplingParams
from areno.rollout.trajectory import Trajectory
from areno.train import checkpoint, rollouts
from areno.train.config import GRPOConfig
from areno.train.grpo import logprob_mismatch, policy_loss
from areno.train.metrics import MetricsWriter
from areno.train.policy import count_parameters, load_policy, sequence_logprobs, set_train_mode
from areno.train.weight_sync import WeightSync, gathered, trainable_named

logger = logging.getLogger("areno.train")


def _dtype(config: GRPOConfig, device: str) -> torch.dtype:
    if config.trainer.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, config.trainer.dtype)


def deepspeed_config(config: GRPOConfig, world_size: int, dtype: torch.dtype) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": config.episodes_per_step // world_size,
        "gradient_clipping": config.optim.grad_clip,
        "zero_optimization": {"stage": config.trainer.zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


# Media features a trainer rank keeps within one step (frozen towers: `Learner.features`).
TRAINER_FEATURE_BYTES = 1 << 30


def _keep_cpu_ranks_on_gloo() -> None:
    """DeepSpeed's CPU accelerator replaces gloo's allreduce with a shared-memory C++ op that it
    JIT-compiles on first use: 70-150 s on a 2-core machine, again whenever the build command
    changes (measured here), for the few small allreduces of a GRPO step. gloo does them."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class Learner:
    """One rank's policy under DeepSpeed."""

    def __init__(self, config: GRPOConfig, model_path: str, rank: int, world_size: int):
        import deepspeed

        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = _device(config)
        if self.device == "cpu":
            _keep_cpu_ranks_on_gloo()
        dtype = _dtype(config, self.device)
        model, self.adapter, self.frozen = load_policy(
            model_path,
            dtype=dtype,
            freeze_towers=config.trainer.freeze_media_towers,
            freeze_projectors=config.trainer.freeze_projectors,
        )
        self.num_trainable, self.num_total = count_parameters(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optim = config.optim
        optimizer = torch.optim.AdamW(
            params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
        )
        self.engine, *_ = deepspeed.initialize(
            model=model.to(self.device),
            optimizer=optimizer,
            model_parameters=params,
            config=deepspeed_config(config, world_size, dtype),
        )
        self.ref = None
        if config.grpo.loss.kl_coef > 0:
            self.ref = self.adapter.load_model(model_path, dtype=dtype).to(self.device).eval()
            self.ref.requires_grad_(False)
        # Frozen towers and projectors give every pass the same media features: the step's
        # trajectories (a group's share its prompt's media) and the reference's pass reuse them.
        # NOTE: not under ZeRO-3, whose every module forward gathers its partitioned
        # parameters with the other ranks: a rank that skipped a tower's forward would hang.
        self.features = None
        adapter = self.adapter
        if set(adapter.media_towers + adapter.projectors) <= set(self.frozen) and (
            config.trainer.zero_stage < 3
        ):
            self.features = EncoderCache(self.module, TRAINER_FEATURE_BYTES)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def train_step(
        self, share: list[tuple[Trajectory, float]], totals: dict[str, int]
    ) -> dict[str, float]:
        """Accumulate the loss of this rank's trajectories and take one optimizer step."""
        set_train_mode(self.module, self.frozen)
        sums: dict[str, float] = {"tokens": 0.0, "abs_diff": 0.0, "max_abs": 0.0, "clip": 0.0}
        sums.update({"kl": 0.0, "loss": 0.0, "ratio_max": 0.0})
        if not totals["learn"]:
            # NOTE: every advantage is 0 and there is no KL term, so the loss has no gradient;
            # an optimizer step would still move the weights along Adam's momentum.
            return sums
        scale_all = (self.config.episodes_per_step // self.world_size) * self.world_size
        # The rollouts' sampling temperature: their logprobs are tempered (see
        # areno/rollout/episode.py), and so are these.
        temperature = self.config.rollout.temperature
        try:
            for traj, advantage in share:
                self._learn(traj, advantage, totals, sums, scale_all, temperature)
        finally:
            if self.features is not None:
                self.features.clear()
        return sums

    def _shared_features(self, inputs) -> contextlib.ExitStack:
        """Around one trajectory's passes: the policy's and the reference's media features
        from `self.features`."""
        stack = contextlib.ExitStack()
        if self.features is not None:
            stack.enter_context(self.features.around(inputs.mm_spans))
            if self.ref is not None:
                stack.enter_context(self.features.around(inputs.mm_spans, self.ref))
        return stack

    def _learn(self, traj, advantage, totals, sums, scale_all, temperature) -> None:
        """One trajectory's loss, backward and (accumulated) step, added to `sums`."""
        cfg = self.config.grpo
        start = traj.num_prompt_tokens
        with self._shared_features(traj.inputs):
            logprobs = sequence_logprobs(self.module, traj.inputs, self.device, start, temperature)
            logprobs = logprobs[None]
            mask = torch.tensor([traj.loss_mask[start:]], dtype=torch.float32, device=self.device)
            rollout_lp = torch.tensor([traj.rollout_logprobs[start:]], device=self.device)
            old = rollout_lp if cfg.behaviour_logprobs == "rollout" else logprobs.detach()
            ref_lp = None
            if self.ref is not None:
                with torch.no_grad():
                    ref_lp = sequence_logprobs(
                        self.ref, traj.inputs, self.device, start, temperature
                    )[None]
        adv = torch.tensor([advantage], dtype=torch.float32, device=self.device)
        loss, info = policy_loss(
            logprobs.float(),
            old.float(),
            adv,
            mask,
            config=cfg.loss,
            ref_logprobs=ref_lp,
            rollout_logprobs=rollout_lp,
        )
        n = float(mask.sum().item())
        if cfg.loss.loss_agg == "token_mean":
            weight = n / max(totals["tokens"], 1)
        else:
            weight = 1.0 / totals["episodes"]
        # DeepSpeed divides by the accumulation steps and averages over ranks; undo both so
        # the summed gradient is that of the batch-level aggregate.
        self.engine.backward(loss * weight * scale_all)
        self.engine.step()
        diff = logprob_mismatch(logprobs.detach(), rollout_lp, mask)
        sums["tokens"] += n
        sums["abs_diff"] += diff["logprob_mismatch_mean_abs"] * n
        sums["max_abs"] = max(sums["max_abs"], diff["logprob_mismatch_max_abs"])
        sums["clip"] += info["clip_fraction"] * n
        sums["kl"] += info.get("kl", 0.0) * n
        sums["ratio_max"] = max(sums["ratio_max"], info["ratio_max"])
        sums["loss"] += float(loss.item()) * weight


def _device(config: GRPOConfig) -> str:
    if config.trainer.use_gpu and torch.cuda.is_available():
        import ray.train.torch

        return str(ray.train.torch.get_device())
    return "cpu"


def _reduce(sums: dict[str, float]) -> dict[str, float]:
    """Combine every rank's sums into the step's training metrics (on every rank)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    tokens = sum(s["tokens"] for s in gathered) or 1.0
    return {
        "loss": sum(s["loss"] for s in gathered),
        "logprob_mismatch_mean_abs": sum(s["abs_diff"] for s in gathered) / tokens,
        "logprob_mismatch_max_abs": max(s["max_abs"] for s in gathered),
        "clip_fraction": sum(s["clip"] for s in gathered) / tokens,
        "kl": sum(s["kl"] for s in gathered) / tokens,
        "ratio_max": max(s["ratio_max"] for s in gathered),
    }


def _scatter(shares: list | None, totals: dict | None, rank: int) -> tuple[list, dict]:
    """Each rank receives its own share of the step's trajectories (and the batch totals)."""
    received: list[Any] = [None]
    inputs = [(share, totals) for share in shares] if rank == 0 else None
    dist.scatter_object_list(received, inputs, src=0)
    return received[0]


def _broadcast(obj: Any, rank: int) -> Any:
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
        self.reward_fn = rollouts.load_callable(config.reward, "reward")
        r = config.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        self.writer = MetricsWriter(config.run.run_dir)

    def rollout(self, step: int) -> tuple[list[Trajectory], torch.Tensor, dict[str, float]]:
        cfg = self.config
        samples = self.stream.next_batch(cfg.grpo.prompts_per_step)
        seed = cfg.run.seed * 1_000_003 + step * 10_007
        counts = rollouts.prompt_token_counts(self.workers)
        groups, rollout_s, retries = self._collect(
            f"step {step + 1}'s rollout", samples, cfg.grpo.group_size, self.sampling, seed
        )
        prefill = rollouts.prefill_metrics(counts, rollouts.prompt_token_counts(self.workers))
        reward_s = rollouts.score(self.reward_fn, groups, samples, cfg.reward_kwargs)
        adv = rollouts.advantages(groups, cfg.grpo.normalize_std)
        trajectories = [t for group in groups for t in group]
        metrics = rollouts.rollout_metrics(trajectories)
        generated = sum(t.num_generated_tokens for t in trajectories)
        metrics.update(prefill)
        metrics.update(
            rollout_s=rollout_s,
            reward_s=reward_s,
            rollout_tokens_per_s=generated / max(rollout_s, 1e-9),
            policy_version=min(t.policy_version for t in trajectories),
            rollout_retries=retries,
            sample_ids=[sample.id for sample in samples],  # the data the step consumed
        )
        return trajectories, adv, metrics

    def _collect(
        self, what: str, samples: list, group_size: int, sampling: SamplingParams, seed: int
    ) -> tuple[list[list[Trajectory]], float, int]:
        """rollouts.collect, retried while lost rollout workers come back (Ray restarts them,
        rollout.max_restarts): same samples, same seeds, on the current policy. Returns the
        groups, the seconds of the attempt that succeeded and the number of retries."""
        max_retries = self.config.rollout.max_restarts
        retries = 0
        while True:
            try:
                groups, seconds = rollouts.collect(
                    self.workers, samples, group_size, sampling, seed=seed
                )
                return groups, seconds, retries
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
        groups, _, _ = self._collect("evaluation", self.eval_samples, per_prompt, sampling, 12345)
        rollouts.score(self.reward_fn, groups, self.eval_samples, self.config.reward_kwargs)
        metrics = rollouts.rollout_metrics([t for g in groups for t in g], prefix="eval/")
        metrics["eval_s"] = time.perf_counter() - start
        return metrics


def train_loop(loop_config: dict) -> None:
    """Ray Train's `train_loop_per_worker`."""
    import ray.train

    config = GRPOConfig.from_dict(loop_config["config"])
    workers = loop_config["rollout_workers"]
    model_path = loop_config["model_path"]
    launch_id = loop_config["launch_id"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    learner = Learner(config, model_path, rank, world)
    state = checkpoint.TrainState()
    # A worker group Ray Train restarted (trainer.max_failures) resumes from its own launch's
    # newest checkpoint: the data position in it is where the lost group's progress was saved.
    restarted = checkpoint.saved_by(config.run.run_dir, launch_id)
    if (config.run.resume or restarted) and checkpoint.has_checkpoint(config.run.run_dir):
        state = checkpoint.load(learner.engine, config.run.run_dir)
    sync = coordinator = None
    if rank == 0:
        sync = WeightSync(
            workers,
            learner.module,
            config.trainer.zero_stage,
            config.rollout.max_restarts,
            config.trainer.weight_sync,
        )
        coordinator = Coordinator(config, sync, state)
        logger.warning(
            "areno train: %d of %d parameters trainable (frozen: %s), sent to the rollout "
            "workers by %s; starting at step %d%s",
            learner.num_trainable,
            learner.num_total,
            ", ".join(learner.frozen) or "nothing",
            sync.transport,
            state.step,
            " (restarted after a trainer worker failed; resumed from its checkpoint)"
            if restarted
            else "",
        )
    _sync(learner, sync, state.step, rank)
    run_steps(config, learner, coordinator, sync, state, rank, launch_id)
    if config.run.export_hf:
        checkpoint.export_hf(
            learner.module,
            model_path,
            f"{config.run.run_dir}/hf",
            zero_stage=config.trainer.zero_stage,
            rank=rank,
        )
    if coordinator is not None:
        coordinator.writer.close()
    learner.engine.destroy()


def _sync(learner: Learner, sync: WeightSync | None, version: int, rank: int) -> float:
    """Every rank gathers (a collective under ZeRO-3); rank 0 sends."""
    named = trainable_named(learner.module)
    with gathered([p for _, p in named], learner.config.trainer.zero_stage):
        return sync.push(named, version) if sync is not None else 0.0


def run_steps(
    config: GRPOConfig,
    learner: Learner,
    coordinator: Coordinator | None,
    sync: WeightSync | None,
    state: checkpoint.TrainState,
    rank: int,
    launch_id: str | None = None,
) -> None:
    from tqdm import tqdm

    progress = None
    if rank == 0 and config.run.progress:
        progress = tqdm(total=config.run.max_steps, initial=state.step, desc="grpo", unit="step")
    world = dist.get_world_size()
    while state.step < config.run.max_steps:
        step_start = time.perf_counter()
        metrics: dict[str, float] = {}
        eval_due = config.run.eval_every and state.step % config.run.eval_every == 0
        if rank == 0:
            if eval_due:
                coordinator.writer.write(state.step, coordinator.evaluate())
            trajectories, adv, rollout_m = coordinator.rollout(state.step)
            metrics.update(rollout_m)
            pairs = list(zip(trajectories, adv.tolist(), strict=True))
            per_rank = len(pairs) // world
            shares = [pairs[r * per_rank : (r + 1) * per_rank] for r in range(world)]
            learn = config.grpo.loss.kl_coef > 0 or bool(adv.ne(0).any())
            totals = {
                "tokens": sum(t.num_generated_tokens for t in trajectories),
                "episodes": len(trajectories),
                "learn": learn,
            }
            metrics["update_skipped"] = float(not learn)
        else:
            shares, totals = None, None
        share, totals = _scatter(shares, totals, rank)
        train_start = time.perf_counter()
        sums = learner.train_step(share, totals)
        train_metrics = _reduce(sums)
        train_s = time.perf_counter() - train_start
        state.step += 1
        if totals["learn"]:
            sync_s = _sync(learner, sync, state.step, rank)
        else:  # no optimizer step: the workers' weights are current, only the version moves
            sync_s = sync.advance(state.step) if sync is not None else 0.0
        if rank == 0:
            state.data_position = coordinator.stream.position
        state = _broadcast(state, rank)
        saved = config.run.save_every and state.step % config.run.save_every == 0
        if saved or state.step == config.run.max_steps:
            checkpoint.save(
                learner.engine, config.run.run_dir, state, rank=rank, launch_id=launch_id
            )
        if rank == 0:
            metrics.update(train_metrics)
            metrics.update(train_s=train_s, weight_sync_s=sync_s)
            metrics["step_s"] = time.perf_counter() - step_start
            metrics["data_position"] = state.data_position
            metrics["trainable_params"] = learner.num_trainable
            coordinator.writer.write(state.step, metrics)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
    if rank == 0 and config.run.eval_every:
        coordinator.writer.write(state.step, coordinator.evaluate())
    if progress is not None:
        progress.close()
