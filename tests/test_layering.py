"""The architecture rules of docs/architecture.md, checked on the source: no import cycles
(function-level imports, ``TYPE_CHECKING`` imports and the registries' by-name imports included), no
private name imported from another module, every ``AOTBUILD_*`` variable named through constants.py,
every store path built by cache/layout.py, and no module outside a registry's package comparing a
strategy's or a target's name."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aotbuild"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of every import, at any level, those under ``if
    TYPE_CHECKING:`` included (a reader follows an annotation's import as any other); and every string
    constant naming an aotbuild module (the registries import by name, builder runs ``-m`` children)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found += [(base, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES \
                and "." in node.value and name != "aotbuild":  # "aotbuild" alone is a logger or folder name;
            # the top package's lazy names are the public facade, not imports
            found.append((node.value, None, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for base, imported, _ in _imports(name, path):
            target = f"{base}.{imported}" if imported and f"{base}.{imported}" in MODULES else base
            if target in MODULES and target != name:
                edges[name].add(target)
                # importing a.b.c imports its package a.b first (not the top package: its __init__ is a
                # facade that resolves names on first use, and every module is inside it)
                parent = target.rpartition(".")[0]
                while "." in parent and parent != name and not name.startswith(parent + "."):
                    edges[name].add(parent)
                    parent = parent.rpartition(".")[0]
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_imports_at_every_level():
    edges = _graph()
    assert "aotbuild.recipe.frozen" in edges["aotbuild.targets.inductor"]  # imported inside a function
    assert "aotbuild.targets.inductor" in edges["aotbuild.targets.registry"]  # named in the registry
    assert "aotbuild.strategies.aot_package" in edges["aotbuild.strategies.registry"]
    assert "aotbuild.builder.worker" in edges["aotbuild.builder.build"]  # run as python -m aotbuild.builder.worker
    assert "aotbuild.cache.store" in edges["aotbuild.strategies.base"]  # under TYPE_CHECKING
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_no_private_names_imported_across_modules():
    crossing = [f"{name}:{line} imports {base}.{imported}"
                for name, path in MODULES.items() for base, imported, line in _imports(name, path)
                if base.startswith("aotbuild") and imported and imported.startswith("_")
                and not imported.startswith("__") and f"{base}.{imported}" not in MODULES and base != name]
    assert crossing == []


def test_aotbuild_variables_are_named_in_constants_only():
    named = [f"{name}:{node.lineno}: {node.value}" for name, path in MODULES.items() if name != "aotbuild.constants"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.fullmatch(r"AOTBUILD_[A-Z_]+", node.value)]
    assert named == []


STORE_FOLDERS = ("blobs", "manifests", "models", "tmp", "locks", "logs", "failures")


def test_store_paths_are_built_by_layout():
    """``root / "logs"`` and friends: a store folder joined outside cache/layout.py."""
    built = []
    for name, path in MODULES.items():
        if name == "aotbuild.cache.layout":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                    and node.right.value in STORE_FOLDERS:
                built.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert built == []


def test_names_are_compared_only_inside_their_registries():
    """``recipe.strategy == "aot-package"`` or ``target.name == "inductor"`` outside aotbuild/strategies
    and aotbuild/targets: the interface should have been asked instead."""
    from aotbuild.strategies.registry import strategy_names
    from aotbuild.targets.registry import target_names

    names = set(strategy_names()) | set(target_names())
    compared = []
    for name, path in MODULES.items():
        if name.startswith(("aotbuild.strategies", "aotbuild.targets")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                values = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                if any(v in names for v in values):
                    compared.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert compared == []


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts of ``root``/pyproject.toml on ``root``/aotbuild (a fresh process: grimp
    finds the package on ``sys.path``, so a planted copy is found before the installed one)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command;"
                           " sys.exit(lint_imports_command())", "--config", str(root / "pyproject.toml"),
                           "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    """The layers of pyproject.toml's import-linter contract, and serving never importing build code."""
    proc = _lint_imports(PACKAGE.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize("module, planted, contract", [
    # the store (layer 3) reaching up to the planner (layer 7), through a function-level import
    ("cache/store", "def _planted():\n    from aotbuild import planner\n", "Each layer imports only"),
    # a module load_compiled imports pulling in the builder: both contracts break
    ("pipeline/pipecall", "import aotbuild.builder.build\n", "never imports build code"),
])
def test_a_planted_upward_import_breaks_a_contract(tmp_path, module, planted, contract):
    shutil.copytree(PACKAGE, tmp_path / "aotbuild", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PACKAGE.parent / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _lint_imports(tmp_path).returncode == 0  # the copy as it is: kept
    path = tmp_path / "aotbuild" / f"{module}.py"
    path.write_text(path.read_text() + "\n\n" + planted)
    proc = _lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{contract}" in proc.stdout and "BROKEN" in proc.stdout
    assert f"aotbuild.{module.replace('/', '.')}" in proc.stdout  # the report names the importer


def test_only_the_forwards_registry_assigns_or_deletes_a_modules_forward():
    """``x.forward = ...``, ``del x.forward`` or ``vars(x).pop("forward")`` outside aotbuild/forwards.py:
    a wrapper put on or taken off by hand, which drops whatever another library put below it."""
    found = []
    for name, path in MODULES.items():
        if name == "aotbuild.forwards":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            hit = any(isinstance(t, ast.Attribute) and t.attr == "forward" for t in targets)
            hit |= isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("pop", "__delitem__", "__setitem__") \
                and any(isinstance(a, ast.Constant) and a.value == "forward" for a in node.args)
            if hit:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert found == []
