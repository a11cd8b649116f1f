"""GRPOConfig: YAML sections, dotted overrides, and clear errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from areno.cli import _train_config, build_parser
from areno.errors import ConfigError
from areno.train.config import GRPOConfig, merge_overrides

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_config_loads_and_flags_override_it() -> None:
    args = build_parser().parse_args(
        [
            "train", "--config", str(REPO / "configs" / "color_quiz.yaml"),
            "--max-steps", "7", "--max-context-len", "512", "--num-trainer-workers", "2",
            "--set", "grpo.loss.kl_coef=0.05", "--set", "rollout.agent_kwargs={max_turns: 3}",
            "--set", "optim.lr=1e-2", "--set", "lora.rank=8",
        ]
    )  # fmt: skip
    config = _train_config(args)
    assert config.run.max_steps == 7 and config.rollout.engine.max_context_len == 512
    assert config.optim.lr == 0.01  # a number, though YAML 1.1 reads 1e-2 as a string
    assert config.lora.rank == 8 and config.lora.enabled
    assert config.trainer.num_workers == 2 and config.grpo.loss.kl_coef == 0.05
    assert config.rollout.agent_kwargs == {"max_turns": 3}
    assert config.grpo.group_size == 8 and config.data.shuffle is False  # from the file
    assert GRPOConfig.from_dict(config.to_dict()) == config  # what the trainer workers rebuild


def test_unknown_keys_and_bad_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout: unknown key\(s\) \['max_contxt_len'\]"):
        GRPOConfig.from_dict({"rollout": {"max_contxt_len": 10}})
    with pytest.raises(ConfigError, match="grpo.group_size must be an integer >= 1"):
        GRPOConfig.from_dict({"grpo": {"group_size": 0}})
    with pytest.raises(ConfigError, match="loss_agg must be one of"):
        GRPOConfig.from_dict({"grpo": {"loss": {"loss_agg": "mean"}}})
    with pytest.raises(ConfigError, match="divide evenly over trainer.num_workers = 3"):
        GRPOConfig.from_dict({"trainer": {"num_workers": 3}})
    with pytest.raises(ConfigError, match="does not exist"):
        GRPOConfig.from_yaml("/nonexistent/grpo.yaml")
    with pytest.raises(ConfigError, match="rollout.max_restarts must be an integer >= 0"):
        GRPOConfig.from_dict({"rollout": {"max_restarts": -1}})
    with pytest.raises(ConfigError, match="trainer.max_failures must be an integer >= 0"):
        GRPOConfig.from_dict({"trainer": {"max_failures": 1.5}})
    with pytest.raises(ConfigError, match="run.eval_samples_per_prompt must be an integer >= 1"):
        GRPOConfig.from_dict({"run": {"eval_samples_per_prompt": 0}})
    with pytest.raises(ConfigError, match="lora.rank must be an integer >= 0"):
        GRPOConfig.from_dict({"lora": {"rank": -1}})
    with pytest.raises(ConfigError, match="lora.target_modules must be a non-empty list"):
        GRPOConfig.from_dict({"lora": {"rank": 4, "target_modules": "q_proj"}})


def test_overrides_do_not_touch_the_original() -> None:
    raw = {"run": {"max_steps": 3}}
    merged = merge_overrides(raw, {"run.max_steps": 5, "optim.lr": 0.1})
    assert raw == {"run": {"max_steps": 3}}
    assert merged == {"run": {"max_steps": 5}, "optim": {"lr": 0.1}}


def test_custom_resources_place_workers_and_are_checked() -> None:
    args = build_parser().parse_args(
        [
            "train", "--set", "rollout.resources_per_worker={rollout: 1}",
            "--set", "trainer.resources_per_worker={trainer: 0.5}",
        ]
    )  # fmt: skip
    config = _train_config(args)
    assert config.rollout.resources_per_worker == {"rollout": 1}
    assert config.trainer.resources_per_worker == {"trainer": 0.5}
    assert GRPOConfig.from_dict(config.to_dict()) == config
    assert GRPOConfig().rollout.resources_per_worker == {}
    with pytest.raises(ConfigError, match="GPU is not a custom resource"):
        GRPOConfig.from_dict({"trainer": {"resources_per_worker": {"GPU": 1}}})
    with pytest.raises(ConfigError, match=r"rollout.resources_per_worker.rollout must be a number"):
        GRPOConfig.from_dict({"rollout": {"resources_per_worker": {"rollout": -1}}})
    with pytest.raises(ConfigError, match="must map resource names to amounts"):
        GRPOConfig.from_dict({"rollout": {"resources_per_worker": ["rollout"]}})


def test_a_model_path_that_is_no_checkpoint_fails_before_ray_starts(tmp_path, capsys) -> None:
    """`areno train --model-path` naming no checkpoint is an `areno: error` at once, naming the
    path, with no run directory made and no Ray started."""
    import ray

    from areno.cli import main

    run_dir = tmp_path / "run"
    argv = ["train", "--model-path", str(tmp_path / "nothing"), "--run-dir", str(run_dir)]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("areno: error: ") and str(tmp_path / "nothing") in error
    assert "not a Hugging Face checkpoint directory" in error
    assert not run_dir.exists() and not ray.is_initialized()


def test_recipe_settings_that_would_do_nothing_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="partial_rollouts needs rollout.max_staleness >= 1"):
        GRPOConfig.from_dict({"rollout": {"partial_rollouts": True}})
    with pytest.raises(ConfigError, match="rollout.partial_rollouts must be") as info:
        GRPOConfig.from_dict({"rollout": {"partial_rollouts": "yes", "max_staleness": 1}})
    assert info.value.param == "partial_rollouts"
    partial = GRPOConfig.from_dict({"rollout": {"partial_rollouts": True, "max_staleness": 1}})
    assert partial.rollout.partial_rollouts and not GRPOConfig().rollout.partial_rollouts
    with pytest.raises(ConfigError, match="max_extra_prompts bounds grpo.dynamic_sampling") as info:
        GRPOConfig.from_dict({"grpo": {"max_extra_prompts": 4}})
    assert info.value.param == "max_extra_prompts"
    with pytest.raises(ConfigError, match="group_size = 1 every group would be dropped"):
        GRPOConfig.from_dict({"grpo": {"dynamic_sampling": True, "group_size": 1}})
    config = GRPOConfig.from_dict({"grpo": {"dynamic_sampling": True, "prompts_per_step": 4}})
    assert config.grpo.extra_prompts_bound == 12  # 3 x prompts_per_step where not set
    assert GRPOConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="run.loggers must be a list of distinct loggers"):
        GRPOConfig.from_dict({"run": {"loggers": ["tensorboard", "comet"]}})
    with pytest.raises(ConfigError, match="run.loggers must be a list"):
        GRPOConfig.from_dict({"run": {"loggers": "wandb"}})
    assert GRPOConfig().run.loggers == ["tensorboard"]


def test_trainer_restarts_by_default_only_where_a_checkpoint_is_saved():
    from areno.train.config import DEFAULT_MAX_FAILURES

    assert GRPOConfig.from_dict({}).max_failures == 0
    saving = GRPOConfig.from_dict({"run": {"save_every": 5}})
    assert saving.trainer.max_failures is None and saving.max_failures == DEFAULT_MAX_FAILURES
    chosen = GRPOConfig.from_dict({"run": {"save_every": 5}, "trainer": {"max_failures": 1}})
    assert chosen.max_failures == 1
    assert GRPOConfig.from_dict(saving.to_dict()) == saving
