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

    run_demo(args.model_path, family=args.family)


def _serve(args: argparse.Namespace) -> None:
    from areno.engine.config import EngineConfig
    from areno.models.tiny import DEFAULT_FAMILY, tiny_checkpoint
    from areno.serve.app import run_server
    from areno.serve.config import ServeConfig

    model_path = args.model_path or str(tiny_checkpoint(DEFAULT_FAMILY))
    engine = EngineConfig(
        tp_size=args.tp_size,
        max_running_prompts=args.max_running_prompts,
        max_context_len=args.max_context_len,
        dtype=args.dtype,
        device=args.device,
    )
    config = ServeConfig(
        model_path=model_path,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        engine=engine,
        world_size=args.world_size or args.tp_size,
        max_prompt_tokens=args.max_prompt_tokens,
        allowed_local_media_paths=tuple(args.allowed_local_media_path)
        if args.allowed_local_media_path
        else None,
        allow_remote_media=args.allow_remote_media,
        allow_private_network_media=args.allow_private_network_media,
    )
    run_server(config)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve a checkpoint behind an OpenAI-compatible API")
    serve.add_argument(
        "--model-path", help="checkpoint directory (default: the embedded tiny Gemma 4)"
    )
    serve.add_argument("--served-model-name", help="the model name clients send (default: dir)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route")
    serve.add_argument("--tp-size", type=int, default=1, help="GPUs (ranks) per Generator")
    serve.add_argument(
        "--world-size", type=int, help="ranks over all Generator replicas (default: --tp-size)"
    )
    serve.add_argument(
        "--max-running-prompts", type=int, default=8, help="sequences decoding at once per replica"
    )
    serve.add_argument("--max-prompt-tokens", type=int, help="limit on the ENCODED prompt")
    serve.add_argument("--max-context-len", type=int, help="prompt + output tokens per sequence")
    serve.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    serve.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
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
    serve.set_defaults(func=_serve)


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
        help="text model size: tiny (~0.3 M parameters) or small (~30 M, for CPU benchmarks)",
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
    demo.set_defaults(func=_demo)
    _add_serve_parser(sub)
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
