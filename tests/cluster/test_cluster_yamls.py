"""The `ray up` YAMLs in cluster/ pass Ray's own config check and install the repository's pins.

`ray up` has no dry run; Ray's launcher runs `prepare_config` (defaults, merged setup commands,
per-type worker counts) and then `validate_config` (the schema shipped in the wheel plus its own
checks) before it touches a cloud, so the test runs exactly those two.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private import util as autoscaler_util

ROOT = Path(__file__).parents[2]
YAMLS = sorted((ROOT / "cluster").glob("*.yaml"))
PROVIDERS = {"aws-gpu.yaml": "aws", "gcp-gpu.yaml": "gcp", "onprem.yaml": "local"}
VENV_PIP = "~/areno-venv/bin/python -m pip install"
AUTH_TOKEN = "~/.ray/auth_token"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def prepared(path: Path) -> dict:
    config = autoscaler_util.prepare_config(copy.deepcopy(load(path)))
    autoscaler_util.validate_config(config)
    return config


def pin(name: str, text: str) -> str:
    """`name==version` as pinned in `text` (a requirements file or a shell script)."""
    match = re.search(rf"(?m)(?<![\w-]){re.escape(name)}==([0-9][\w.]*)", text)
    assert match, f"no {name}== pin found"
    return f"{name}=={match.group(1)}"


def test_every_cluster_yaml_is_here():
    assert {p.name for p in YAMLS} == set(PROVIDERS)


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_yaml_passes_rays_own_validation(path):
    config = prepared(path)
    assert config["provider"]["type"] == PROVIDERS[path.name]
    node_types = config["available_node_types"]
    assert config["head_node_type"] in node_types
    for node_type in node_types.values():
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"]


@pytest.mark.parametrize(
    "path", [p for p in YAMLS if p.name != "onprem.yaml"], ids=lambda p: p.name
)
def test_cloud_yaml_declares_gpu_worker_types(path):
    config = prepared(path)
    workers = {
        name: node_type
        for name, node_type in config["available_node_types"].items()
        if name != config["head_node_type"]
    }
    assert workers
    for name, node_type in workers.items():
        assert node_type["resources"].get("GPU", 0) > 0, name
        assert node_type["max_workers"] >= 1, name


def test_onprem_yaml_names_head_and_workers():
    provider = load(ROOT / "cluster" / "onprem.yaml")["provider"]
    assert provider["head_ip"] and provider["worker_ips"]


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_setup_installs_the_repositorys_pins_in_setup_sh_order(path):
    """torch first from its pin, then requirements/ci.txt, then DeepSpeed built against that
    torch, then AReno: a pin bumped in the repository but not here fails this test."""
    requirements = (ROOT / "requirements" / "ci.txt").read_text()
    setup_sh = (ROOT / "scripts" / "setup.sh").read_text()
    torch, torchvision = pin("torch", requirements), pin("torchvision", requirements)
    deepspeed = pin("deepspeed", setup_sh)
    config = prepared(path)
    for commands in (config["head_setup_commands"], config["worker_setup_commands"]):
        steps = [
            f"{VENV_PIP} -q {torch} {torchvision}",
            f"{VENV_PIP} -q -r ~/areno/requirements/ci.txt",
            f"{VENV_PIP} -q --no-build-isolation {deepspeed}",
            f"{VENV_PIP} -q --no-deps -e ~/areno",
        ]
        positions = [commands.index(step) for step in steps]  # ValueError names a missing step
        assert positions == sorted(positions), commands
        installs = [c for c in commands if c.startswith(VENV_PIP)]
        for name in ("torch", "torchvision", "deepspeed"):
            pins = {pin(name, c) for c in installs if re.search(rf"(?<![\w-]){name}==", c)}
            assert pins <= {torch, torchvision, deepspeed}, pins


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_file_mounts_carry_what_setup_reads(path):
    mounts = load(path)["file_mounts"]
    for remote in ("~/areno/areno", "~/areno/requirements", "~/areno/pyproject.toml"):
        assert remote in mounts, remote
    for remote, local in mounts.items():
        if remote != AUTH_TOKEN:
            assert (ROOT / local).exists(), f"{remote}: {local} is not in the repository"
    assert mounts[AUTH_TOKEN] == AUTH_TOKEN


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_ray_starts_with_token_auth_on_every_node(path):
    config = load(path)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = [c for c in config[key] if " start " in f" {c} "]
        assert start and all("RAY_AUTH_MODE=token" in c for c in start), key
    text = path.read_text()
    assert "RAY_AUTH_MODE=disabled" not in text
