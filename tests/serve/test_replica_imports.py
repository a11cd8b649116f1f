"""The replicas that never run the engine do not import it: the Ingress, the MediaDecoder and the
Processor deployments load their modules without the Generator and its runner (torch's
compiler and the model code, seconds of every replica's start on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys

ENGINE_MODULES = ("areno.engine.generator", "areno.engine.runner", "torch._dynamo")


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
