"""Build the Serve application and run it (`areno serve`, `serve run deployments/*.yaml`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from areno.engine.config import EngineConfig
from areno.errors import ConfigError
from areno.serve.config import ServeConfig

APP_NAME = "areno"
# Seconds between Serve's health checks of each replica. A replica that died is noticed at its
# next check and only then replaced: Serve's default of 10 s added up to 10 s to every recovery
# (tests/serve/live/test_faults.py measures it); a check is one cheap RPC.
HEALTH_CHECK_PERIOD_S = 2.0
# How often a stopping replica looks whether its requests in flight have finished (Serve's
# graceful_shutdown_wait_loop_s; its default of 2 s kept an idle replica up 2 s more).
SHUTDOWN_WAIT_LOOP_S = 0.5


def check_config(config: ServeConfig) -> int:
    """Fail now, with the flag to change, on what would otherwise fail inside a replica (which
    Serve keeps restarting): an unsupported family, a context length over the model's, a TP size
    the family cannot take. Returns the context length the engine will run with."""
    from transformers import AutoConfig

    from areno.engine.config import resolve_max_context_len
    from areno.engine.parallel.tensor_parallel import tp_plan_for
    from areno.models.registry import adapter_for_checkpoint

    adapter = adapter_for_checkpoint(config.model_path)
    model_config = AutoConfig.from_pretrained(config.model_path)
    max_context_len = resolve_max_context_len(config.engine, model_config)
    tp_plan_for(adapter, config.engine.tp_size)
    for name, path in config.lora_adapters.items():
        check_adapter(name, path, config.engine.max_lora_rank)
    return max_context_len


def check_adapter(name: str, path: str, max_rank: int) -> None:
    """A `--lora NAME=PATH` the engine can load: a PEFT LoRA directory within --max-lora-rank."""
    import json
    from pathlib import Path

    from areno.engine.layers.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraError, adapter_scaling

    directory = Path(path)
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / file).is_file():
            raise ConfigError(
                f"--lora {name}={path}: not a PEFT adapter directory ({file} is missing)",
                param="lora_adapters",
            )
    adapter_config = json.loads((directory / ADAPTER_CONFIG).read_text())
    try:
        adapter_scaling(adapter_config, f"--lora {name}={path}")
    except LoraError as error:
        raise ConfigError(error.message, param="lora_adapters") from None
    if int(adapter_config["r"]) > max_rank:
        raise ConfigError(
            f"--lora {name}={path} has rank {adapter_config['r']}; raise --max-lora-rank "
            f"(now {max_rank}) to serve it",
            param="lora_adapters",
        )


def build_app(config: ServeConfig):
    """The Ingress bound to its MediaDecoder, Processor and Generator deployments."""
    from areno.serve.ingress import Ingress
    from areno.serve.workers import GeneratorServer, MediaDecoderServer, ProcessorServer

    # Every deployment gets the context length the engine resolves from the model when
    # --max-context-len is not given: the Ingress and the Processor refuse a prompt plus
    # max_tokens over it (400 naming max_tokens) instead of the engine cutting the reply
    # short, and /v1/models reports it.
    max_context_len = check_config(config)
    engine = dataclasses.replace(config.engine, max_context_len=max_context_len)
    config = dataclasses.replace(config, engine=engine)
    lifecycle = _lifecycle_options(config)
    decoder = MediaDecoderServer.options(
        num_replicas=config.num_decoder_replicas,
        ray_actor_options=_cpu_actor_options(config, "decoder"),
        **lifecycle,
    ).bind(config)
    processor = ProcessorServer.options(
        num_replicas=config.num_processor_replicas,
        ray_actor_options=_cpu_actor_options(config, "processor"),
        **lifecycle,
    ).bind(config)
    generator = GeneratorServer.options(
        num_replicas=config.num_generator_replicas,
        max_ongoing_requests=_generator_max_ongoing(config),
        **lifecycle,
        **_generator_resources(config),
        **_generator_routing(config),
    ).bind(config)
    return Ingress.options(
        ray_actor_options=_cpu_actor_options(config, "ingress"),
        **lifecycle,
    ).bind(decoder, processor, generator, config)


def _lifecycle_options(config: ServeConfig) -> dict[str, float]:
    """Every deployment's health checks and graceful shutdown. Where Serve stops replicas itself
    (an app updated by `serve deploy` or deleted, a RayService upgrade), each one lets its
    requests in flight finish for up to --shutdown-grace-s (docs/operations.md); a config
    file's `deployments:` entry may still set these otherwise."""
    return {
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "graceful_shutdown_timeout_s": config.shutdown_grace_s,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S,
    }


def _cpu_actor_options(config: ServeConfig, deployment: str) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": config.num_cpus_per_deployment}
    custom = config.resources_for(deployment)
    if custom:
        options["resources"] = custom
    return options


def _generator_max_ongoing(config: ServeConfig) -> int:
    """Serve's per-replica cap on the Generator's calls in flight. NOTE: it must stay well above
    running + queued requests, so that a request over --max-queued-requests reaches the replica
    and is refused with 429 there, instead of waiting unbounded in Serve's router."""
    held = config.engine.max_running_prompts + config.queue_limit
    return max(4096, 4 * held)


