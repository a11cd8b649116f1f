"""The KubeRay manifests in cluster/kuberay/: no Kubernetes runs here, so the test checks them
against KubeRay's documented `ray.io/v1` API (the kinds' required fields, their types, resource
names), validates the RayService's embedded Serve config with Serve's own schema, and runs what
they embed: the serveConfigV2 with `serve run` on a local Ray (a tiny checkpoint, one request
through the `openai` client) and the RayJob's entrypoint for one step on a local Ray head. Only
the site settings change for that: the image's and the volume's paths, the device, the custom
resources the node groups declare, the bind address."""

from __future__ import annotations

import copy
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import ray
import yaml
from ray.serve import schema as serve_schema

from areno.cli import _train_config, build_parser
from areno.serve.app import app_builder
from areno.train.metrics import read_metrics
from tests.ray_head import VENV_BIN, free_port, ray_head  # noqa: F401 (a fixture)

ROOT = Path(__file__).parents[2]
KUBERAY = ROOT / "cluster" / "kuberay"
IMAGE_REPO = "/home/ray/areno"  # where the Dockerfile puts the repository in the image
VOLUME = "/mnt/areno"  # where every pod mounts the shared volume
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def manifest(name: str) -> dict:
    return yaml.safe_load((KUBERAY / name).read_text())


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig" if doc["kind"] == "RayService" else "rayClusterSpec"]


