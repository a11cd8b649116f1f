"""The server's configuration: what `areno serve` flags and Serve config files set."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from areno.engine.config import EngineConfig
from areno.errors import ConfigError
from areno.resources import check_custom_resources
from areno.settings import setting

QUEUE_FACTOR = 8  # default waiting requests per running slot of a Generator replica
DEPLOYMENTS = ("decoder", "processor", "generator", "ingress")
# How the Ingress picks a Generator replica (areno/serve/routing.py): the longest cached prefix
# balanced against load, in turn, or Serve's own power of two choices.
ROUTING_POLICIES = ("prefix", "round_robin", "power_of_two")
# The ServeConfig fields declared with `setting` (help and default in one place), whose
# `areno serve` flags are generated (areno/settings.py).
SERVE_SETTINGS = ("shutdown_grace_s",)


@dataclass(frozen=True)
class ServeConfig:
    """One AReno app: a model behind MediaDecoder, Processor, Generator and Ingress deployments.

    world_size / tp_size Generator replicas of tp_size ranks each (`--world-size`, `--tp-size`).
    allowed_local_media_paths: roots local media may come from; None is the safe default for
    `host` (any local file on a loopback bind, none otherwise).
    max_queued_requests: requests one Generator replica lets wait for cache slots beyond the
    `engine.max_running_prompts` running sequences (`--max-queued-requests`); one more is
    refused with 429. None: QUEUE_FACTOR x max_running_prompts, deep enough that a burst of a few
    batches waits instead of failing, bounded so that a flood is refused at once.
    deployment_resources: custom Ray resources each replica of a deployment reserves, keyed by
    "decoder" / "processor" / "generator" / "ingress" (`--deployment-resources`), e.g.
    {"decoder": {"media": 1}}: its replicas run only on nodes started with that resource. A
    tensor-parallel Generator reserves them once, in rank 0's bundle (its group shares a node).
    lora_adapters: LoRA adapters served beside the base model, name -> PEFT adapter directory
    (`--lora NAME=PATH`); a request picks one with `model: NAME`, and each Generator replica
    holds them all (its engine's max_loras is raised to their number where it is lower).
    routing: how a request picks one of several Generator replicas (`--routing`, one of
    ROUTING_POLICIES): "prefix" sends it where the longest prefix of its prompt was sent
    before, unless that replica has more than routing_max_imbalance requests in flight beyond
    the least busy one's (None: engine.max_running_prompts, a batch's worth of waiting);
    "round_robin" takes the replicas in turn; "power_of_two" (the default) is Serve's own
    router.
    """

    model_path: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    world_size: int = 1
    max_prompt_tokens: int | None = None
    allowed_local_media_paths: tuple[str, ...] | None = None
    allow_remote_media: bool = False
    allow_private_network_media: bool = False
    num_decoder_replicas: int = 1
    num_processor_replicas: int = 1
    num_cpus_per_deployment: float = 0.25
    max_queued_requests: int | None = None
    deployment_resources: dict[str, dict[str, float]] = field(default_factory=dict)
    lora_adapters: dict[str, str] = field(default_factory=dict)
    routing: str = "power_of_two"
    routing_max_imbalance: int | None = None
    shutdown_grace_s: float = setting(
        30.0,
        help="seconds a stopping server lets the requests in flight finish (streams included) "
        "while it answers new ones 503; then the rest end with an error. `areno serve` drains "
        "on SIGTERM or Ctrl-C; from a Serve config file it is each deployment's "
        "graceful_shutdown_timeout_s",
    )

    def __post_init__(self) -> None:
        self._check_deployment_resources()
        self._check_lora_adapters()
        self._check_routing()
        if self.world_size < self.engine.tp_size or self.world_size % self.engine.tp_size:
            raise ConfigError(
                f"--world-size {self.world_size} must be a multiple of --tp-size "
                f"{self.engine.tp_size} (each Generator replica is one tensor-parallel group)",
                param="world_size",
            )
        grace = self.shutdown_grace_s
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace >= 0:
            raise ConfigError(
                f"--shutdown-grace-s must be a number of seconds >= 0; got {grace!r}",
                param="shutdown_grace_s",
            )
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535; got {self.port}", param="port")
        queued = self.max_queued_requests
        if queued is not None and (
            isinstance(queued, bool) or not isinstance(queued, int) or queued < 0
        ):
            raise ConfigError(
                f"--max-queued-requests must be an integer >= 0; got {queued!r}",
                param="max_queued_requests",
            )

    def _check_deployment_resources(self) -> None:
        value = self.deployment_resources or {}
        if not isinstance(value, dict) or set(value) - set(DEPLOYMENTS):
            raise ConfigError(
                f"--deployment-resources maps deployments ({', '.join(DEPLOYMENTS)}) to "
                f'custom resources, e.g. {{"decoder": {{"media": 1}}}}; got {value!r}',
                param="deployment_resources",
            )
        checked = {
            name: check_custom_resources(resources, f"deployment_resources.{name}")
            for name, resources in value.items()
        }
        object.__setattr__(self, "deployment_resources", checked)

    def _check_lora_adapters(self) -> None:
        adapters = self.lora_adapters or {}
        if not isinstance(adapters, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str | os.PathLike) and str(v)
            for k, v in adapters.items()
        ):
            raise ConfigError(
                f"--lora takes NAME=PATH (a PEFT adapter directory); got {adapters!r}",
                param="lora_adapters",
            )
        if self.model_name in adapters:
            raise ConfigError(
                f"--lora {self.model_name}=...: an adapter cannot take the base model's name",
                param="lora_adapters",
            )
        adapters = {name: str(path) for name, path in adapters.items()}
        object.__setattr__(self, "lora_adapters", adapters)
        if len(adapters) > self.engine.max_loras:
            engine = dataclasses.replace(self.engine, max_loras=len(adapters))
            object.__setattr__(self, "engine", engine)

    def _check_routing(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(
                f"--routing must be one of {', '.join(ROUTING_POLICIES)}; got {self.routing!r}",
                param="routing",
            )
        imbalance = self.routing_max_imbalance
        if imbalance is not None and (
            isinstance(imbalance, bool) or not isinstance(imbalance, int) or imbalance < 0
        ):
            raise ConfigError(
                f"--routing-max-imbalance must be an integer >= 0; got {imbalance!r}",
                param="routing_max_imbalance",
            )

    @property
    def max_imbalance(self) -> int:
        """Requests in flight the prefix router lets its choice have beyond the least busy
        replica's: routing_max_imbalance or its default."""
        if self.routing_max_imbalance is not None:
            return self.routing_max_imbalance
        return self.engine.max_running_prompts

    @property
    def model_names(self) -> list[str]:
        """The names a request may send as `model`: the base model's, then each adapter's."""
        return [self.model_name, *self.lora_adapters]

    def resources_for(self, deployment: str) -> dict[str, float]:
        """The custom resources each replica of `deployment` reserves (often none)."""
        return dict(self.deployment_resources.get(deployment) or {})

    @property
    def model_name(self) -> str:
        """The name clients send as `model` and `/v1/models` lists."""
        return self.served_model_name or os.path.basename(os.path.normpath(self.model_path))

    @property
    def queue_limit(self) -> int:
        """Requests one Generator replica lets wait: max_queued_requests or its default."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return QUEUE_FACTOR * self.engine.max_running_prompts

    @property
    def num_generator_replicas(self) -> int:
        return self.world_size // self.engine.tp_size
