"""Settings declared once: a config dataclass's field carries its help text (`setting`), and
both the command line's flags (`add_flags`, `given_flags`) and the configuration reference
(`reference`) are generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from areno.errors import ConfigError


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 -- argparse's name for it
    default_factory: Any = dataclasses.MISSING,
    choices: tuple | None = None,
    flag: bool = True,
) -> Any:
    """A dataclass field with what a user reads about it. `choices`: the values it takes (also
    the flag's); `flag`: whether a command line that generates flags from the class offers it."""
    metadata = {"help": help, "choices": choices, "flag": flag}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Described:
    """One field of a config class, as the flags and the reference show it."""

    name: str
    kind: Any  # the annotation, resolved
    default: Any
    help: str
    choices: tuple | None
    flag: bool

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.kind)

    @property
    def base(self) -> Any:
        """The type without its `| None`."""
        args = [a for a in typing.get_args(self.kind) if a is not type(None)]
        union = typing.get_origin(self.kind) in (typing.Union, types.UnionType)
        if union and len(args) == 1:
            return args[0]
        return self.kind

    @property
    def type_name(self) -> str:
        base = getattr(self.base, "__name__", str(self.base))
        return f"{base} or none" if self.optional else base


def describe(cls: type) -> list[Described]:
    """The fields of dataclass `cls`, in order, with their declared help (empty where a field
    was declared without `setting`)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        meta = f.metadata
        out.append(
            Described(
                f.name,
                hints[f.name],
                default,
                meta.get("help", ""),
                meta.get("choices"),
                meta.get("flag", True),
            )
        )
    return out


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    defaults: Any = None,
    only: tuple[str, ...] | None = None,
) -> None:
    """A flag per field of `cls` that offers one (`--max-num-batched-tokens` for
    `max_num_batched_tokens`), with its help and choices; `only`: just those fields. A flag left
    out keeps the value of `defaults` (an instance; None: the class's defaults): see
    `given_flags`."""
    for d in describe(cls):
        if not d.flag or (only is not None and d.name not in only):
            continue
        default = getattr(defaults, d.name) if defaults is not None else d.default
        shown = "none" if default is None else default
        text = f"{d.help} (default: {shown})" if d.help else f"(default: {shown})"
        text = text.replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": d.name, "default": None, "help": text}
        if d.base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = d.base if d.base in (int, float, str) else str
            kwargs["metavar"] = d.base.__name__.upper() if d.choices is None else None
            if d.choices is not None:
                kwargs["choices"] = d.choices
        parser.add_argument(flag_name(d.name), **kwargs)


def given_flags(
    cls: type, args: argparse.Namespace, *, only: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The fields of `cls` (`only` those, where given) whose flags were given (`add_flags`),
    by name."""
    return {
        d.name: getattr(args, d.name)
        for d in describe(cls)
        if d.flag and (only is None or d.name in only) and getattr(args, d.name, None) is not None
    }


def build(
    cls: type,
    raw: Any,
    where: str,
    renamed: dict[str, str] | None = None,
    base: Any = None,
) -> Any:
    """`cls(**raw)` for a mapping read from YAML or JSON (over instance `base`'s values where
    given), refusing an unknown key by name, and a renamed one (`renamed`: old name -> new)
    with the name to use instead."""
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping; got {type(raw).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    for old, new in (renamed or {}).items():
        if old in raw:
            raise ConfigError(f"{where}.{old} is now {where}.{new}", param=old)
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(sorted(names))}"
        )
    _check_switches(cls, raw, where)
    try:
        return dataclasses.replace(base, **raw) if base is not None else cls(**raw)
    except TypeError as error:
        raise ConfigError(f"{where}: {error}") from None


def _check_switches(cls: type, raw: dict, where: str) -> None:
    """A bool setting takes true or false only: a string such as "false" would read as true."""
    for d in describe(cls):
        value = raw.get(d.name)
        if d.base is bool and d.name in raw and not isinstance(value, bool):
            if value is None and d.optional:
                continue
            raise ConfigError(
                f"{where}.{d.name} must be true or false; got {value!r}", param=d.name
            )


def reference(cls: type, prefix: str, defaults: Any = None) -> str:
    """A Markdown table of the fields of `cls` (`prefix`.name, type, default, what it does);
    the defaults of instance `defaults` where given (a section's own, as a GRPO config's
    `rollout.engine`), else the class's."""
    rows = ["| setting | type | default | what it does |", "| --- | --- | --- | --- |"]
    for d in describe(cls):
        if dataclasses.is_dataclass(d.base):
            continue  # a section of its own
        value = getattr(defaults, d.name) if defaults is not None else d.default
        default = "none" if value is None else value
        text = d.help
        if d.choices is not None:
            text += f" One of: {', '.join(str(c) for c in d.choices)}."
        name = f"{prefix}.{d.name}" if prefix else d.name
        rows.append(f"| `{name}` | {d.type_name} | `{default}` | {text.strip()} |")
    return "\n".join(rows)
