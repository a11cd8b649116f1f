"""The Serve config files in deployments/ pass Ray Serve's schema and build AReno's app."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve import schema as serve_schema

from areno.serve.app import app_builder
from areno.serve.config import ServeConfig

CONFIGS = sorted((Path(__file__).parents[2] / "deployments").glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"multimodal.yaml", "gemma4-audio-video.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_builds(path, tiny_path):
    config = serve_schema.ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    for app in config.applications:
        assert app.import_path == "areno.serve.app:app_builder"
        args = dict(app.args) | {"model_path": str(tiny_path("gemma4"))}
        # The tiny stand-in has a 4096-token position limit; real checkpoints have more.
        engine = dict(args.get("engine", {}))
        engine["max_context_len"] = min(engine.get("max_context_len") or 4096, 4096)
        built = app_builder(
            args | {"engine": engine}
        )  # binds the deployments; models load only when Serve starts them
        options = built._bound_deployment._deployment_config  # the Ingress's
        assert options.graceful_shutdown_timeout_s == args["shutdown_grace_s"]


def test_a_context_longer_than_the_model_fails_before_deploying(tiny_path):
    from areno.errors import ConfigError

    with pytest.raises(ConfigError, match="max_position_embeddings"):
        app_builder({"model_path": str(tiny_path("gemma4")), "engine": {"max_context_len": 10**6}})


def test_generator_reserves_a_gpu_only_where_one_is_wanted():
    from areno.serve.app import _wants_gpu

    assert _wants_gpu("cuda") and not _wants_gpu("cpu")
    # "auto" follows the cluster: no Ray here, so no GPU to reserve.
    assert not _wants_gpu("auto")


def test_serve_build_writes_a_config_that_validates(tmp_path):
    """`serve build` (Ray's CLI) on the app's import path writes a deployable config file."""
    import os
    import subprocess
    import sys

    out = tmp_path / "serve.yaml"
    env = dict(os.environ, ARENO_CACHE_DIR=str(tmp_path / "cache"), RAY_AUTH_MODE="disabled")
    serve_cli = Path(sys.executable).with_name("serve")
    result = subprocess.run(
        [str(serve_cli), "build", "areno.serve.default_app:app", "-o", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = serve_schema.ServeDeploySchema.model_validate(yaml.safe_load(out.read_text()))
    (app,) = config.applications
    assert app.import_path == "areno.serve.default_app:app"
    names = {d.name for d in app.deployments}
    assert names == {"MediaDecoderServer", "ProcessorServer", "GeneratorServer", "Ingress"}


def test_deployment_resources_reach_each_deployments_actor_options():
    from areno.engine.config import EngineConfig
    from areno.errors import ConfigError
    from areno.serve.app import _cpu_actor_options, _generator_resources

    config = ServeConfig(
        model_path="m",
        engine=EngineConfig(tp_size=2, device="cpu", num_cpus_per_rank=0.5),
        world_size=2,
        deployment_resources={"decoder": {"media": 1}, "generator": {"gen": 2}},
    )
    assert _cpu_actor_options(config, "decoder") == {"num_cpus": 0.25, "resources": {"media": 1}}
    assert _cpu_actor_options(config, "ingress") == {"num_cpus": 0.25}
    generator = _generator_resources(config)
    assert generator["ray_actor_options"]["resources"] == {"gen": 2}
    # the replica (rank 0) asks for it once, in its own bundle; the group shares its node
    assert generator["placement_group_bundles"] == [{"CPU": 0.5, "gen": 2}, {"CPU": 0.5}]
    with pytest.raises(ConfigError, match="maps deployments"):
        ServeConfig(model_path="m", deployment_resources={"decoders": {"media": 1}})
    with pytest.raises(ConfigError, match="CPU is not a custom resource"):
        ServeConfig(model_path="m", deployment_resources={"ingress": {"CPU": 1}})


def test_a_serve_config_file_places_deployments_by_resource(tiny_path):
    args = {"model_path": str(tiny_path("gemma4")), "engine": {"max_context_len": 1024}}
    args["deployment_resources"] = {"decoder": {"media": 1}, "generator": {"gen": 1}}
    app = app_builder(args)
    options = {d.name: d.ray_actor_options for d in _deployments(app)}
    assert options["MediaDecoderServer"]["resources"] == {"media": 1}
    assert options["GeneratorServer"]["resources"] == {"gen": 1}
    assert "resources" not in options["Ingress"]


def test_every_deployment_checks_against_the_engines_context_length(tiny_path):
    """Without --max-context-len the engine runs with the model's context length (capped); every
    deployment gets that number, so the Ingress and the Processor refuse a prompt plus max_tokens
    over it (a 400 naming max_tokens) and /v1/models reports it."""
    from transformers import AutoConfig

    from areno.engine.config import DEFAULT_MAX_CONTEXT_LEN
    from areno.errors import PromptTooLongError
    from areno.processing.encode import PromptLimits

    path = str(tiny_path("gemma4"))
    text_config = AutoConfig.from_pretrained(path).get_text_config()
    expected = min(text_config.max_position_embeddings, DEFAULT_MAX_CONTEXT_LEN)
    app = app_builder({"model_path": path})
    configs = {
        d.name: next(a for a in d.init_args if isinstance(a, ServeConfig))
        for d in _deployments(app)
    }
    assert {name: c.engine.max_context_len for name, c in configs.items()} == dict.fromkeys(
        ("Ingress", "MediaDecoderServer", "ProcessorServer", "GeneratorServer"), expected
    )
    limits = PromptLimits(None, configs["Ingress"].engine.max_context_len)
    limits.check(20, expected - 20)
    with pytest.raises(PromptTooLongError, match=f"lower max_tokens to at most {expected - 20}"):
        limits.check(20, 10**7)


def _deployments(app) -> list:
    """The deployments of an Application: its own and those bound into its arguments."""
    from ray.serve.deployment import Application

    deployment = app._bound_deployment
    bound = [arg for arg in deployment.init_args if isinstance(arg, Application)]
    return [deployment, *(d for arg in bound for d in _deployments(arg))]


def test_lora_flags_and_adapters_are_checked_before_deploying(tiny_path, tmp_path):
    """`--lora NAME=PATH` (repeatable) reaches the config, raises the engine's adapter slots to
    their number, and a directory that is no adapter, or a rank over --max-lora-rank, fails
    before any replica starts."""
    import json

    from areno.cli import _pairs, build_parser
    from areno.errors import ArenoError, ConfigError
    from areno.serve.app import check_adapter

    args = build_parser().parse_args(["serve", "--lora", "a=/x", "--lora", "b=/y"])
    adapters = _pairs("--lora", args.lora)
    assert adapters == {"a": "/x", "b": "/y"}
    with pytest.raises(ArenoError, match="--lora takes NAME=PATH; got 'a'"):
        _pairs("--lora", ["a"])
    config = ServeConfig(model_path=str(tiny_path("gemma4")), lora_adapters=adapters)
    assert config.engine.max_loras == 2 and config.model_names[1:] == ["a", "b"]
    with pytest.raises(ConfigError, match="cannot take the base model's name"):
        ServeConfig(model_path="/m/base", lora_adapters={"base": "/x"})
    with pytest.raises(ConfigError, match="adapter_config.json is missing"):
        check_adapter("a", str(tmp_path), 16)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 32, "lora_alpha": 64}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="rank 32; raise --max-lora-rank"):
        check_adapter("a", str(tmp_path), 16)


def test_areno_serve_fails_on_a_wrong_model_path_before_ray_starts(tmp_path, capsys):
    import ray

    from areno.cli import main

    assert main(["serve", "--model-path", str(tmp_path / "nothing")]) == 2
    error = capsys.readouterr().err
    assert "areno: error: " in error and "not a Hugging Face checkpoint directory" in error
    assert not ray.is_initialized()
