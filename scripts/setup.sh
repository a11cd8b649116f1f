#!/usr/bin/env bash
# Create .venv and install AReno with its pinned dependencies. Idempotent: a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.areno-installed
want="$(cat requirements/ci.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch first, from its pins, so nothing later can pull a different build.
    .venv/bin/python -m pip install -q "$(grep '^torch==' requirements/ci.txt)" \
        "$(grep '^torchvision==' requirements/ci.txt)"
    .venv/bin/python -m pip install -q -r requirements/ci.txt
    # DeepSpeed ships as an sdist whose setup imports torch: build it against the pinned one.
    .venv/bin/python -m pip install -q --no-build-isolation deepspeed==0.19.8
    .venv/bin/python -m pip install -q --no-deps -e .
    echo "$want" > "$stamp"
fi
