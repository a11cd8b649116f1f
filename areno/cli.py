"""`areno` command line: parse flags, build configs, call into the layers."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from areno.errors import ArenoError


def _num_params(checkpoint: Path) -> int:
    """Parameters stored in a checkpoint's safetensors files (tied weights are stored once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            names = f.keys()  # noqa: SIM118 -- safe_open is not iterable
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    return total


def _make_tiny(args: argparse.Namespace) -> None:
    from areno.models.tiny import TINY_FAMILIES, build_tiny

    families = TINY_FAMILIES if args.family == "all" else (args.family,)
    for family in families:
        out = args.out_dir if len(families) == 1 else f"{args.out_dir}/{family}"
        path = build_tiny(family, out, seed=args.seed, size=args.size)
        num_params = _num_params(path)
        print(f"{family} ({args.size}, {num_params / 1e6:.2f} M parameters): {path}")


def _demo(args: argparse.Namespace) -> None:
    from areno.demo import run_demo

    run_demo(args.model_path, family=args.family, verbose=args.verbose)


def _default_checkpoint() -> str:
    """The embedded tiny checkpoint (built on first use). Imported only without --model-path:
    it loads torch and transformers, which the serving driver otherwise never needs (2.3 s on
    2 CPU cores before Ray could start)."""
    from areno.models.tiny import DEFAULT_FAMILY, tiny_checkpoint

    return str(tiny_checkpoint(DEFAULT_FAMILY))


def _serve(args: argparse.Namespace) -> None:
    from areno.engine.config import EngineConfig
    from areno.serve.app import run_server
    from areno.serve.config import SERVE_SETTINGS, ServeConfig
    from areno.settings import given_flags

    model_path = args.model_path or _default_checkpoint()
    engine = EngineConfig(**given_flags(EngineConfig, args))
    config = ServeConfig(
        model_path=model_path,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        engine=engine,
        world_size=args.world_size or engine.tp_size,
        max_prompt_tokens=args.max_prompt_tokens,
        allowed_local_media_paths=tuple(args.allowed_local_media_path)
        if args.allowed_local_media_path
        else None,
        allow_remote_media=args.allow_remote_media,
        allow_private_network_media=args.allow_private_network_media,
        max_queued_requests=args.max_queued_requests,
        deployment_resources=_json_flag("--deployment-resources", args.deployment_resources),
        lora_adapters=_pairs("--lora", args.lora),
        routing=args.routing,
        routing_max_imbalance=args.routing_max_imbalance,
        **given_flags(ServeConfig, args, only=SERVE_SETTINGS),
    )
    run_server(config)


def _pairs(flag: str, items: list[str] | None) -> dict[str, str]:
    """NAME=VALUE flags (repeated) as a mapping."""
    pairs = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ArenoError(f"{flag} takes NAME=PATH; got {item!r}")
        pairs[name] = value
    return pairs


def _json_flag(flag: str, text: str | None):
    import json

    if text is None:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ArenoError(f"{flag} takes JSON ({error}); got {text!r}") from None


def _add_serve_parser(sub) -> None:
    from areno.engine.config import EngineConfig
    from areno.serve.config import ROUTING_POLICIES, SERVE_SETTINGS, ServeConfig
    from areno.settings import add_flags

    serve = sub.add_parser("serve", help="serve a checkpoint behind an OpenAI-compatible API")
    serve.add_argument(
        "--model-path", help="checkpoint directory (default: the embedded tiny Gemma 4)"
    )
    serve.add_argument("--served-model-name", help="the model name clients send (default: dir)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route")
    serve.add_argument(
        "--world-size", type=int, help="ranks over all Generator replicas (default: --tp-size)"
    )
    serve.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="power_of_two",
        help="how a request picks one of several Generator replicas: power_of_two (Serve's own "
        "router, the default), prefix (where the longest prefix of its prompt is cached, "
        "balanced against load), or round_robin",
    )
    serve.add_argument(
        "--routing-max-imbalance",
        type=int,
        help="requests in flight the prefix router lets a replica have beyond the least busy "
        "one's before it sends a prompt elsewhere (default: --max-running-prompts)",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        help="requests waiting for a slot per replica before more get 429 "
        "(default: 8 x --max-running-prompts)",
    )
    serve.add_argument("--max-prompt-tokens", type=int, help="limit on the ENCODED prompt")
    serve.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="serve a LoRA adapter (a PEFT adapter directory) beside the base model; requests "
        "pick it with model=NAME (repeatable)",
    )
    serve.add_argument(
        "--allowed-local-media-path",
        action="append",
        help="a root local media may come from (repeatable); default: any on a loopback bind, "
        "none otherwise",
    )
    serve.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) media URLs")
    serve.add_argument(
        "--allow-private-network-media",
        action="store_true",
        help="let remote media URLs reach loopback / private / link-local addresses",
    )
    serve.add_argument(
        "--deployment-resources",
        metavar="JSON",
        help="custom Ray resources per replica of each deployment (decoder, processor, "
        'generator, ingress), e.g. \'{"decoder": {"media": 1}}\': place them on the nodes '
        "started with those resources",
    )
    add_flags(serve, ServeConfig, only=SERVE_SETTINGS)
    engine = serve.add_argument_group(
        "engine", "how each Generator replica runs (areno/engine/config.py::EngineConfig)"
    )
    add_flags(engine, EngineConfig)
    serve.set_defaults(func=_serve)