def _generator_resources(config: ServeConfig) -> dict[str, Any]:
    engine = config.engine
    per_rank = {"CPU": engine.num_cpus_per_rank}
    if _wants_gpu(engine.device):
        per_rank["GPU"] = 1
    custom = config.resources_for("generator")
    actor = {"num_cpus": per_rank["CPU"], "num_gpus": per_rank.get("GPU", 0)}
    if custom:
        actor["resources"] = custom
    options: dict[str, Any] = {"ray_actor_options": actor}
    if engine.tp_size > 1:
        # Rank 0 (the replica) takes bundle 0, which must hold everything the replica asks
        # for; its follower actors take the others, on the same node (STRICT_PACK).
        rank0 = {**per_rank, **custom}
        options["placement_group_bundles"] = [rank0] + [per_rank] * (engine.tp_size - 1)
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def _generator_routing(config: ServeConfig) -> dict[str, Any]:
    """The Generator's request router (`--routing`); Serve's own for "power_of_two"."""
    from areno.serve.routing import request_router_config

    router = request_router_config(config.routing, config.engine.block_size, config.max_imbalance)
    return {} if router is None else {"request_router_config": router}


def _wants_gpu(device: str) -> bool:
    """Whether Generator ranks must reserve a GPU. NOTE: "auto" must decide here, not in the
    replica: Ray hides GPUs from an actor that reserved none, so the replica would fall back to
    CPU on a GPU cluster."""
    if device != "auto":
        return device == "cuda"
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def app_builder(args: dict[str, Any]):
    """`serve run` entry point: `import_path: areno.serve.app:app_builder` with `args` holding
    ServeConfig fields (engine fields under `engine`; no model_path: the tiny default)."""
    args = dict(args)
    engine = EngineConfig.from_dict(args.pop("engine", {}))
    if not args.get("model_path"):
        from areno.models.tiny import DEFAULT_FAMILY, tiny_checkpoint

        args["model_path"] = str(tiny_checkpoint(DEFAULT_FAMILY))
    if "allowed_local_media_paths" in args and args["allowed_local_media_paths"] is not None:
        args["allowed_local_media_paths"] = tuple(args["allowed_local_media_paths"])
    return build_app(ServeConfig(engine=engine, **args))


def banner(config: ServeConfig) -> list[str]:
    """What `areno serve` prints once the app is up: the URL, the model and its modalities, the
    KV pool a Generator replica built (asked from it: on CUDA the pool gets what memory the
    replica found free) and its start-up phases."""
    from areno.models.registry import adapter_for_checkpoint

    adapter = adapter_for_checkpoint(config.model_path)
    modalities = ", ".join(["text", *sorted(adapter.modalities)])
    lines = [
        f"serving {config.model_name} on http://{config.host}:{config.port}/v1",
        f"  model: {config.model_path} ({adapter.display_name}: {modalities})",
    ]
    lines += [f"  LoRA adapter: {name} ({path})" for name, path in config.lora_adapters.items()]
    return [*lines, *_engine_lines(config)]


def _engine_lines(config: ServeConfig) -> list[str]:
    """The KV pool and the start-up phases of one Generator replica, asked from it."""
    from ray import serve
    from ray.exceptions import RayError

    block_size = config.engine.block_size
    replicas = config.num_generator_replicas
    where = "per Generator replica" + (f" (of {replicas})" if replicas > 1 else "")
    handle = serve.get_deployment_handle("GeneratorServer", app_name=APP_NAME)
    try:
        num_blocks = handle.stats.remote().result(timeout_s=30)["num_blocks"]
        start_up = handle.start_up.remote().result(timeout_s=30)
    except (RayError, TimeoutError):
        return [f"  KV pool: blocks of {block_size} tokens {where} (the replica's log has more)"]
    pool = f"{num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens {where}"
    return [f"  KV pool: {pool}", f"  engine start-up: {start_up}"]


def _announce(line: str) -> None:
    print(f"areno: {line}", flush=True)


def run_server(
    config: ServeConfig, *, block: bool = True, announce: Callable[[str], None] = _announce
) -> None:
    """Start (or join, via RAY_ADDRESS) Ray, deploy the app on config.host:config.port, announce
    its banner, and serve until SIGTERM or SIGINT (to the process or its group: Ctrl-C). Then
    drain (areno/serve/drain.py): new requests get 503, those in flight finish within
    config.shutdown_grace_s or end with an error; then Serve and Ray stop."""
    import ray
    from ray import serve

    from areno.serve.drain import StopSignals, drain_app, stopped_line

    check_config(config)  # a wrong flag fails now, before Ray and Serve start
    signals = StopSignals(announce) if block else None  # else the caller's handlers stay
    try:
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        if signals is not None:
            signals.install()  # after ray.init, which sets a SIGTERM handler of its own
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    except KeyboardInterrupt:
        if signals is None:
            raise
        signals.started()  # no more interrupts: the next signals only cut the stop short
        announce("interrupted while starting; stopping")
        _stop(serve, ray)
        signals.restore()
        return
    if signals is not None:
        signals.started()
    for line in banner(config):
        announce(line)
    if signals is None:
        return
    name = signals.wait()
    grace_s = config.shutdown_grace_s
    announce(
        f"{name}: draining: new requests get 503; those in flight have {grace_s:g} s to "
        "finish (signal again to cut them off now)"
    )
    report = drain_app(APP_NAME, grace_s, signals)
    _stop(serve, ray)
    signals.restore()
    announce(stopped_line(name, grace_s, report))


def _stop(serve, ray) -> None:
    """Serve's controller, proxies and replicas, then Ray (the local instance `ray.init`
    started; only the connection to a cluster joined through RAY_ADDRESS)."""
    serve.shutdown()
    ray.shutdown()
