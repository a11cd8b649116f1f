"""`areno train`: start (or join) Ray, create the rollout workers, run the Ray Train job."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from pathlib import Path

from areno.errors import ArenoError
from areno.imports import import_callable
from areno.logs import ENV
from areno.models.registry import adapter_for_checkpoint
from areno.programs.program import load_program
from areno.programs.worker import ProgramWorker
from areno.rollout.worker import RolloutSpec, RolloutWorker
from areno.train.config import DEFAULT_MAX_FAILURES, GRPOConfig, cpu_threads
from areno.train.controller import rollouts_overlap_training
from areno.train.metrics import TRACKER_ENV, check_trackers
from areno.train.rollouts import rollout_start_error

logger = logging.getLogger("areno.train")


class TrainingStoppedError(ArenoError):
    """Ray Train gave up: a trainer worker failed more often than trainer.max_failures allows.
    Its message is Ray Train's (which worker failed, and why) and how to go on from there."""

    status_code = 500
    error_type = "server_error"
    code = "training_failed"


def resume_hint(config: GRPOConfig) -> str:
    """How to go on after the trainer workers failed for good, as this run's settings allow."""
    run_dir = config.run.run_dir
    if config.run.save_every <= 0:
        return (
            f"areno train: stopped with no checkpoint to resume from (trainer.max_failures = "
            f"{config.max_failures}). Set run.save_every (--save-every N) to save one every N "
            f"steps: a lost trainer worker then restarts the group from the newest one (up to "
            f"trainer.max_failures times, {DEFAULT_MAX_FAILURES} by default), and a run that "
            f"stopped goes on with the same command plus `--resume --run-dir {run_dir}`."
        )
    return (
        f"areno train: stopped after trainer.max_failures = {config.max_failures} restart(s). "
        f"Go on from the newest checkpoint in {run_dir}/checkpoints with the same command plus "
        f"`--resume --run-dir {run_dir}` (raise trainer.max_failures to allow more restarts)."
    )


def rollout_spec(config: GRPOConfig, model_path: str) -> RolloutSpec:
    r = config.rollout
    engine = dataclasses.replace(
        r.engine,
        # A worker on a share of a GPU (beside the trainer) takes that share of its memory.
        kv_cache_memory_fraction=r.engine.kv_cache_memory_fraction
        * min(r.num_gpus_per_worker or 1, 1),
        num_cpus_per_rank=r.num_cpus_per_worker,
        # a LoRA policy runs as the engine's one adapter, beside the base weights
        max_loras=1 if config.lora.enabled else 0,
        max_lora_rank=max(config.lora.rank, 1),
    )
    return RolloutSpec(
        model_path=model_path,
        engine=engine,
        agent=r.agent,
        agent_kwargs=dict(r.agent_kwargs),
        program=r.program,
        program_max_calls=r.program_max_calls,
        program_timeout_s=r.program_timeout_s,
        max_prompt_tokens=r.max_prompt_tokens,
        max_tokens_per_turn=r.max_tokens_per_turn,
        partial_rollouts=r.partial_rollouts,
        # NOTE: only a generator computing on CPU (no GPU share) competes with the trainer's
        cpu_threads=cpu_threads(r.num_cpus_per_worker)
        if rollouts_overlap_training(config) and not r.num_gpus_per_worker
        else None,
    )