def _parse_value(text: str):
    """A flag's value as YAML reads it, except that 1e-2 is a number (YAML 1.1 wants 1.0e-2)."""
    import re

    import yaml

    value = yaml.safe_load(text)
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        return float(value)
    return value


# `areno train` flags that override a field of the config file (flag dest -> dotted field).
_TRAIN_FLAGS = {
    "model_path": "model_path",
    "run_dir": "run.run_dir",
    "max_steps": "run.max_steps",
    "seed": "run.seed",
    "save_every": "run.save_every",
    "eval_every": "run.eval_every",
    "max_running_prompts": "rollout.engine.max_running_prompts",
    "max_prompt_tokens": "rollout.max_prompt_tokens",
    "max_context_len": "rollout.engine.max_context_len",
    "tp_size": "rollout.engine.tp_size",
    "num_rollout_workers": "rollout.num_workers",
    "num_trainer_workers": "trainer.num_workers",
    "zero_stage": "trainer.zero_stage",
    "group_size": "grpo.group_size",
    "prompts_per_step": "grpo.prompts_per_step",
    "lr": "optim.lr",
    "enable_prefix_caching": "rollout.engine.enable_prefix_caching",
}


def _train_config(args: argparse.Namespace):
    from areno.train.config import GRPOConfig, merge_overrides

    overrides = {
        field: getattr(args, dest)
        for dest, field in _TRAIN_FLAGS.items()
        if getattr(args, dest) is not None
    }
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ArenoError(f"--set takes key=value (e.g. grpo.loss.kl_coef=0.01); got {item!r}")
        overrides[key] = _parse_value(value)
    if args.resume:
        overrides["run.resume"] = True
    if args.no_progress:
        overrides["run.progress"] = False
    if args.config:
        return GRPOConfig.from_yaml(args.config, overrides)
    return GRPOConfig.from_dict(merge_overrides({}, overrides))


def _train(args: argparse.Namespace) -> None:
    if args.settings:
        from areno.train.config import config_reference

        print(config_reference(), end="")
        return
    from areno.train.run import run

    run_dir = run(_train_config(args))
    print(f"areno train: done; metrics, checkpoints and the exported model are in {run_dir}")


def _sft(args: argparse.Namespace) -> None:
    from areno.models.tiny import DEFAULT_FAMILY, tiny_checkpoint
    from areno.train.lora import LoraConfig
    from areno.train.sft import SFTConfig, sft

    kwargs = {k: _parse_value(v) for k, v in (i.split("=", 1) for i in args.loader_arg or [])}
    config = SFTConfig(
        model_path=args.model_path or str(tiny_checkpoint(DEFAULT_FAMILY)),
        out_dir=args.out,
        loader=args.loader,
        loader_kwargs=kwargs,
        target_key=args.target_key,
        agent=args.agent,
        agent_kwargs={
            k: _parse_value(v) for k, v in (i.split("=", 1) for i in args.agent_arg or [])
        },
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        lora=LoraConfig(
            rank=args.lora_rank, alpha=args.lora_alpha, target_modules=args.lora_target_modules
        ),
    )
    print(f"areno sft: wrote {sft(config)}")


def _plot(args: argparse.Namespace) -> None:
    from areno.train.plot import DEFAULT_KEYS, plot_run

    keys = args.keys or DEFAULT_KEYS
    print(f"areno plot: wrote {plot_run(args.run_dir, args.out, keys)}")


