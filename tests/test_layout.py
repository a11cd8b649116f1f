"""The package's import rules (docs/architecture.md, "Who may import whom" and the engine's
subpackages), read from every module's import statements, type-only ones included: no import
circles, no layer importing one it may not, and the engine's subpackages each importing only
those listed below it."""

from __future__ import annotations

import ast
from pathlib import Path

import areno

ROOT = Path(areno.__file__).parent
# Each engine subpackage may import those after it, never one before it.
ENGINE_ORDER = ["core", "parallel", "runner", "layers", "sample", "outputs", "kv", "kernels"]
FORBIDDEN = {
    # layer: the layers it never imports
    **{low: {"serve", "rollout", "train"} for low in ("engine", "processing", "media", "models")},
    **{low: {"serve", "rollout", "train"} for low in ("tools", "protocol")},
    "rollout": {"serve", "programs"},
    "train": {"serve"},
    "programs": {"train"},
}
# The serving modules an agent program's training route (areno.programs) runs: the chat
# handler's pure functions, never the Ray Serve app (docs/architecture.md).
PROGRAMS_MAY_IMPORT = {"areno.serve.chat", "areno.serve.sampling", "areno.serve.errors"}
FORBIDDEN["engine"] = FORBIDDEN["engine"] | {"media"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """areno module -> the areno modules it imports (a package's submodule where it names one)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in paths else node.module)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _imports()
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        for target in sorted(graph[node]):
            if target in stack:
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in done:
                visit(target, [*stack, target], done)
        done.add(node)

    done: set[str] = set()
    for node in sorted(graph):
        if node not in done:
            visit(node, [node], done)
    # a package's __init__ naming its own submodules is no circle of two modules
    cycles = [c for c in cycles if not all(m.startswith(c[0]) or c[0].startswith(m) for m in c)]
    assert not cycles, cycles


def test_layers_import_only_what_the_rules_allow() -> None:
    wrong = []
    for name, targets in _imports().items():
        layer = name.split(".")[1] if "." in name else ""
        for target in targets:
            other = target.split(".")[1] if "." in target else ""
            if other in FORBIDDEN.get(layer, ()):
                wrong.append(f"{name} -> {target}")
    assert not wrong, wrong


def test_agent_programs_run_the_chat_handler_not_the_serve_app() -> None:
    wrong = [
        f"{name} -> {target}"
        for name, targets in _imports().items()
        if name.startswith("areno.programs")
        for target in targets
        if target.startswith("areno.serve") and target not in PROGRAMS_MAY_IMPORT
    ]
    assert not wrong, wrong


def test_engine_subpackages_import_only_those_below_them() -> None:
    wrong = []
    for name, targets in _imports().items():
        parts = name.split(".")
        if len(parts) < 4 or parts[1] != "engine" or parts[2] not in ENGINE_ORDER:
            continue
        level = ENGINE_ORDER.index(parts[2])
        for target in targets:
            other = target.split(".")
            below = len(other) > 2 and other[1] == "engine" and other[2] in ENGINE_ORDER
            if below and ENGINE_ORDER.index(other[2]) < level:
                wrong.append(f"{name} -> {target}")
    assert not wrong, wrong


def test_every_module_imports_as_the_bundle_check_imports_it() -> None:
    """scripts/check_bundle.py (run on the GPU machine after unpacking the offline bundle)
    imports every module and reports the failures; here, with CI's packages, none fails."""
    import subprocess
    import sys

    script = ROOT.parent / "scripts" / "check_bundle.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAILED" not in done.stdout and " areno modules import" in done.stdout
