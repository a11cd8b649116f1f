#!/usr/bin/env bash
# Pack what an offline x86-64 GPU machine needs to run AReno's GPU paths when it already has
# Python, torch, triton and the common scientific stack but no package index. Versions are this
# checkout's .venv's.
#
#   bash scripts/offline_bundle.sh OUT_DIR          # everything (benchmarks/gpu_e2e.py: Ray, Serve,
#                                                   # DeepSpeed): OUT_DIR/site.tar.xz (~59 MiB) and
#                                                   # the DeepSpeed sdist (it builds there)
#   bash scripts/offline_bundle.sh OUT_DIR engine   # the engine alone (`pytest -m gpu`, engine
#                                                   # benchmarks): OUT_DIR/site.tar.xz (~36 MiB)
#   bash scripts/offline_bundle.sh OUT_DIR train    # `areno train` and benchmarks/grpo_step.py
#                                                   # (~56 MiB with the DeepSpeed sdist): no
#                                                   # openai (agent programs), xgrammar (structured
#                                                   # outputs) or pytest; "all" no longer fits the
#                                                   # 64 MiB carry beside the working tree
#
# `all` and `engine` carry xgrammar (structured outputs, forced tool calls), peft (LoRA) and
# pytest. The device tool carries at most 64 MiB with the working tree, counted in disk blocks:
# the engine and train bundles leave room for it.
#
# Then on the GPU machine, from the repository root:
#   mkdir -p site && tar -xJf OUT_DIR/site.tar.xz -C site
#   python3 -m pip install --no-index --no-deps --no-build-isolation --target site OUT_DIR/deepspeed-*.tar.gz
#   export PYTHONPATH=$PWD/site:$PWD
#   python3 scripts/check_bundle.py     # every areno module imports with the bundle alone
#                                       # (with `train`: all but those that import openai)
#
# TARGET_PYTHON (default 3.12) is the GPU machine's Python; TARGET_GRPCIO (default 1.84.0) its
# grpcio version, which grpcio-reflection must not exceed. Ray's wheel is cut to fit one transfer:
# without its Java jars, the dashboard's built web client and RLlib, its binaries stripped.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:?usage: offline_bundle.sh OUT_DIR [all|engine]}")"
part="${2:-all}"
case "$part" in all | engine | train) ;; *) echo "offline_bundle: part must be all, engine or train" >&2; exit 2 ;; esac
py="${TARGET_PYTHON:-3.12}"
grpcio="${TARGET_GRPCIO:-1.84.0}"
pip=(.venv/bin/python -m pip)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

engine=(
    transformers tokenizers pydantic pydantic-core annotated-types typing-inspection
    jsonschema jsonschema-specifications referencing rpds-py hjson av soundfile cffi pycparser
    xgrammar apache-tvm-ffi peft pytest pluggy iniconfig
)
serving=(
    ray fastapi starlette uvicorn openai jiter sniffio tensorboardX colorful
    opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-exporter-prometheus
    opentelemetry-semantic-conventions google-api-core google-auth
    googleapis-common-protos proto-plus pyasn1 httpcore2 httpx2 truststore watchfiles
)
packages=("${engine[@]}")
if [ "$part" != engine ]; then
    packages+=("${serving[@]}")
fi
if [ "$part" = train ]; then
    # what training on one machine never imports
    drop=" xgrammar apache-tvm-ffi pytest pluggy iniconfig openai jiter "
    kept=()
    for name in "${packages[@]}"; do
        [[ "$drop" == *" $name "* ]] || kept+=("$name")
    done
    packages=("${kept[@]}")
fi
pins=()
for name in "${packages[@]}"; do
    version="$("${pip[@]}" show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)"
    if [ -z "$version" ]; then
        echo "offline_bundle: $name is not in .venv (bash scripts/setup.sh first?)" >&2
        exit 1
    fi
    pins+=("$name==$version")
done
if [ "$part" != engine ]; then
    # Not in a Python 3.11 .venv (the standard library has it) but imported by opentelemetry there.
    pins+=("grpcio-reflection==$grpcio" "importlib-metadata==10.2.0")
fi

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
    platforms+=(--platform "$p")
done
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp "${platforms[@]}" -d "$work/wheels" "${pins[@]}"
"${pip[@]}" install -q --no-deps --no-compile --target "$work/site" --python-version "$py" \
    --implementation cp --only-binary=:all: "${platforms[@]}" "$work"/wheels/*.whl

if [ "$part" = train ]; then
    rm -rf "$work/site/ray/llm" "$work/site/ray/workflow"
fi
if [ "$part" != engine ]; then
    rm -rf "$work/site/ray/jars" "$work/site/ray/dashboard/client/build" "$work/site/ray/rllib"
    strip --strip-unneeded "$work/site/ray/_raylet.so" "$work/site/ray/core/src/ray/gcs/gcs_server" \
        "$work/site/ray/core/src/ray/raylet/raylet"
fi
# transformers' model code is most of its wheel: keep the families' (and the benchmarks' shapes')
# subpackages and every one they import, drop the rest (~40 MB before compression). Every other
# model keeps its package's small files (`__init__`, configuration, tokenization): the auto
# classes import each model named in their tables while looking a class up (Gemma 4's tokenizer
# reaches diffusion_gemma's). peft imports Bloom's model classes.
python3 - "$work/site/transformers/models" <<'PY'
import os, re, shutil, sys
os.chdir(sys.argv[1])
names = {d for d in os.listdir(".") if os.path.isdir(d) and d != "__pycache__"}
seeds = r"(qwen|gemma|minicpm|llama|mistral|siglip|whisper|bloom$|auto$|gpt2$|clip$|bert$|t5$)"
keep = {d for d in names if re.match(seeds, d)}
todo = list(keep)
while todo:
    d = todo.pop()
    for f in (os.path.join(d, n) for n in os.listdir(d) if n.endswith(".py")):
        text = open(f, encoding="utf-8").read()
        imported = re.findall(r"from \.\.(\w+)", text) + re.findall(r"transformers\.models\.(\w+)", text)
        for m in set(imported) & (names - keep):
            keep.add(m)
            todo.append(m)
small = re.compile(r"(__init__|configuration_\w+|tokenization_\w+)\.py$")
for d in names - keep:
    for entry in os.listdir(d):
        path = os.path.join(d, entry)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif not small.match(entry):
            os.remove(path)
PY
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +

mkdir -p "$out"
tar -C "$work/site" -cf - . | xz -T0 -9 > "$out/site.tar.xz"
if [ "$part" != engine ]; then
    "${pip[@]}" download -q --no-deps --no-binary=:all: -d "$out" \
        "deepspeed==$("${pip[@]}" show deepspeed | sed -n 's/^Version: //p')"
fi
ls -la "$out"
