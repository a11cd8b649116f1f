"""GRPOConfig: one typed config per part, composed; read from YAML, overridden by flags.

A YAML file mirrors the sections below (`data:`, `rollout:`, `grpo:`, `optim:`, `trainer:`,
`lora:`, `run:`) plus the top-level `model_path` and `reward`. Unknown keys are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areno.errors import ConfigError
from areno.resources import check_custom_resources
from areno.train.grpo import GRPOLossConfig
from areno.train.lora import LoraConfig


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

    loader: str = "areno.tasks.color_quiz:load"
    loader_kwargs: dict = field(default_factory=dict)
    eval_loader: str | None = None  # None: the training loader with split="validation"
    eval_loader_kwargs: dict = field(default_factory=dict)
    shuffle: bool = True


@dataclass
class RolloutConfig:
    """The rollout workers: serving's decoder / processor / generator, same flags as serving."""

    agent: str | None = None  # "module:callable" returning an areno Agent; None: single turn
    agent_kwargs: dict = field(default_factory=dict)
    num_workers: int = 1  # generator replicas (--world-size / --tp-size in serving)
    tp_size: int = 1
    max_running_prompts: int = 16
    max_prompt_tokens: int | None = None
    max_context_len: int = 1024
    block_size: int = 16  # tokens per KV cache block
    # a group's episodes and an episode's turns reuse the prefill of what they share
    enable_prefix_caching: bool = True
    prefix_state_rows: int | None = None  # None: two per running sequence (EngineConfig)
    kv_cache_gib: float | None = None  # None: as serving sizes its pool (see EngineConfig)
    kv_cache_memory_fraction: float = 0.9
    max_tokens_per_turn: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    dtype: str = "auto"
    device: str = "auto"
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0  # fractional values share a GPU with the trainer
    # custom Ray resources per worker ({"rollout": 1}): only nodes that have them host one;
    # its tensor-parallel followers follow rank 0 onto that node
    resources_per_worker: dict = field(default_factory=dict)
    # times Ray restarts a lost rollout worker (its process crashed, its node went away); the
    # step whose rollout it was running is retried on the current policy, with the same samples
    max_restarts: int = 3
    # rollouts of the next steps run while the trainer trains: a trajectory trained on at step t
    # has no token sampled by a policy older than t - max_staleness (0: rollout, then train)
    max_staleness: int = 0

    def __post_init__(self) -> None:
        for name in ("num_workers", "tp_size", "max_running_prompts", "max_tokens_per_turn"):
            _positive("rollout", name, getattr(self, name))
        _positive("rollout", "max_restarts", self.max_restarts, allow_zero=True)
        _positive("rollout", "max_staleness", self.max_staleness, allow_zero=True)
        self.resources_per_worker = check_custom_resources(
            self.resources_per_worker, "rollout.resources_per_worker"
        )


@dataclass
class AlgoConfig:
    """GRPO: groups of `group_size` episodes per prompt, `prompts_per_step` prompts per step."""

    group_size: int = 8
    prompts_per_step: int = 4
    normalize_std: bool = True
    # "rollout": the ratio is taken against the generator's logprobs (the sampler's);
    # "recompute": against the trainer's own logprobs before the update (the proximal policy),
    # with `loss.tis_cap` weighting each token by proximal / sampler (decoupled PPO). The
    # accepted combinations: docs/architecture.md, "Off-policy correction".
    behaviour_logprobs: str = "rollout"
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    # optimizer steps per rollout batch: the batch split into `mini_batches` parts, each one
    # step, all of it `epochs` times; the ratio is clipped against the behaviour logprobs
    mini_batches: int = 1
    epochs: int = 1

    def __post_init__(self) -> None:
        _positive("grpo", "group_size", self.group_size)
        _positive("grpo", "prompts_per_step", self.prompts_per_step)
        _positive("grpo", "mini_batches", self.mini_batches)
        _positive("grpo", "epochs", self.epochs)
        if self.behaviour_logprobs not in ("rollout", "recompute"):
            raise ConfigError(
                f"grpo.behaviour_logprobs must be 'rollout' or 'recompute'; "
                f"got {self.behaviour_logprobs!r}"
            )
        if isinstance(self.loss, dict):
            self.loss = _build(GRPOLossConfig, self.loss, "grpo.loss")


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0


WEIGHT_SYNC_TRANSPORTS = ("auto", "object_store", "cuda_ipc")


