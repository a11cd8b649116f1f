"""Dataset loaders, named by import path, and the built-in JSONL loader.

A loader is any callable that returns (or yields) `Sample`s. A config names it as
"package.module:callable" (a dotted attribute path may follow the colon, "module:Class.load"), or
by the short name of a built-in loader ("jsonl"). Keyword arguments from the config are passed
through, and checked against the loader's signature before it runs.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from areno.data.guard import check_private
from areno.data.sample import Sample, SampleError
from areno.errors import ConfigError
from areno.imports import import_callable

BUILTIN_LOADERS: dict[str, str] = {"jsonl": "areno.data.loader:jsonl"}

Loader = Callable[..., Iterable[Sample]]


def resolve_loader(spec: str) -> Loader:
    """The loader callable that `spec` ("module:callable" or a built-in name) names.

    Raises:
        ConfigError: the spec is malformed, its module is missing (or fails to import), the
            attribute does not exist, or it is not callable.
    """
    spec = BUILTIN_LOADERS.get(spec, spec) if isinstance(spec, str) else spec
    usage = (
        'expected "package.module:callable" (e.g. "areno.data.loader:jsonl") or a built-in '
        f"loader name ({', '.join(sorted(BUILTIN_LOADERS))})"
    )
    return import_callable(spec, "loader", usage)


def load_samples(spec: str, **kwargs: Any) -> Iterator[Sample]:
    """Call the loader `spec` names with `kwargs`, checking that it yields only `Sample`s.

    The spec and the arguments are checked now; items are checked lazily, as they are read.

    Raises:
        ConfigError: a bad spec, or arguments the loader does not take.
        SampleError: the loader returned something that is not an iterable of Samples.
    """
    loader = resolve_loader(spec)
    try:
        inspect.signature(loader).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(
            f"loader {spec!r} does not accept arguments {sorted(kwargs)}: {e}"
        ) from None
    except ValueError:
        pass  # no introspectable signature (some builtins); the call itself will tell
    items = loader(**kwargs)
    if not isinstance(items, Iterable) or isinstance(items, (str, bytes, dict)):
        raise SampleError(
            f"loader {spec!r} returned a {type(items).__name__}; it must return or yield Samples"
        )
    return _checked(spec, items)


def _checked(spec: str, items: Iterable[Any]) -> Iterator[Sample]:
    for index, item in enumerate(items):
        if not isinstance(item, Sample):
            hint = " (wrap it with Sample.from_dict)" if isinstance(item, dict) else ""
            raise SampleError(
                f"loader {spec!r} yielded a {type(item).__name__} at index {index}, "
                f"not a Sample{hint}"
            )
        check_private(item)
        yield item


def jsonl(path: str, split: str | None = None) -> Iterator[Sample]:
    """Read samples from a JSONL file, one `Sample.to_json` object a line.

    With `split`, `path` is either a directory holding "<split>.jsonl" or a path template holding
    "{split}". Blank lines are skipped. A sample without an id gets "<file name>:<line number>".

    Raises:
        ConfigError: the file is missing, or `split` does not fit `path`.
        SampleError: a line is malformed; the message names the file and the line number.
    """
    file = _split_file(Path(path), split) if split is not None else Path(path)
    if not file.is_file():
        raise ConfigError(f"JSONL dataset {str(file)!r} does not exist or is not a file")
    return _read_jsonl(file)


def _read_jsonl(file: Path) -> Iterator[Sample]:
    with file.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if isinstance(data, dict) and data.get("id") is None:
                    data["id"] = f"{file.name}:{lineno}"
                yield Sample.from_dict(data)
            except json.JSONDecodeError as e:
                raise SampleError(
                    f"{file}:{lineno}: not valid JSON: {e.msg} at column {e.colno}"
                ) from None
            except SampleError as e:
                raise SampleError(f"{file}:{lineno}: {e.message}", param=e.param) from None


def _split_file(path: Path, split: str) -> Path:
    if "{split}" in str(path):
        return Path(str(path).replace("{split}", split))
    if path.is_dir():
        return path / f"{split}.jsonl"
    raise ConfigError(
        f"split {split!r} given, but JSONL path {str(path)!r} is neither a directory (holding "
        f"'{split}.jsonl') nor a template containing '{{split}}'"
    )
