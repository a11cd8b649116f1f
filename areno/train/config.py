"""GRPOConfig: one typed config per part, composed; read from YAML, overridden by flags.

A YAML file mirrors the sections below (`data:`, `rollout:`, `grpo:`, `optim:`, `trainer:`,
`lora:`, `run:`) plus the top-level `model_path` and `reward`. Unknown keys are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from areno.engine.config import EngineConfig
from areno.errors import ConfigError
from areno.resources import check_custom_resources
from areno.settings import build, reference, setting
from areno.train.grpo import GRPOLossConfig
from areno.train.lora import LoraConfig
from areno.train.metrics import TRACKER_MODULES


def _positive(section: str, name: str, value: Any, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{section}.{name} must be an integer >= {low}; got {value!r}")


def cpu_threads(num_cpus: float) -> int:
    """torch's compute threads for one side of an overlapped loop (rollout.max_staleness > 0) on
    CPU: the CPUs Ray gives it, at least one. Serially each side runs alone and keeps torch's
    default, every core."""
    return max(1, math.floor(num_cpus))


@dataclass
class DataConfig:
    """Where samples come from: loaders named by import path ("module:callable")."""

    loader: str = setting(
        "areno.tasks.color_quiz:load",
        help='module:callable yielding the training samples (called with split="train")',
    )
    loader_kwargs: dict = setting(
        default_factory=dict, help="keyword arguments of the loader (also the evaluation's)"
    )
    eval_loader: str | None = setting(
        None, help="module:callable of the held-out samples; none: the training loader"
    )
    eval_loader_kwargs: dict = setting(
        default_factory=dict,
        help="keyword arguments of the evaluation loader; empty: loader_kwargs with "
        'split="validation"',
    )
    shuffle: bool = setting(True, help="shuffle the samples each epoch (seeded by run.seed)")


# A rollout worker's engine unless the config says otherwise: more sequences and a shorter
# context than serving's (a GRPO step's groups run together; agent turns are short).
_ROLLOUT_ENGINE = EngineConfig(max_running_prompts=16, max_context_len=1024)
# Engine settings the rollout workers take from other settings (areno/train/run.py).
_ENGINE_FROM = {
    "max_loras": "lora.rank (a LoRA policy is the engine's one adapter)",
    "max_lora_rank": "lora.rank",
    "num_cpus_per_rank": "rollout.num_cpus_per_worker",
}
# Engine settings of serving that a rollout worker has no use for, with the reason.
_ENGINE_UNUSED = {"stream_interval_ms": "rollouts read whole replies, never a stream"}


@dataclass
class RolloutConfig:
    """The rollout workers: serving's decoder / processor / generator, its engine settings
    under `engine`."""

    # The engine settings that moved under `engine`, each refused with its new name.
    RENAMED: ClassVar[dict[str, str]] = {
        name: f"engine.{name}"
        for name in (
            "tp_size",
            "max_running_prompts",
            "max_context_len",
            "block_size",
            "enable_prefix_caching",
            "prefix_state_rows",
            "kv_cache_gib",
            "kv_cache_memory_fraction",
            "dtype",
            "device",
        )
    }

    engine: EngineConfig = setting(
        default_factory=lambda: _ROLLOUT_ENGINE,
        help="each rollout worker's engine: the settings of `areno serve`'s engine flags",
    )
    agent: str | None = setting(
        None, help="module:callable returning an areno Agent; none: one turn, no tools"
    )
    agent_kwargs: dict = setting(default_factory=dict, help="keyword arguments of the agent")
    program: str | None = setting(
        None,
        help="module:callable of an agent program, run(sample, client) or run(sample, "
        "base_url), whose OpenAI chat calls are the rollout (docs/agent-programs.md); instead "
        "of an agent",
    )
    program_max_calls: int = setting(
        16, help="chat calls one episode of the agent program may make; more are refused (429)"
    )
    program_timeout_s: float = setting(
        600.0, help="seconds an episode of the agent program may run; later, it ends unfinished"
    )
    num_workers: int = setting(
        1, help="rollout workers, each one Generator replica of engine.tp_size ranks"
    )
    max_prompt_tokens: int | None = setting(
        None, help="limit on a sample's encoded prompt (media tokens included); longer: skipped"
    )
    max_tokens_per_turn: int = setting(64, help="tokens one assistant turn may sample")
    temperature: float = setting(1.0, help="sampling temperature of the rollouts")
    top_p: float = setting(1.0, help="nucleus sampling of the rollouts")
    top_k: int = setting(-1, help="top-k sampling of the rollouts; -1: off")
    num_cpus_per_worker: float = setting(1.0, help="CPUs Ray reserves for each rollout worker")
    num_gpus_per_worker: float = setting(
        0.0,
        help="GPUs Ray reserves for each rollout worker; a fraction shares one with the trainer",
    )
    resources_per_worker: dict = setting(
        default_factory=dict,
        help="custom Ray resources per worker ({rollout: 1}): only nodes that have them host "
        "one; its tensor-parallel followers follow rank 0 onto that node",
    )
    max_restarts: int = setting(
        3,
        help="times Ray restarts a lost rollout worker (its process crashed, its node went "
        "away); the step whose rollout it was running is retried on the current policy, with "
        "the same samples",
    )
    max_staleness: int = setting(
        0,
        help="rollouts of the next steps run while the trainer trains: a trajectory trained "
        "on at step t has no token sampled by a policy older than t - max_staleness (0: "
        "rollout, then train)",
    )
    partial_rollouts: bool = setting(
        False,
        help="with max_staleness >= 1, new weights reach the rollout workers between two "
        "engine steps and the episodes in flight go on under them: each sampled token keeps "
        "the policy version that sampled it and its own logprob, and the staleness bound "
        "holds per token; off, a weight update waits for every episode in flight to end (new "
        "ones wait for it), so each episode is sampled by one policy",
    )

    def __post_init__(self) -> None:
        for name in ("num_workers", "max_tokens_per_turn", "program_max_calls"):
            _positive("rollout", name, getattr(self, name))
        if not self.program_timeout_s > 0:
            raise ConfigError(
                f"rollout.program_timeout_s must be positive, got {self.program_timeout_s}",
                param="program_timeout_s",
            )
        if self.program and (self.agent or self.agent_kwargs):
            raise ConfigError(
                "rollout.program and rollout.agent both set: an episode is either an agent "
                "program's run or an areno Agent's; set one",
                param="program",
            )
        if isinstance(self.engine, dict):
            self.engine = EngineConfig.from_dict(self.engine, "rollout.engine", _ROLLOUT_ENGINE)
        # Settings a rollout worker's engine takes from elsewhere in the config.
        for name, source in _ENGINE_FROM.items():
            if getattr(self.engine, name) != getattr(_ROLLOUT_ENGINE, name):
                raise ConfigError(
                    f"rollout.engine.{name} is set from {source}; leave it out", param=name
                )
        for name, reason in _ENGINE_UNUSED.items():
            if getattr(self.engine, name) != getattr(_ROLLOUT_ENGINE, name):
                raise ConfigError(
                    f"rollout.engine.{name} does nothing here ({reason}); leave it out",
                    param=name,
                )
        _positive("rollout", "max_restarts", self.max_restarts, allow_zero=True)
        _positive("rollout", "max_staleness", self.max_staleness, allow_zero=True)
        if not isinstance(self.partial_rollouts, bool):
            raise ConfigError(
                f"rollout.partial_rollouts must be true or false; got {self.partial_rollouts!r}",
                param="partial_rollouts",
            )
        if self.partial_rollouts and not self.max_staleness:
            raise ConfigError(
                "rollout.partial_rollouts needs rollout.max_staleness >= 1: at 0 no episode "
                "is in flight when new weights land (the rollout ends before the step "
                "trains), so there is nothing to continue; set max_staleness or leave "
                "partial_rollouts out",
                param="partial_rollouts",
            )
        self.resources_per_worker = check_custom_resources(
            self.resources_per_worker, "rollout.resources_per_worker"
        )


@dataclass
class AlgoConfig:
    """GRPO: groups of `group_size` episodes per prompt, `prompts_per_step` prompts per step."""

    group_size: int = setting(8, help="episodes per prompt, whose rewards are compared")
    prompts_per_step: int = setting(4, help="prompts (groups) per step")
    normalize_std: bool = setting(
        True, help="divide a group's advantages by its rewards' standard deviation"
    )
    behaviour_logprobs: str = setting(
        "rollout",
        choices=("rollout", "recompute"),
        help="what the ratio is taken against: rollout, the generator's logprobs (the "
        "sampler's); recompute, the trainer's own before the update (the proximal policy), "
        "loss.rollout_correction correcting proximal against sampler (token_tis: decoupled "
        'PPO); the accepted combinations are in docs/architecture.md, "Off-policy correction"',
    )
    loss: GRPOLossConfig = setting(default_factory=GRPOLossConfig, help="the policy loss")
    mini_batches: int = setting(
        1,
        help="optimizer steps per rollout batch: the batch split into this many parts, each "
        "one step; the ratio is clipped against the behaviour logprobs",
    )
    epochs: int = setting(1, help="passes over the rollout batch (mini_batches steps each)")
    dynamic_sampling: bool = setting(
        False,
        help="DAPO's dynamic sampling: a group whose rewards are all equal (no advantage) is "
        "dropped and more prompts are drawn, their rollouts beside the others in flight, until "
        "the step has prompts_per_step groups or max_extra_prompts more were drawn",
    )
    max_extra_prompts: int | None = setting(
        None,
        help="with dynamic_sampling, the most prompts one step draws beyond prompts_per_step; "
        "a step that reaches it trains the groups it kept (dynamic_sampling_unfilled in the "
        "metrics); none: 3 x prompts_per_step",
    )

    def __post_init__(self) -> None:
        _positive("grpo", "group_size", self.group_size)
        _positive("grpo", "prompts_per_step", self.prompts_per_step)
        _positive("grpo", "mini_batches", self.mini_batches)
        _positive("grpo", "epochs", self.epochs)
        if self.max_extra_prompts is not None:
            _positive("grpo", "max_extra_prompts", self.max_extra_prompts, allow_zero=True)
            if not self.dynamic_sampling:
                raise ConfigError(
                    "grpo.max_extra_prompts bounds grpo.dynamic_sampling, which is off; set "
                    "grpo.dynamic_sampling: true or leave max_extra_prompts out",
                    param="max_extra_prompts",
                )
        if self.dynamic_sampling and self.group_size < 2:
            raise ConfigError(
                "grpo.dynamic_sampling drops groups whose rewards are all equal: with "
                "grpo.group_size = 1 every group would be dropped; use group_size >= 2",
                param="dynamic_sampling",
            )
        if self.behaviour_logprobs not in ("rollout", "recompute"):
            raise ConfigError(
                f"grpo.behaviour_logprobs must be 'rollout' or 'recompute'; "
                f"got {self.behaviour_logprobs!r}"
            )
        if isinstance(self.loss, dict):
            self.loss = _build(GRPOLossConfig, self.loss, "grpo.loss")

    @property
    def extra_prompts_bound(self) -> int:
        """The most prompts a step draws beyond prompts_per_step (dynamic sampling)."""
        if self.max_extra_prompts is None:
            return 3 * self.prompts_per_step
        return self.max_extra_prompts


@dataclass
class OptimConfig:
    lr: float = setting(1e-5, help="AdamW's learning rate")
    weight_decay: float = setting(0.0, help="AdamW's weight decay")
    betas: tuple[float, float] = setting((0.9, 0.999), help="AdamW's betas")
    grad_clip: float = setting(1.0, help="the gradient's largest global norm")


WEIGHT_SYNC_TRANSPORTS = ("auto", "object_store", "cuda_ipc")
# Worker-group restarts a run allows by default when it saves checkpoints (trainer.max_failures):
# a lost worker costs the steps since the newest checkpoint, not the run.
DEFAULT_MAX_FAILURES = 3


@dataclass
class TrainerConfig:
    """Ray Train workers holding the policy under DeepSpeed."""

    num_workers: int = setting(1, help="Ray Train workers (DeepSpeed ranks)")
    zero_stage: int = setting(2, choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage")
    dtype: str = setting("auto", help="the policy's dtype; auto: float32 on CPU, bfloat16 on GPU")
    use_gpu: bool = setting(False, help="train on GPUs (NCCL); else on CPU (gloo)")
    num_cpus_per_worker: float = setting(1.0, help="CPUs Ray reserves for each trainer worker")
    num_gpus_per_worker: float = setting(1.0, help="GPUs per trainer worker, with use_gpu")
    resources_per_worker: dict = setting(
        default_factory=dict, help="custom Ray resources per trainer worker, as rollout's"
    )
    freeze_media_towers: bool = setting(True, help="keep the vision / audio towers frozen")
    freeze_projectors: bool = setting(True, help="keep the media projectors frozen")
    micro_batch_tokens: int = setting(
        4096,
        help="the most tokens one forward / backward takes (rows x the longest row): several "
        "trajectories share a pass up to it (areno/train/batching.py); 0: one a pass",
    )
    max_failures: int | None = setting(
        None,
        help="times Ray Train restarts the worker group after a worker fails (a killed process, "
        "a lost node, an error raised in a worker); each restart resumes from this launch's "
        f"newest checkpoint. None: {DEFAULT_MAX_FAILURES} when run.save_every > 0, else 0 (a "
        "restart would redo the launch from its start; the error then says how to resume)",
    )
    weight_sync: str = setting(
        "auto",
        choices=WEIGHT_SYNC_TRANSPORTS,
        help="how rank 0 sends the weights to the rollout workers: object_store (host copies "
        "through Ray's object store, any placement), cuda_ipc (device-memory handles; every "
        "rollout worker shares rank 0's GPU, ZeRO-0/1/2), auto (cuda_ipc where it can)",
    )

    def __post_init__(self) -> None:
        _positive("trainer", "num_workers", self.num_workers)
        if self.weight_sync not in WEIGHT_SYNC_TRANSPORTS:
            raise ConfigError(
                f"trainer.weight_sync must be one of {WEIGHT_SYNC_TRANSPORTS}; "
                f"got {self.weight_sync!r}"
            )
        if self.max_failures is not None:
            _positive("trainer", "max_failures", self.max_failures, allow_zero=True)
        _positive("trainer", "micro_batch_tokens", self.micro_batch_tokens, allow_zero=True)
        self.resources_per_worker = check_custom_resources(
            self.resources_per_worker, "trainer.resources_per_worker"
        )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"trainer.zero_stage must be 0, 1, 2 or 3; got {self.zero_stage!r}")


@dataclass
class RunConfig:
    RENAMED: ClassVar[dict[str, str]] = {"trackers": "loggers"}

    run_dir: str = setting(
        "runs/grpo", help="where metrics.jsonl, TensorBoard, checkpoints/ and hf/ go"
    )
    max_steps: int = setting(20, help="GRPO steps")
    save_every: int = setting(0, help="steps between checkpoints; 0: only at the end")
    eval_every: int = setting(5, help="steps between evaluations; 0: never")
    eval_size: int = setting(16, help="held-out samples an evaluation runs")
    eval_temperature: float = setting(0.0, help="the evaluation's sampling temperature")
    eval_samples_per_prompt: int = setting(
        1,
        help="episodes per held-out prompt, averaged (verl's val n): with eval_temperature > "
        "0 the held-out reward is that of the sampling policy, not of one draw",
    )
    seed: int = setting(0, help="orders the data, seeds every episode's sampling and the policy")
    resume: bool = setting(False, help="continue from the run directory's newest checkpoint")
    export_hf: bool = setting(
        True, help="write hf/ at the end (a LoRA run writes its small adapter/ always)"
    )
    progress: bool = setting(True, help="a progress bar on the console")
    loggers: list = setting(
        default_factory=lambda: ["tensorboard"],
        help="where each step's metrics go besides metrics.jsonl: any of tensorboard (the run "
        "directory's tensorboard/), wandb (Weights & Biases; extra areno[wandb]; WANDB_MODE "
        "and the like from the environment), mlflow (extra areno[mlflow]; the server of "
        "MLFLOW_TRACKING_URI)",
    )
    project: str = setting(
        "areno", help="the W&B project and MLflow experiment a run is logged in, by its name"
    )

    def __post_init__(self) -> None:
        loggers = self.loggers
        if (
            not isinstance(loggers, list | tuple)
            or not all(isinstance(t, str) and t in TRACKER_MODULES for t in loggers)
            or len(set(loggers)) != len(loggers)
        ):
            raise ConfigError(
                f"run.loggers must be a list of distinct loggers among "
                f"{', '.join(TRACKER_MODULES)}; got {loggers!r}",
                param="loggers",
            )
        self.loggers = list(loggers)
        _positive("run", "max_steps", self.max_steps)
        _positive("run", "save_every", self.save_every, allow_zero=True)
        _positive("run", "eval_every", self.eval_every, allow_zero=True)
        _positive("run", "eval_samples_per_prompt", self.eval_samples_per_prompt)


def _check_correction(grpo: AlgoConfig, max_staleness: int) -> None:
    """Refuse the combinations whose correction would silently do nothing (the table in
    docs/architecture.md, "Off-policy correction")."""
    correction = grpo.loss.rollout_correction
    if grpo.behaviour_logprobs == "rollout" and correction != "off":
        raise ConfigError(
            f"grpo.loss.rollout_correction: {correction} needs grpo.behaviour_logprobs: "
            "recompute. With 'rollout' the ratio is already taken against the rollout's "
            "logprobs, and there are no proximal logprobs to correct against them",
            param="rollout_correction",
        )
    if grpo.behaviour_logprobs == "recompute" and correction == "off" and max_staleness > 0:
        raise ConfigError(
            f"grpo.behaviour_logprobs: recompute with rollout.max_staleness = {max_staleness} "
            "needs grpo.loss.rollout_correction: the ratio is taken against the trainer's own "
            "logprobs before the update, so without a correction tokens sampled by an older "
            "policy are trained as if on-policy. Set grpo.loss.rollout_correction (token_tis: "
            "decoupled PPO; sequence_tis; mask) or use behaviour_logprobs: rollout",
            param="rollout_correction",
        )


@dataclass
class GRPOConfig:
    model_path: str | None = setting(
        None, help="the checkpoint to train; none: the embedded tiny checkpoint"
    )
    reward: str = setting(
        "areno.tasks.color_quiz:reward",
        help="module:callable(trajectory, private, **reward_kwargs) -> float or components",
    )
    reward_kwargs: dict = setting(default_factory=dict, help="keyword arguments of the reward")
    data: DataConfig = setting(default_factory=DataConfig, help="the samples")
    rollout: RolloutConfig = setting(default_factory=RolloutConfig, help="the rollout workers")
    grpo: AlgoConfig = setting(default_factory=AlgoConfig, help="the algorithm")
    optim: OptimConfig = setting(default_factory=OptimConfig, help="the optimizer")
    trainer: TrainerConfig = setting(default_factory=TrainerConfig, help="the trainer workers")
    lora: LoraConfig = setting(default_factory=LoraConfig, help="LoRA training")
    run: RunConfig = setting(default_factory=RunConfig, help="the run")

    def __post_init__(self) -> None:
        total = self.grpo.group_size * self.grpo.prompts_per_step
        if total % self.trainer.num_workers:
            raise ConfigError(
                f"grpo.group_size x grpo.prompts_per_step = {total} episodes per step must "
                f"divide evenly over trainer.num_workers = {self.trainer.num_workers}"
            )
        per_rank = total // self.trainer.num_workers
        if per_rank % self.grpo.mini_batches:
            raise ConfigError(
                f"grpo.mini_batches = {self.grpo.mini_batches} must divide the {per_rank} "
                f"episodes each of trainer.num_workers = {self.trainer.num_workers} ranks trains "
                f"on per step (grpo.group_size x grpo.prompts_per_step / trainer.num_workers)"
            )

        _check_correction(self.grpo, self.rollout.max_staleness)

    @property
    def max_failures(self) -> int:
        """trainer.max_failures, or its default: restarts only where a checkpoint can be
        resumed from (run.save_every > 0)."""
        if self.trainer.max_failures is not None:
            return self.trainer.max_failures
        return DEFAULT_MAX_FAILURES if self.run.save_every > 0 else 0

    @property
    def episodes_per_step(self) -> int:
        return self.grpo.group_size * self.grpo.prompts_per_step

    @classmethod
    def from_dict(cls, raw: dict) -> GRPOConfig:
        return _build(cls, raw, "config")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: dict | None = None) -> GRPOConfig:
        import yaml

        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        return cls.from_dict(merge_overrides(raw, overrides or {}))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def merge_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """Apply dotted overrides ("rollout.max_context_len": 512) to a nested dict (copied)."""
    import copy

    merged = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        node = merged
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
        node[leaf] = value
    return merged


def _build(cls: type, raw: Any, where: str) -> Any:
    """A config section from a mapping: its sections built in turn (a rollout's `engine` by
    RolloutConfig itself, over the rollout's own defaults), unknown and renamed keys refused by
    name (`settings.build`)."""
    if isinstance(raw, dict):
        raw = dict(raw)
        for name, value in raw.items():
            sub = _SECTIONS.get((cls, name))
            if sub is not None:
                raw[name] = _build(sub, value, f"{where}.{name}" if where != "config" else name)
            elif name == "betas" and isinstance(value, list):
                raw[name] = tuple(value)
    return build(cls, raw, where, getattr(cls, "RENAMED", None))


_SECTIONS: dict[tuple[type, str], type] = {
    (GRPOConfig, "data"): DataConfig,
    (GRPOConfig, "rollout"): RolloutConfig,
    (GRPOConfig, "grpo"): AlgoConfig,
    (GRPOConfig, "optim"): OptimConfig,
    (GRPOConfig, "trainer"): TrainerConfig,
    (GRPOConfig, "lora"): LoraConfig,
    (GRPOConfig, "run"): RunConfig,
    (AlgoConfig, "loss"): GRPOLossConfig,
}


def config_reference() -> str:
    """The GRPO config's settings, a Markdown table per section, generated from their
    declarations (`areno train --settings`; docs/configuration.md)."""
    parts: list[str] = []

    def section(instance: Any, where: str) -> None:
        title = f"`{where}`" if where else "top level"
        parts.extend([f"## {title}", reference(type(instance), where, instance)])
        for f in dataclasses.fields(instance):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                section(value, f"{where}.{f.name}" if where else f.name)

    section(GRPOConfig(), "")
    return "\n\n".join(parts) + "\n"