def start_rollout_workers(config: GRPOConfig, model_path: str) -> list:
    """One RolloutWorker actor per generator replica (tensor-parallel followers are its own);
    a ProgramWorker (areno.programs) when `rollout.program` names an agent program. Returns at
    once: the engines start while the trainer does (`rollouts_started`).

    Ray restarts a lost worker up to rollout.max_restarts times. Its calls are never retried by
    Ray (max_task_retries=0): the restarted process holds the initial weights, so the trainer
    first sends it the current ones and then retries the whole step (`Controller`)."""
    import ray

    spec = rollout_spec(config, model_path)
    worker_cls = RolloutWorker
    if spec.program:
        worker_cls = ProgramWorker
    # Workers on a running cluster do not inherit this process's environment.
    env_vars = {ENV: os.environ[ENV]} if ENV in os.environ else {}
    cls = ray.remote(worker_cls).options(
        num_cpus=config.rollout.num_cpus_per_worker,
        num_gpus=config.rollout.num_gpus_per_worker,
        resources=config.rollout.resources_per_worker,
        max_concurrency=64,
        max_restarts=config.rollout.max_restarts,
        max_task_retries=0,
        runtime_env={"env_vars": env_vars} if env_vars else None,
    )
    return [cls.remote(spec) for _ in range(config.rollout.num_workers)]


def rollouts_started(ready: list) -> None:
    """Waits for the rollout workers; raises RolloutStartError where one could not start."""
    error = rollout_start_error(ready)
    if error is not None:
        raise error


def run(config: GRPOConfig) -> Path:
    """Train; returns the run directory (metrics.jsonl, checkpoints/, hf/)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    check_trackers(config.run.loggers)  # a missing package or server, before anything starts
    model_path = config.model_path or _embedded_default()
    if Path(model_path).is_dir():  # a relative path means this process's, not a worker's, cwd
        model_path = str(Path(model_path).resolve())
    # A path that is no checkpoint of a supported family fails here, naming it, before Ray
    # starts (as `areno serve` does), not in a worker's traceback.
    adapter_for_checkpoint(model_path)
    run_dir = Path(config.run.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    config.run.run_dir = str(run_dir)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
    # A wrong agent or program name (or signature) fails here, naming the setting, before Ray
    # and any engine start; the agent is built on each worker, whose errors follow below.
    if config.rollout.program:
        load_program(config.rollout.program)
    elif config.rollout.agent:
        import_callable(config.rollout.agent, "agent")
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    workers = start_rollout_workers(config, model_path)
    # NOTE: the trainer starts (loads the policy, DeepSpeed) while the rollout engines do
    # (compiling and capturing on a GPU takes minutes); it waits for them before its first
    # weight sync, and where one could not start it ends at once and the error is raised here.
    ready = [w.policy_version.remote() for w in workers]
    t = config.trainer
    resources = {"CPU": t.num_cpus_per_worker, **t.resources_per_worker}
    if t.use_gpu:
        resources["GPU"] = t.num_gpus_per_worker
    trainer = TorchTrainer(
        train_loop_per_worker=_train_loop,
        train_loop_config={
            "config": config.to_dict(),
            "rollout_workers": workers,
            "rollouts_ready": ready,
            "model_path": model_path,
            # tells a restarted worker group its own checkpoints from older launches' ones
            "launch_id": uuid.uuid4().hex,
            # what rank 0's trackers read from the environment, as this process has it
            "tracker_env": {k: os.environ[k] for k in TRACKER_ENV if k in os.environ},
        },
        scaling_config=ScalingConfig(
            num_workers=t.num_workers, use_gpu=t.use_gpu, resources_per_worker=resources
        ),
        torch_config=TorchConfig(backend="nccl" if t.use_gpu else "gloo"),
        run_config=RunConfig(
            name="areno-grpo",
            storage_path=str(run_dir / "ray"),
            failure_config=FailureConfig(max_failures=config.max_failures),
        ),
    )
    try:
        try:
            trainer.fit()
        except TrainingFailedError as error:
            rollouts_started(ready)  # a worker that could not start is the cause to name
            raise TrainingStoppedError(f"{error}\n{resume_hint(config)}") from None
        rollouts_started(ready)
    finally:
        for worker in workers:
            ray.kill(worker)
    return run_dir


def _train_loop(loop_config: dict) -> None:
    from areno.train.trainer import train_loop

    train_loop(loop_config)


def _embedded_default() -> str:
    from areno.models.tiny import DEFAULT_FAMILY, tiny_checkpoint

    return str(tiny_checkpoint(DEFAULT_FAMILY))
