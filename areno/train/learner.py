"""One trainer rank's policy under DeepSpeed (`Learner`): the step's passes over its share of the
trajectories (`grpo.mini_batches` x `grpo.epochs` optimizer steps), the proximal and reference
logprobs they need, and the step's training metrics summed over the ranks (`reduce_sums`)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from areno.engine.runner.encoder_cache import EncoderCache
from areno.processing.types import PromptInputs
from areno.rollout.trajectory import Trajectory
from areno.train.batching import MiniBatch
from areno.train.config import GRPOConfig, cpu_threads
from areno.train.controller import rollouts_overlap_training
from areno.train.grpo import policy_loss_terms
from areno.train.lora import base_model
from areno.train.packing import packed_logprobs, row_length
from areno.train.policy import (
    batch_logprobs,
    count_parameters,
    load_policy,
    pack_layout,
    set_train_mode,
)

logger = logging.getLogger("areno.train")


def _dtype(config: GRPOConfig, device: str) -> torch.dtype:
    if config.trainer.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, config.trainer.dtype)


def deepspeed_config(config: GRPOConfig, world_size: int, dtype: torch.dtype) -> dict:
    # NOTE: micro-batches vary in number per step; `Learner.accumulate` marks the last one of
    # each mini-batch as the accumulation boundary itself.
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.optim.grad_clip,
        "zero_optimization": {"stage": config.trainer.zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


# What a rank adds up over a step's passes (`Learner.train_step`, combined by `reduce_sums`).
SUM_KEYS = ("tokens", "abs_diff", "max_abs", "clip", "kl", "loss", "ratio_max", "steps")
SUM_KEYS += ("passes", "rows", "padded", "packed", "real", "fresh", "ratio", "tis")
SUM_KEYS += ("capped", "masked")
# seconds of the step's forward passes (logprobs: the policy's, the reference's, the recomputed
# old ones), backward passes and optimizer steps (`Learner.timed`)
PHASE_KEYS = ("forward_s", "backward_s", "optimizer_s")

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
            if rollouts_overlap_training(config):
                # NOTE: rollouts run beside training: each side computes on its own share of the
                # cores (oversubscribed, both slow down by more than half).
                torch.set_num_threads(cpu_threads(config.trainer.num_cpus_per_worker))
        dtype = _dtype(config, self.device)
        # Seeded before the policy is built: a LoRA adapter's initial factors come from torch's
        # generator (and so does dropout's noise), so two runs of one config start from the same
        # adapter on every rank. Unseeded, each run drew its own lora_A and the runs parted at
        # their second step.
        torch.manual_seed(config.run.seed)
        model, self.adapter, self.frozen = load_policy(
            model_path,
            dtype=dtype,
            freeze_towers=config.trainer.freeze_media_towers,
            freeze_projectors=config.trainer.freeze_projectors,
            lora=config.lora,
        )
        self.num_trainable, self.num_total = count_parameters(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optim = config.optim
        optimizer = torch.optim.AdamW(
            params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
        )
        self.deepspeed, *_ = deepspeed.initialize(
            model=model.to(self.device),
            optimizer=optimizer,
            model_parameters=params,
            config=deepspeed_config(config, world_size, dtype),
        )
        # A group's episodes share a row, their prompt once (`areno.train.packing`); None:
        # one trajectory a row.
        self.layout = pack_layout(self.module, self.device)
        self._sums: dict[str, float] | None = None  # the step's (`train_step`), for `timed`
        # The KL term's reference: the initial weights, a model of their own; under LoRA the
        # base model itself, its adapters disabled for the pass (`_reference`).
        self.kl = config.grpo.loss.kl_coef > 0
        self.ref = None
        if self.kl and not config.lora.enabled:
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
            self.features = EncoderCache(base_model(self.module), TRAINER_FEATURE_BYTES)

    @property
    def module(self) -> torch.nn.Module:
        return self.deepspeed.module

    def train_step(self, share: list[MiniBatch], learn: bool = True) -> dict[str, float]:
        """This rank's part of a step: for each of `grpo.epochs` passes over the rollout batch,
        each mini-batch's micro-batches accumulated, then one optimizer step."""
        set_train_mode(self.module, self.frozen)
        sums = dict.fromkeys(SUM_KEYS + PHASE_KEYS, 0.0)
        self._sums = sums
        if not learn:
            # NOTE: every advantage is 0 and there is no KL term, so the loss has no gradient;
            # an optimizer step would still move the weights along Adam's momentum.
            return sums
        cfg = self.config.grpo
        fixed: dict[int, dict[str, torch.Tensor]] = {}  # per trajectory, constant over passes
        try:
            if cfg.behaviour_logprobs == "recompute" and cfg.mini_batches * cfg.epochs > 1:
                self._recompute_old(share, fixed)
            for _ in range(cfg.epochs):
                for mini in share:
                    self.accumulate(mini, sums, fixed)
                    with self.timed("optimizer_s"):
                        self.deepspeed.step()
                    sums["steps"] += 1
        finally:
            if self.features is not None:
                self.features.clear()
        return sums

    @contextlib.contextmanager
    def timed(self, key: str):
        """Adds the block's seconds to this step's `key` (PHASE_KEYS); on a GPU to the end of
        the device work it queued."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            if self._sums is not None:
                self._sums[key] += time.perf_counter() - start

    def accumulate(
        self,
        mini: MiniBatch,
        sums: dict[str, float],
        fixed: dict[int, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """The gradient of one mini-batch's loss, accumulated over its micro-batches (the
        optimizer step is the caller's)."""
        fixed = {} if fixed is None else fixed
        for index, micro in enumerate(mini.micro):
            self.deepspeed.set_gradient_accumulation_boundary(index == len(mini.micro) - 1)
            if mini.is_filler(index):
                self._filler(micro, _rows(mini, index))
            else:
                self._learn(micro, _rows(mini, index), mini, sums, fixed)

    def _recompute_old(self, share: list[MiniBatch], fixed: dict) -> None:
        """behaviour_logprobs="recompute" with several optimizer steps per batch: the policy's
        logprobs before the first of them."""
        temperature = self.config.rollout.temperature
        with torch.no_grad():
            for mini in share:
                for index, micro in enumerate(mini.micro):
                    if mini.is_filler(index):
                        continue
                    trajs = [traj for traj, _ in micro]
                    rows = self._logprobs(self.module, trajs, _rows(mini, index), temperature)
                    for traj, row in zip(trajs, rows, strict=True):
                        fixed.setdefault(id(traj), {})["old"] = row

    def _logprobs(self, model, trajs: list[Trajectory], sizes: list[int], temperature) -> list:
        """Each trajectory's logprobs of its response tokens, from one forward over the
        micro-batch: rows of `sizes` consecutive trajectories packed (each trajectory's media
        features looked up around its own forward to the stack; media tensors of two
        trajectories are never concatenated), or, where the trainer does not pack, padded rows
        of one trajectory each."""
        with self.timed("forward_s"):
            return self._forward(model, trajs, sizes, temperature)

    def _forward(self, model, trajs: list[Trajectory], sizes: list[int], temperature) -> list:
        if self.layout is None or len(trajs) == 1:
            starts = [t.num_prompt_tokens for t in trajs]
            inputs = [t.inputs for t in trajs]
            with self._shared_features(inputs):
                return batch_logprobs(model, inputs, starts, self.device, temperature)
        rows = _split(trajs, sizes)
        inputs = [[t.inputs for t in row] for row in rows]
        starts = [[t.num_prompt_tokens for t in row] for row in rows]
        out = packed_logprobs(
            model,
            self.layout,
            inputs,
            starts,
            self.device,
            temperature,
            around=lambda item: self._shared_features([item]),
        )
        return [lp for row in out for lp in row]

    def _shared_features(self, items: list[PromptInputs]) -> contextlib.ExitStack:
        """Around one forward over `items`: the policy's and the reference's media features
        from `self.features` (frozen towers: a GRPO group's passes encode its media once)."""
        stack = contextlib.ExitStack()
        if self.features is not None:
            spans = [span for item in items for span in item.mm_spans]
            stack.enter_context(self.features.around(spans))
            if self.ref is not None:
                stack.enter_context(self.features.around(spans, self.ref))
        return stack

    @contextlib.contextmanager
    def _reference(self):
        """The KL term's reference model within the block."""
        if self.ref is not None:
            yield self.ref
            return
        with self.module.disable_adapter():
            yield self.module

    def _filler(self, micro, sizes: list[int]) -> None:
        """A backward pass that adds nothing (`MiniBatch.num_fillers`): this rank's gradient
        reduction meets the other ranks' for a mini-batch it has fewer trajectories of."""
        rows = self._logprobs(self.module, [traj for traj, _ in micro], sizes, 1.0)
        with self.timed("backward_s"):
            self.deepspeed.backward(sum(row.sum() for row in rows) * 0.0)

    def _learn(self, micro, sizes: list[int], mini: MiniBatch, sums: dict, fixed: dict) -> None:
        """One micro-batch's forward (rows of `sizes` consecutive trajectories), its
        trajectories' losses and one backward, added to `sums`."""
        cfg = self.config.grpo
        # The rollouts' sampling temperature: their logprobs are tempered (see
        # areno/rollout/episode.py), and so are these.
        temperature = self.config.rollout.temperature
        trajs = [traj for traj, _ in micro]
        rows = self._logprobs(self.module, trajs, sizes, temperature)
        if self.kl and any("ref" not in fixed.get(id(t), {}) for t in trajs):
            with torch.no_grad(), self._reference() as ref:
                refs = self._logprobs(ref, trajs, sizes, temperature)
            for traj, ref in zip(trajs, refs, strict=True):
                fixed.setdefault(id(traj), {})["ref"] = ref
        # The micro-batch's trajectories scored as one right-padded batch, their sums read
        # back in one copy: on a GPU a read per trajectory waits for the device each time.
        responses = [traj.loss_mask[traj.num_prompt_tokens :] for traj in trajs]
        logprobs = _padded_rows(rows)
        mask = _padded_host(responses, self.device)
        rollout_lp = _padded_host(
            [traj.rollout_logprobs[traj.num_prompt_tokens :] for traj in trajs], self.device
        )
        kept = [fixed.get(id(traj), {}) for traj in trajs]
        if cfg.behaviour_logprobs == "rollout":
            old = rollout_lp
        else:
            old = _padded_rows(
                [
                    k["old"] if "old" in k else row.detach()
                    for k, row in zip(kept, rows, strict=True)
                ]
            )
        ref_lp = _padded_rows([k["ref"] for k in kept]) if all("ref" in k for k in kept) else None
        adv = torch.tensor([a for _, a in micro], dtype=torch.float32, device=self.device)
        terms = policy_loss_terms(
            logprobs.float(),
            old.float(),
            adv,
            mask,
            config=cfg.loss,
            ref_logprobs=ref_lp,
            rollout_logprobs=rollout_lp,
        )
        counts = [float(sum(r)) for r in responses]
        if cfg.loss.loss_agg == "token_mean":
            weights = [n / max(mini.tokens, 1) for n in counts]
        else:
            weights = [1.0 / mini.episodes] * len(trajs)
        weight = torch.tensor(weights, dtype=torch.float32, device=self.device)
        total = (terms.sequence_losses(cfg.loss) * weight).sum()
        # NOTE: the engine-vs-trainer mismatch is read on tokens of the policy being trained;
        # older ones (overlapped rollouts) differ by the updates since as well.
        fresh = mask * _padded_host(
            [_sampled_by(traj, mini.version) for traj in trajs], self.device
        )
        abs_diff = (logprobs.detach().float() - rollout_lp).abs() * fresh
        read = {
            **terms.sums,
            "ratio_max": terms.ratio_max,
            "fresh": fresh.sum(),
            "abs_diff": abs_diff.sum(),
            "max_abs": abs_diff.max() if abs_diff.numel() else abs_diff.new_zeros(()),
            "loss": total.detach(),
        }
        values = dict(
            zip(read, torch.stack([v.float() for v in read.values()]).tolist(), strict=True)
        )
        n = sum(counts)
        sums["tokens"] += n
        sums["fresh"] += values["fresh"]
        sums["abs_diff"] += values["abs_diff"]
        sums["max_abs"] = max(sums["max_abs"], values["max_abs"])
        sums["clip"] += values["clip"]
        sums["kl"] += values.get("kl", 0.0)
        sums["ratio_max"] = max(sums["ratio_max"], values["ratio_max"])
        sums["ratio"] += values["ratio"]
        sums["tis"] += values.get("tis", n)  # a weight of 1 a token without a correction
        sums["capped"] += values.get("capped", 0.0)
        sums["masked"] += values.get("masked", 0.0)
        sums["loss"] += values["loss"]
        lengths = [row_length([t.inputs for t in row]) for row in _split(trajs, sizes)]
        sums["passes"] += 1
        sums["rows"] += len(trajs)
        sums["padded"] += len(lengths) * max(lengths)
        sums["packed"] += sum(lengths)
        sums["real"] += sum(t.num_tokens for t in trajs)
        # DeepSpeed averages the gradient over the ranks; undo it so the summed gradient is
        # that of the mini-batch's aggregate.
        with self.timed("backward_s"):
            self.deepspeed.backward(total * self.world_size)


