"""Settings declared once: `areno serve`'s engine flags and the GRPO config reference are
generated from the config dataclasses, and an old name in a config names the new one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from areno.cli import build_parser
from areno.engine.config import EngineConfig
from areno.errors import ConfigError
from areno.settings import flag_name, given_flags
from areno.train.config import GRPOConfig, config_reference

REPO = Path(__file__).resolve().parents[1]


def test_every_engine_setting_is_a_serve_flag_with_its_declared_help() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for field in dataclasses.fields(EngineConfig):
        assert flag_name(field.name) in help_text, field.name
        assert field.metadata["help"].split()[0] in help_text


def test_serve_flags_reach_the_engine_config_and_the_rest_keep_its_defaults() -> None:
    args = build_parser().parse_args(
        ["serve", "--max-num-batched-tokens", "512", "--no-enable-prefix-caching",
         "--linear-state-dtype", "bfloat16", "--tp-size", "2"]
    )  # fmt: skip
    engine = EngineConfig(**given_flags(EngineConfig, args))
    assert engine == EngineConfig(
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        linear_state_dtype="bfloat16",
        tp_size=2,
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--overlap-steps", "sometimes"])


def test_the_grpo_rollout_engine_is_the_engine_declaration_over_its_own_defaults() -> None:
    config = GRPOConfig.from_dict({"rollout": {"engine": {"block_size": 32}}})
    assert config.rollout.engine == EngineConfig(
        max_running_prompts=16, max_context_len=1024, block_size=32
    )
    assert GRPOConfig.from_dict(config.to_dict()) == config


def test_old_and_borrowed_names_are_refused_with_the_name_to_use() -> None:
    with pytest.raises(ConfigError, match="rollout.max_running_prompts is now "
                       "rollout.engine.max_running_prompts"):  # fmt: skip
        GRPOConfig.from_dict({"rollout": {"max_running_prompts": 4}})
    with pytest.raises(ConfigError, match="engine.max_prefill_tokens_per_step is now "
                       "engine.max_num_batched_tokens"):  # fmt: skip
        EngineConfig.from_dict({"max_prefill_tokens_per_step": 512})
    with pytest.raises(ConfigError, match="rollout.engine.max_loras is set from lora.rank"):
        GRPOConfig.from_dict({"rollout": {"engine": {"max_loras": 2}}})
    with pytest.raises(ConfigError, match="rollout.engine.stream_interval_ms does nothing here"):
        GRPOConfig.from_dict({"rollout": {"engine": {"stream_interval_ms": 20}}})
    with pytest.raises(ConfigError, match="run.trackers is now run.loggers"):
        GRPOConfig.from_dict({"run": {"trackers": ["tensorboard"]}})


def test_the_configuration_reference_is_generated_from_the_declarations() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page.endswith(config_reference()), "regenerate: areno train --settings"
    for line in ("`rollout.engine.max_num_batched_tokens` | int | `8192`",
                 "`rollout.max_staleness` | int | `0`", "`grpo.loss.rollout_correction` | str | `off`"):  # fmt: skip
        assert line in page


def test_a_switch_takes_true_or_false_only() -> None:
    """A string such as "false" in a YAML or JSON config would read as true: refused, named."""
    for raw, name in (({"grpo": {"dynamic_sampling": "false"}}, "grpo.dynamic_sampling"),
                      ({"rollout": {"engine": {"enable_prefix_caching": 0}}},
                       "rollout.engine.enable_prefix_caching")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"{name} must be true or false") as refused:
            GRPOConfig.from_dict(raw)
        assert refused.value.param == name.rsplit(".", 1)[1]
    with pytest.raises(ConfigError, match="engine.enable_prefix_caching must be true or false"):
        EngineConfig.from_dict({"enable_prefix_caching": "yes"})
    assert GRPOConfig.from_dict({"grpo": {"dynamic_sampling": True}}).grpo.dynamic_sampling
