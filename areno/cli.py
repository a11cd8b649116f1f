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
    from areno.demo import run_processor_demo

    run_processor_demo(args.model_path, family=args.family)


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
        "demo", help="decode an image, an audio clip and a video and print the processor round trip"
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