def _rows(mini: MiniBatch, index: int) -> list[int]:
    """The row sizes of micro-batch `index` of `mini` (1 each: unpacked)."""
    return mini.rows[index] if mini.rows is not None else [1] * len(mini.micro[index])


def _split(items: list, sizes: list[int]) -> list[list]:
    """`items` cut into consecutive runs of `sizes`."""
    out, at = [], 0
    for size in sizes:
        out.append(items[at : at + size])
        at += size
    return out


def _sampled_by(traj: Trajectory, version: int | None) -> list[float]:
    """Per response token: 1 where policy `version` sampled it (None: any policy)."""
    start = traj.num_prompt_tokens
    if version is None or not traj.token_versions:
        return [1.0] * (traj.num_tokens - start)
    versions = iter(traj.token_versions)
    marks = [float(next(versions) == version) if m else 0.0 for m in traj.loss_mask]
    return marks[start:]


def _padded_host(rows: list[list[float]], device: str) -> torch.Tensor:
    """[B, T] float32 on `device` from host rows of unequal lengths, right-padded with 0: one
    copy."""
    width = max((len(row) for row in rows), default=0)
    padded = [list(row) + [0.0] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.float32, device=device)


def _padded_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """[B, T] from 1-D device tensors of unequal lengths, right-padded with 0 (differentiable)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _device(config: GRPOConfig) -> str:
    if config.trainer.use_gpu and torch.cuda.is_available():
        import ray.train.torch

        return str(ray.train.torch.get_device())
    return "cpu"


def reduce_sums(sums: dict[str, float]) -> dict[str, float]:
    """Combine every rank's sums into the step's training metrics (on every rank)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    tokens = sum(s["tokens"] for s in gathered) or 1.0
    steps = gathered[0]["steps"]  # the same on every rank
    passes = sum(s["passes"] for s in gathered)
    padded = sum(s["padded"] for s in gathered)
    packed = sum(s["packed"] for s in gathered)
    real = sum(s["real"] for s in gathered)
    slowest = max(gathered, key=lambda s: sum(s.get(key, 0.0) for key in PHASE_KEYS))
    return {
        # the mean over the step's optimizer steps of each mini-batch's loss
        "loss": sum(s["loss"] for s in gathered) / max(steps, 1),
        "optimizer_steps": steps,
        "trained_tokens": real,  # every pass's trajectory tokens
        "train_passes": passes,
        "trajectories_per_pass": sum(s["rows"] for s in gathered) / max(passes, 1),
        "padding_fraction": 1.0 - packed / padded if padded else 0.0,
        # the trajectory tokens a pass did not run again: a group's prompt, packed once
        "shared_fraction": 1.0 - packed / real if real else 0.0,
        "logprob_mismatch_mean_abs": sum(s["abs_diff"] for s in gathered)
        / (sum(s["fresh"] for s in gathered) or 1.0),
        "logprob_mismatch_max_abs": max(s["max_abs"] for s in gathered),
        "clip_fraction": sum(s["clip"] for s in gathered) / tokens,
        "kl": sum(s["kl"] for s in gathered) / tokens,
        "ratio_max": max(s["ratio_max"] for s in gathered),
        "ratio_mean": sum(s["ratio"] for s in gathered) / tokens,
        # the rollout correction's weight (grpo.loss.rollout_correction): 1 when off
        "tis_weight_mean": sum(s["tis"] for s in gathered) / tokens,
        # the trained tokens whose TIS weight hit tis_cap, and those the mask weighted 0
        "tis_capped_fraction": sum(s["capped"] for s in gathered) / tokens,
        "masked_fraction": sum(s["masked"] for s in gathered) / tokens,
        # the slowest rank's, whole (the others wait for it at each backward's reduction): a
        # maximum per phase would add up to more than any rank spent
        **{f"time/{key}": slowest.get(key, 0.0) for key in PHASE_KEYS},
    }
