"""The replicas that never run the engine do not import it: the Ingress, the MediaDecoder and the
Processor deployments load their modules without the Generator and its runner (torch's
compiler and the model code, seconds of every replica's start on 2 cores); the driver of
`areno serve` starts Ray before importing torch at all."""

from __future__ import annotations

import json
import subprocess
import sys

ENGINE_MODULES = ("areno.engine.generator", "areno.engine.runner.model_runner", "torch._dynamo")


def test_the_serving_modules_load_without_the_engine() -> None:
    script = (
        "import json, sys\n"
        "import areno.serve.ingress, areno.serve.workers\n"
        f"print(json.dumps([m for m in {ENGINE_MODULES!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_serve_driver_reaches_ray_without_torch() -> None:
    """`areno serve --model-path M` builds its parser and config and starts Ray before anything
    needs torch or transformers (their import, 2.3 s on 2 cores, used to come first)."""
    script = (
        "import json, sys\n"
        "from areno.cli import build_parser\n"
        "build_parser().parse_args(['serve', '--model-path', 'M'])\n"
        "import areno.engine.config, areno.serve.app, areno.serve.config\n"
        "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
