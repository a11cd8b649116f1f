"""Callables a config names by import path: "package.module:callable", where a dotted attribute
path may follow the colon ("module:Class.load"). Loaders, rewards and agents are named this
way; each error is a ConfigError that names the kind and the spec."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from areno.errors import ConfigError


def import_callable(spec: Any, what: str, usage: str = "") -> Callable[..., Any]:
    """The callable `spec` names; `what` ("loader", "reward", "agent") words the errors and
    `usage` is appended to a malformed spec's.

    Raises:
        ConfigError: the spec is malformed, its module is missing (or fails to import), the
            attribute does not exist, or it is not callable.
    """
    usage = usage or 'expected "package.module:callable"'
    module_name, attr_path = _split(spec, what, usage)
    target: Any = _import(module_name, spec, what)
    for i, attr in enumerate(attr_path):
        if not hasattr(target, attr):
            owner = ".".join([module_name, *attr_path[:i]])
            raise ConfigError(
                f"{what} {spec!r}: {owner!r} has no attribute {attr!r}{_hint(target, attr)}"
            )
        target = getattr(target, attr)
    if not callable(target):
        raise ConfigError(f"{what} {spec!r} is a {type(target).__name__}, not a callable")
    return target


def _split(spec: Any, what: str, usage: str) -> tuple[str, list[str]]:
    if not isinstance(spec, str):
        raise ConfigError(f"{what} spec must be a string, got {type(spec).__name__}; {usage}")
    module_name, sep, attr = spec.strip().partition(":")
    attr_path = attr.split(".")
    if not sep or not module_name or ":" in attr or not all(p.isidentifier() for p in attr_path):
        raise ConfigError(f"malformed {what} spec {spec!r}; {usage}")
    if not all(p.isidentifier() for p in module_name.split(".")):
        raise ConfigError(f"malformed {what} spec {spec!r}: bad module name; {usage}")
    return module_name, attr_path


def _import(module_name: str, spec: str, what: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Tell "the module named in the spec is missing" from "it imports something missing".
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(
                f"{what} {spec!r}: no module named {module_name!r} (is it on PYTHONPATH, with "
                "__init__.py in each package?)"
            ) from None
        raise ConfigError(f"{what} {spec!r}: importing {module_name!r} failed: {e}") from e
    except Exception as e:
        raise ConfigError(
            f"{what} {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from e


def _hint(target: Any, attr: str) -> str:
    names = [n for n in dir(target) if not n.startswith("_")]
    close = difflib.get_close_matches(attr, names, n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""