def pod_specs(spec: dict) -> list[tuple[str, dict]]:
    groups = [("head", spec["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    return [(name, group["template"]["spec"]) for name, group in groups]


@pytest.mark.parametrize(
    ("name", "kind"), [("rayservice.yaml", "RayService"), ("rayjob.yaml", "RayJob")]
)
def test_manifest_follows_kuberays_api(name, kind):
    doc = manifest(name)
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", kind)
    assert DNS_LABEL.match(doc["metadata"]["name"])
    if kind == "RayService":
        assert isinstance(doc["spec"]["serveConfigV2"], str)  # a string holding YAML
    else:
        assert isinstance(doc["spec"]["entrypoint"], str)
        assert doc["spec"]["shutdownAfterJobFinishes"] is True
        yaml.safe_load(doc["spec"]["runtimeEnvYAML"])
    spec = cluster_spec(doc)
    assert spec["rayVersion"] == ray.__version__  # the image's Ray, as the Dockerfile pins it
    assert spec["authOptions"] == {"mode": "token"}
    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    names = [g["groupName"] for g in spec["workerGroupSpecs"]]
    assert len(set(names)) == len(names) and {"gpu", "cpu"} <= set(names)
    for group in spec["workerGroupSpecs"]:
        assert DNS_LABEL.match(group["groupName"])
        counts = [group[k] for k in ("minReplicas", "replicas", "maxReplicas")]
        assert all(isinstance(c, int) for c in counts) and counts == sorted(counts), group
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        assert all(isinstance(v, str) for v in group.get("resources", {}).values())
    for group, pod in pod_specs(spec):
        for container in pod["containers"]:
            assert DNS_LABEL.match(container["name"]) and container["image"], group
            for quantities in container["resources"].values():
                assert all(isinstance(v, str) for v in quantities.values()), group
        gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for c in pod["containers"]]
        assert any(gpus) == (group == "gpu"), group


@pytest.mark.parametrize("name", ["rayservice.yaml", "rayjob.yaml"])
def test_every_pod_runs_the_image_and_mounts_the_shared_volume(name):
    claim = manifest("storage.yaml")
    assert claim["kind"] == "PersistentVolumeClaim"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    images = set()
    for group, pod in pod_specs(cluster_spec(manifest(name))):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            images.add(container["image"])
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == VOLUME]
            source = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
            assert source == claim["metadata"]["name"], group
    assert len(images) == 1, images


def test_the_image_installs_the_repositorys_pins():
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    requirements = (ROOT / "requirements" / "ci.txt").read_text()
    setup_sh = (ROOT / "scripts" / "setup.sh").read_text()
    base = re.search(r"(?m)^FROM rayproject/ray:(\S+)-py(\d)(\d+)", dockerfile)
    assert base and base.group(1) == ray.__version__
    assert f"ray[serve,train]=={ray.__version__}" in requirements
    for name, text in (("torch", requirements), ("torchvision", requirements)):
        assert re.search(rf"{name}==[\d.]+", text).group() in dockerfile, name
    assert re.search(r"deepspeed==[\d.]+", setup_sh).group() in dockerfile
    order = ["torch==", "-r requirements/ci.txt", "--no-build-isolation deepspeed", "--no-deps -e"]
    positions = [dockerfile.index(step) for step in order]
    assert positions == sorted(positions)
    for copied in re.findall(r"(?m)^COPY \S+ (.+) \S+$", dockerfile):
        for path in copied.split():
            assert (ROOT / path).exists(), path


def _serve_config() -> dict:
    return yaml.safe_load(manifest("rayservice.yaml")["spec"]["serveConfigV2"])


def test_the_serve_config_validates_and_builds_the_same_app_as_deployments(tiny_path):
    config = serve_schema.ServeDeploySchema.model_validate(_serve_config())
    (app,) = config.applications
    shipped = yaml.safe_load((ROOT / "deployments" / "multimodal.yaml").read_text())
    assert app.import_path == shipped["applications"][0]["import_path"]
    assert app.args["model_path"].startswith(VOLUME + "/")
    app_builder(dict(app.args) | {"model_path": str(tiny_path("qwen3_5"))})  # binds, loads nothing


def _local_serve_config(checkpoint: Path, port: int) -> dict:
    """The RayService's Serve config on this machine: the tiny checkpoint, loopback, CPU, and
    none of the node groups' custom resources."""
    config = copy.deepcopy(_serve_config())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    (app,) = config["applications"]
    app["runtime_env"] = {}  # ARENO_CACHE_DIR on the volume
    args = app["args"]
    args.update(model_path=str(checkpoint), host="127.0.0.1", allowed_local_media_paths=None)
    args["engine"]["device"] = "cpu"
    args.pop("deployment_resources")
    return config


def test_the_serve_config_serves_with_serve_run(ray_head, tiny_path, tmp_path):  # noqa: F811
    """`serve run` of the RayService's Serve config, on the module's Ray head (RAY_ADDRESS: the
    drain command's `address='auto'` then reaches this cluster, not another on the machine)."""
    port = free_port()
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(_local_serve_config(tiny_path("qwen3_5"), port)))
    env = ray_head.env
    process = subprocess.Popen(
        [str(VENV_BIN / "serve"), "run", str(path)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, "".join(lines)[-4000:]
            assert time.monotonic() < deadline, "serve run was not healthy within 600 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="areno", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
        # docs/operations.md's drain of an app Serve owns, as written there
        drained = subprocess.run(
            [sys.executable, "-c", _drain_command()], env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert drained.returncode == 0, drained.stderr[-3000:]
        assert "DrainReport(num_in_flight=0, num_cut_off=0" in drained.stdout
        with pytest.raises(urllib.error.HTTPError) as draining:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        assert draining.value.code == 503
    finally:
        os.killpg(process.pid, signal.SIGINT)  # `serve run` stops the app on Ctrl-C
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _drain_command() -> str:
    """The Python code of docs/operations.md's command that drains an app Serve owns."""
    page = (ROOT / "docs" / "operations.md").read_text()
    (code,) = re.findall(r'(?m)^python -c "(.*drain_requests.*)"$', page)
    return code


def _job_argv() -> list[str]:
    return shlex.split(manifest("rayjob.yaml")["spec"]["entrypoint"])


def test_the_job_entrypoint_is_an_areno_train_command_line():
    argv = _job_argv()
    assert argv[:2] == ["areno", "train"]
    config_path = argv[argv.index("--config") + 1]
    assert config_path.startswith(IMAGE_REPO + "/")
    in_repo = [arg.replace(IMAGE_REPO, str(ROOT)) for arg in argv]  # the image's copy
    config = _train_config(build_parser().parse_args(in_repo[1:]))
    assert config.run.save_every > 0 and config.max_failures > 0  # restarts from checkpoints
    assert config.run.run_dir.startswith(VOLUME + "/") and config.model_path.startswith(VOLUME)
    assert config.trainer.use_gpu and config.trainer.resources_per_worker == {"gpu_group": 1}
    assert config.rollout.resources_per_worker == {"cpu_group": 1}
    groups = {g["groupName"]: g for g in cluster_spec(manifest("rayjob.yaml"))["workerGroupSpecs"]}
    assert "gpu_group" in groups["gpu"]["resources"] and "cpu_group" in groups["cpu"]["resources"]


def test_the_job_entrypoint_trains_one_step(ray_head, tiny_path, tmp_path):  # noqa: F811
    """The entrypoint as the job runs it, on the test's Ray head: the image's repository is this
    checkout, the volume's checkpoint the tiny one, CPU only, and one short step."""
    run_dir = tmp_path / "run"
    argv = [
        arg.replace(IMAGE_REPO, str(ROOT))
        .replace(f"{VOLUME}/models/checkpoint", str(tiny_path("qwen3_5")))
        .replace(f"{VOLUME}/runs/color-quiz", str(run_dir))
        for arg in _job_argv()
    ]
    site = ("trainer.use_gpu", "rollout.resources_per_worker", "trainer.resources_per_worker")
    values = {i for i, arg in enumerate(argv) if argv[i - 1] == "--set" and arg.startswith(site)}
    argv = [arg for i, arg in enumerate(argv) if i not in values and i + 1 not in values]
    argv += ["--max-steps", "1", "--group-size", "2", "--prompts-per-step", "2", "--eval-every", "0",
             "--set", "run.export_hf=false"]  # fmt: skip
    env = dict(ray_head.env, ARENO_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run(
        [str(VENV_BIN / argv[0]), *argv[1:]], env=env, capture_output=True, text=True,
        timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["step"] for r in read_metrics(run_dir) if "sample_ids" in r] == [1]