@dataclass
class TrainerConfig:
    """Ray Train workers holding the policy under DeepSpeed."""

    num_workers: int = 1
    zero_stage: int = 2
    dtype: str = "auto"  # float32 on CPU, bfloat16 on GPU
    use_gpu: bool = False
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 1.0
    resources_per_worker: dict = field(default_factory=dict)  # custom Ray resources, as rollout's
    freeze_media_towers: bool = True
    freeze_projectors: bool = True
    # the most tokens one forward / backward takes (rows x the longest row): several trajectories
    # share a pass up to it (areno/train/batching.py); 0: one trajectory per pass
    micro_batch_tokens: int = 4096
    # times Ray Train restarts the worker group after a worker fails (Ray's FailureConfig); each
    # restart resumes from this launch's newest checkpoint (set run.save_every), or from where
    # the launch began when it has saved none yet
    max_failures: int = 0
    # how rank 0 sends the weights to the rollout workers after each step: "object_store" (host
    # copies through Ray's object store, any placement), "cuda_ipc" (device-memory handles; every
    # rollout worker must share rank 0's GPU, ZeRO-0/1/2), or "auto" (cuda_ipc where it can)
    weight_sync: str = "auto"

    def __post_init__(self) -> None:
        _positive("trainer", "num_workers", self.num_workers)
        if self.weight_sync not in WEIGHT_SYNC_TRANSPORTS:
            raise ConfigError(
                f"trainer.weight_sync must be one of {WEIGHT_SYNC_TRANSPORTS}; "
                f"got {self.weight_sync!r}"
            )
        _positive("trainer", "max_failures", self.max_failures, allow_zero=True)
        _positive("trainer", "micro_batch_tokens", self.micro_batch_tokens, allow_zero=True)
        self.resources_per_worker = check_custom_resources(
            self.resources_per_worker, "trainer.resources_per_worker"
        )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"trainer.zero_stage must be 0, 1, 2 or 3; got {self.zero_stage!r}")


@dataclass
class RunConfig:
    run_dir: str = "runs/grpo"
    max_steps: int = 20
    save_every: int = 0  # 0: only at the end
    eval_every: int = 5  # 0: never
    eval_size: int = 16
    eval_temperature: float = 0.0
    # episodes per held-out prompt, averaged (as verl's val n): with eval_temperature > 0 the
    # held-out reward is then that of the sampling policy, not of one draw
    eval_samples_per_prompt: int = 1
    seed: int = 0
    resume: bool = False
    export_hf: bool = True  # hf/ at the end (a LoRA run writes its small adapter/ always)
    progress: bool = True

    def __post_init__(self) -> None:
        _positive("run", "max_steps", self.max_steps)
        _positive("run", "save_every", self.save_every, allow_zero=True)
        _positive("run", "eval_every", self.eval_every, allow_zero=True)
        _positive("run", "eval_samples_per_prompt", self.eval_samples_per_prompt)


def _check_correction(grpo: AlgoConfig, max_staleness: int) -> None:
    """Refuse the combinations whose correction would silently do nothing (the table in
    docs/architecture.md, "Off-policy correction")."""
    tis_cap = grpo.loss.tis_cap
    if grpo.behaviour_logprobs == "rollout" and tis_cap is not None:
        raise ConfigError(
            "grpo.loss.tis_cap needs grpo.behaviour_logprobs: recompute. With 'rollout' the "
            "ratio is already taken against the rollout's logprobs, so the TIS weight "
            "exp(proximal - rollout) is 1 on every token and the cap does nothing",
            param="tis_cap",
        )
    if grpo.behaviour_logprobs == "recompute" and tis_cap is None and max_staleness > 0:
        raise ConfigError(
            f"grpo.behaviour_logprobs: recompute with rollout.max_staleness = {max_staleness} "
            "needs grpo.loss.tis_cap: the ratio is taken against the trainer's own logprobs "
            "before the update, so without the truncated importance weight tokens sampled by "
            "an older policy are trained as if on-policy. Set grpo.loss.tis_cap (e.g. 2.0: "
            "decoupled PPO) or use behaviour_logprobs: rollout",
            param="tis_cap",
        )


@dataclass
class GRPOConfig:
    model_path: str | None = None  # None: the embedded tiny checkpoint
    reward: str = "areno.tasks.color_quiz:reward"
    reward_kwargs: dict = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    run: RunConfig = field(default_factory=RunConfig)

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
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping; got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in raw.items():
        sub = _SECTIONS.get((cls, name))
        if sub is not None:
            value = _build(sub, value, f"{where}.{name}" if where != "config" else name)
        elif name == "betas" and isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ConfigError(f"{where}: {error}") from None


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
