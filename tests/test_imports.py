"""`import_callable`: the one way configs name loaders, rewards and agents ("module:callable"),
and the errors that name what is wrong with a spec."""

from __future__ import annotations

import pytest

from areno.errors import ConfigError
from areno.imports import import_callable
from areno.rollout.agent import load_agent


def test_a_callable_and_a_dotted_attribute_path() -> None:
    assert import_callable("areno.imports:import_callable", "reward") is import_callable
    method = import_callable("areno.errors:ConfigError.__init__", "reward")
    assert method is ConfigError.__init__


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "malformed reward spec 'nocolon'; expected \"package.module:callable\""),
        ("no_such_pkg_71a:score", "reward 'no_such_pkg_71a:score': no module named"),
        ("areno.imports:import_calable", "did you mean 'import_callable'"),
        ("areno.imports:annotations", "reward 'areno.imports:annotations' is a _Feature, not a"),
        (3, "reward spec must be a string, got int"),
    ],
)
def test_each_mistake_is_named(spec, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        import_callable(spec, "reward")


def test_agents_are_named_the_same_way() -> None:
    with pytest.raises(ConfigError, match="agent 'areno.rollout.agent:Agnt'.*did you mean 'Agent'"):
        load_agent("areno.rollout.agent:Agnt")
    with pytest.raises(ConfigError, match="returned ConfigError, not an areno Agent"):
        load_agent("areno.errors:ConfigError", message="x")
