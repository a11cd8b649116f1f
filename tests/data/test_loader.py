"""Loaders named by import path: resolution errors, item checks, and the JSONL loader."""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path

import pytest

from areno.data import Sample, SampleError, jsonl, load_samples, resolve_loader
from areno.errors import ConfigError

USER = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """module(source) -> the name of a fresh importable package module holding `source`."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        package = f"pkg_{uuid.uuid4().hex[:8]}"
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "loader.py").write_text(textwrap.dedent(source))
        return f"{package}.loader"

    return write


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_builtin_resolves_by_path_and_short_name():
    assert resolve_loader("areno.data.loader:jsonl") is jsonl
    assert resolve_loader("jsonl") is jsonl


def test_user_loader_with_kwargs(module):
    name = module(
        """
        from areno.data import Sample

        def load(n, prefix="q"):
            for i in range(n):
                yield Sample(messages=[{"role": "user", "content": str(i)}], id=f"{prefix}{i}")

        class Loaders:
            @staticmethod
            def one():
                return [Sample(messages=[{"role": "user", "content": "x"}])]
        """
    )
    samples = list(load_samples(f"{name}:load", n=3, prefix="p"))
    assert [s.id for s in samples] == ["p0", "p1", "p2"]
    assert len(list(load_samples(f"{name}:Loaders.one"))) == 1


@pytest.mark.parametrize(
    "spec", ["", "nocolon", "a.b:", ":load", "a:b:c", "a b:load", "a:lo ad", "a..b:load", 42]
)
def test_malformed_specs(spec):
    with pytest.raises(
        ConfigError, match=r"(malformed loader spec|must be a string).*module:callable"
    ):
        resolve_loader(spec)


def test_missing_module():
    with pytest.raises(ConfigError, match="no module named 'no_such_pkg_3b1.loader'"):
        resolve_loader("no_such_pkg_3b1.loader:load")


def test_module_with_missing_dependency_names_it(module):
    name = module("import no_such_dependency_9c2\n")
    with pytest.raises(ConfigError, match=f"importing '{name}' failed.*no_such_dependency_9c2"):
        resolve_loader(f"{name}:load")


def test_module_that_raises_on_import(module):
    name = module("raise RuntimeError('boom at import')\n")
    with pytest.raises(ConfigError, match="raised RuntimeError: boom at import"):
        resolve_loader(f"{name}:load")


def test_missing_attribute_suggests_close_names(module):
    name = module("def load_train():\n    return []\n")
    with pytest.raises(ConfigError, match=f"'{name}' has no attribute 'load_trian'.*'load_train'"):
        resolve_loader(f"{name}:load_trian")


def test_not_callable(module):
    name = module("DATA = [1, 2]\n")
    with pytest.raises(ConfigError, match=f"loader '{name}:DATA' is a list, not a callable"):
        resolve_loader(f"{name}:DATA")


def test_wrong_arguments_fail_before_loading(module):
    name = module("def load(path):\n    raise AssertionError('must not run')\n")
    with pytest.raises(ConfigError, match="does not accept arguments \\['pth'\\]"):
        load_samples(f"{name}:load", pth="x")


def test_items_must_be_samples(module):
    name = module(
        """
        from areno.data import Sample

        def load():
            yield Sample(messages=[{"role": "user", "content": "ok"}])
            yield {"messages": []}

        def scalar():
            return 3
        """
    )
    items = load_samples(f"{name}:load")
    assert isinstance(next(items), Sample)
    with pytest.raises(SampleError, match=f"'{name}:load' yielded a dict at index 1.*from_dict"):
        next(items)
    with pytest.raises(SampleError, match="returned a int; it must return or yield Samples"):
        load_samples(f"{name}:scalar")


def test_jsonl_reads_samples_and_fills_ids(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"id": "a", "messages": USER, "private": {"answer": "4"}},
            "",
            {"messages": USER, "tools": None},
        ],
    )
    samples = list(load_samples("jsonl", path=str(path)))
    assert [s.id for s in samples] == ["a", "train.jsonl:3"]
    assert samples[0].private == {"answer": "4"}


def test_jsonl_errors_name_file_and_line(tmp_path):
    bad_json = write_jsonl(tmp_path / "a.jsonl", [{"messages": USER}, "{oops"])
    with pytest.raises(SampleError, match=r"a\.jsonl:2: not valid JSON"):
        list(jsonl(str(bad_json)))
    bad_msg = write_jsonl(tmp_path / "b.jsonl", [{"id": "x", "messages": [{"role": "user"}]}])
    with pytest.raises(SampleError, match=r"b\.jsonl:1: sample 'x': messages\[0\]\.content"):
        list(jsonl(str(bad_msg)))
    with pytest.raises(ConfigError, match="does not exist"):
        jsonl(str(tmp_path / "missing.jsonl"))


def test_jsonl_splits(tmp_path):
    write_jsonl(tmp_path / "test.jsonl", [{"id": "t", "messages": USER}])
    assert [s.id for s in jsonl(str(tmp_path), split="test")] == ["t"]
    template = str(tmp_path / "{split}.jsonl")
    assert [s.id for s in jsonl(template, split="test")] == ["t"]
    with pytest.raises(ConfigError, match="split 'test' given"):
        jsonl(str(tmp_path / "test.jsonl"), split="test")
    with pytest.raises(ConfigError, match="val.jsonl' does not exist"):
        jsonl(str(tmp_path), split="val")