def _add_train_parsers(sub) -> None:
    train = sub.add_parser("train", help="agentic GRPO on Ray Train + DeepSpeed")
    train.add_argument("--config", help="a GRPO YAML config (flags override it)")
    train.add_argument("--model-path", help="checkpoint (default: the embedded tiny model)")
    train.add_argument("--run-dir", help="where metrics, checkpoints and hf/ go")
    train.add_argument("--resume", action="store_true", help="continue from the run's checkpoint")
    for flag, kind in (
        ("--max-steps", int),
        ("--seed", int),
        ("--save-every", int),
        ("--eval-every", int),
        ("--max-running-prompts", int),
        ("--max-prompt-tokens", int),
        ("--max-context-len", int),
        ("--tp-size", int),
        ("--num-rollout-workers", int),
        ("--num-trainer-workers", int),
        ("--zero-stage", int),
        ("--group-size", int),
        ("--prompts-per-step", int),
        ("--lr", float),
    ):
        train.add_argument(flag, type=kind)
    train.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="the rollout engines reuse earlier prompts' blocks and states (default: on)",
    )
    train.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="any config field, e.g. grpo.loss.kl_coef=0.01",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--settings",
        action="store_true",
        help="print every setting of a GRPO config (docs/configuration.md) and exit",
    )
    train.set_defaults(func=_train)

    sft = sub.add_parser("sft", help="a short supervised warm-start on the same data path")
    sft.add_argument("--model-path", help="checkpoint (default: the embedded tiny model)")
    sft.add_argument("--out", required=True, help="checkpoint directory to write")
    sft.add_argument("--loader", default="areno.tasks.color_quiz:load", help="module:callable")
    sft.add_argument("--loader-arg", action="append", metavar="KEY=VALUE", help="loader kwarg")
    sft.add_argument(
        "--target-key",
        default="answer",
        help='the private field to learn: text, or a reply {"tool_calls": [{"name", "arguments"}]}',
    )
    sft.add_argument("--agent", help="module:callable of the agent whose prompt and tools to use")
    sft.add_argument("--agent-arg", action="append", metavar="KEY=VALUE", help="agent kwarg")
    sft.add_argument("--steps", type=int, default=50)
    sft.add_argument("--batch-size", type=int, default=8)
    sft.add_argument("--lr", type=float, default=1e-3)
    sft.add_argument("--seed", type=int, default=0)
    sft.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank (0: every weight)",
    )
    sft.add_argument("--lora-alpha", type=float, default=16.0)
    sft.add_argument(
        "--lora-target-modules",
        nargs="+",
        metavar="NAME",
        help="linear layers to adapt, by last name (default: every one of the language model)",
    )
    sft.set_defaults(func=_sft)

    plot = sub.add_parser("plot", help="PNG curves of a training run's metrics")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="PNG path (default: RUN_DIR/curves.png)")
    plot.add_argument(
        "--keys",
        nargs="+",
        help="metrics.jsonl keys, one panel each (default: rewards, lengths, "
        "logprob mismatch, clip fraction, kl, step time)",
    )
    plot.set_defaults(func=_plot)


def build_parser() -> argparse.ArgumentParser:
    from areno.models.tiny import DEFAULT_FAMILY, TINY_FAMILIES, TINY_SIZES

    parser = argparse.ArgumentParser(prog="areno", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="build a tiny random checkpoint of a family, offline")
    tiny.add_argument(
        "out_dir", help="directory to write (with --family all: one subdir per family)"
    )
    tiny.add_argument("--family", default=DEFAULT_FAMILY, choices=[*TINY_FAMILIES, "all"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--size",
        default="tiny",
        choices=TINY_SIZES,
        help="text model size: tiny (~0.3 M parameters), small (~30 M, for CPU benchmarks) or "
        "2b (Qwen3.5-2B / Gemma 4 E2B-like text stacks in bf16, for GPU runs)",
    )
    tiny.set_defaults(func=_make_tiny)

    demo = sub.add_parser(
        "demo",
        help="serve the embedded tiny model and query it with the openai client "
        "(image, audio, video, tools, streaming)",
    )
    demo.add_argument(
        "--model-path", default=None, help="checkpoint directory (default: the embedded tiny model)"
    )
    demo.add_argument(
        "--family",
        default=DEFAULT_FAMILY,
        choices=TINY_FAMILIES,
        help="tiny family to use when --model-path is not given",
    )
    demo.add_argument(
        "--verbose",
        action="store_true",
        help="show Ray's, Serve's and the libraries' logs on the terminal (default: in a log "
        "file the demo names)",
    )
    demo.set_defaults(func=_demo)
    _add_serve_parser(sub)
    _add_train_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ArenoError as e:
        print(f"areno: error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
