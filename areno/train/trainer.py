"""The GRPO loop each Ray Train worker runs (`train_loop`): per step, rank 0's controller makes
the batch (rollout, reward, advantages: areno/train/controller.py) -> every rank receives its
share -> trains it (DeepSpeed: areno/train/learner.py) -> the weights go to the rollout workers
-> checkpoint."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch.distributed as dist

from areno.train import checkpoint
from areno.train.config import GRPOConfig
from areno.train.controller import Controller, StepBatch
from areno.train.learner import Learner, reduce_sums
from areno.train.lora import export_adapter, is_lora
from areno.train.metrics import PhaseTimer
from areno.train.rollouts import rollout_start_error
from areno.train.weight_sync import WeightSync, gathered, trainable_named

logger = logging.getLogger("areno.train")


def _scatter(batch: StepBatch | None, rank: int, world_size: int) -> tuple[list, bool]:
    """Each rank receives its own mini-batches of the step (and whether the step learns).
    Rank 0 keeps its own share as it is: pickled, a share's trajectories carry their media
    tensors, each episode its own copy (1.9 s of the AVE agent's 3.5 s step on CPU, with one
    rank; docs/performance.md). Only the other ranks' shares are sent."""
    if world_size == 1:
        return batch.shares[0], batch.learn
    received: list[Any] = [None]
    inputs = None
    if rank == 0:
        inputs = [None] + [(share, batch.learn) for share in batch.shares[1:]]
    dist.scatter_object_list(received, inputs, src=0)
    return (batch.shares[0], batch.learn) if rank == 0 else received[0]


def _broadcast(obj: Any, rank: int) -> Any:
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    # the rollout workers start while the trainer does: where one could not, nothing is left
    # to train with and a restart of this group would meet it again; `areno train` raises it
    if rollout_start_error(loop_config.get("rollouts_ready", [])) is not None:
        logger.warning("areno train: a rollout worker could not start; the trainer stops")
        return
    state = checkpoint.TrainState()
    # A worker group Ray Train restarted (trainer.max_failures) resumes from its own launch's
    # newest checkpoint: the data position in it is where the lost group's progress was saved.
    restarted = checkpoint.saved_by(config.run.run_dir, launch_id)
    if (config.run.resume or restarted) and checkpoint.has_checkpoint(config.run.run_dir):
        state = checkpoint.load(learner.deepspeed, config.run.run_dir)
    sync = controller = None
    if rank == 0:
        os.environ.update(loop_config.get("tracker_env", {}))
        sync = WeightSync(
            workers,
            learner.module,
            config.trainer.zero_stage,
            config.rollout.max_restarts,
            config.trainer.weight_sync,
        )
        controller = Controller(
            config,
            sync,
            state.step,
            state.data_position,
            world_size=world,
            batched_media=learner.adapter.batched_media,
            packs=learner.layout is not None,
        )
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
    state = run_steps(config, learner, controller, sync, state, rank, launch_id)
    if controller is not None:
        controller.close(state.step)
    if is_lora(learner.module):
        named = trainable_named(learner.module)
        with gathered([p for _, p in named], config.trainer.zero_stage):
            if rank == 0:
                export_adapter(learner.module, model_path, f"{config.run.run_dir}/adapter")
    elif config.run.export_hf:
        checkpoint.export_hf(
            learner.module,
            model_path,
            f"{config.run.run_dir}/hf",
            zero_stage=config.trainer.zero_stage,
            rank=rank,
        )
    learner.deepspeed.destroy()


def _sync(learner: Learner, sync: WeightSync | None, version: int, rank: int) -> float:
    """Every rank gathers (a collective under ZeRO-3); rank 0 sends."""
    named = trainable_named(learner.module)
    with gathered([p for _, p in named], learner.config.trainer.zero_stage):
        return sync.push(named, version) if sync is not None else 0.0


def run_steps(
    config: GRPOConfig,
    learner: Learner,
    controller: Controller | None,
    sync: WeightSync | None,
    state: checkpoint.TrainState,
    rank: int,
    launch_id: str | None = None,
) -> checkpoint.TrainState:
    """The steps from `state.step` to `run.max_steps`: batch (rank 0) -> scatter -> train ->
    sync -> metrics -> checkpoint (`step_s` leaves the metrics' writing and the checkpoint's
    save out: they are the next step's `time/record_s` and `time/checkpoint_s`, and its
    `time/cycle_s` runs from this step's end to its own). Returns the state after the last."""
    ended = None  # when the step before's `step_s` was taken
    carried: dict[str, float] = {}  # the step before's record and checkpoint seconds
    while state.step < config.run.max_steps:
        step_start = time.perf_counter()
        timer = PhaseTimer()
        batch = controller.batch(state.step) if controller is not None else None
        with timer("scatter"):
            share, learn = _scatter(batch, rank, learner.world_size)
        train_start = time.perf_counter()
        train_metrics = reduce_sums(learner.train_step(share, learn))
        train_s = time.perf_counter() - train_start
        state.step += 1
        if learn:
            sync_s = _sync(learner, sync, state.step, rank)
        else:  # no optimizer step: the workers' weights are current, only the version moves
            sync_s = sync.advance(state.step) if sync is not None else 0.0
        if batch is not None:
            # the samples of rollouts still running are drawn again by a run resumed from here
            state.data_position = batch.data_position
        with timer("broadcast"):
            state = _broadcast(state, rank)
        # The step's metrics are written before its checkpoint: a run killed in between redoes
        # the step when resumed, and no checkpointed step lacks them.
        start = time.perf_counter()
        if controller is not None:
            metrics = {**batch.metrics, **train_metrics, **timer.metrics(), **carried}
            metrics.update(
                train_s=train_s,
                weight_sync_s=sync_s,
                step_s=start - step_start,
                train_tokens_per_s=train_metrics["trained_tokens"] / max(train_s, 1e-9),
                data_position=state.data_position,
                trainable_params=learner.num_trainable,
            )
            metrics["time/train_s"] = train_s
            metrics["time/weight_sync_s"] = sync_s
            if ended is not None:
                metrics["time/cycle_s"] = start - ended
            controller.record(state.step, metrics)
        ended = start
        recorded = time.perf_counter()
        saved = config.run.save_every and state.step % config.run.save_every == 0
        if saved or state.step == config.run.max_steps:
            checkpoint.save(
                learner.deepspeed, config.run.run_dir, state, rank=rank, launch_id=launch_id
            )
        carried = {
            "time/record_s": recorded - start,
            "time/checkpoint_s": time.perf_counter() - recorded,
        }
    return state
