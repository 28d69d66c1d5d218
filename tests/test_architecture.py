"""The architecture, checked: layer contracts, no import cycles, small modules and classes.

The contracts live in pyproject.toml (``[tool.importlinter]``); ``lint-imports``
checks them. These tests run the same check, so the README's test command
fails on a violation, and show on a copy of the tree that a violation is caught.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dataflow", "stores", "training", "eval")
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 500


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter on the tree at ``root`` (its pyproject.toml), in a fresh process."""
    code = (
        "import sys\n"
        "from importlinter.cli import lint_imports\n"
        "sys.exit(lint_imports(no_cache=True, no_logo=True))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )


def _cycles(root: Path) -> list[list[str]]:
    """Every strongly connected component (more than one module) of the import graph."""
    code = (
        "import json, grimp\n"
        f"g = grimp.build_graph(*{PACKAGES!r}, include_external_packages=False, cache_dir=None)\n"
        "edges = {m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}\n"
        "print(json.dumps(edges))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
    ).stdout
    graph: dict[str, list[str]] = json.loads(out)
    return _strongly_connected(graph)


def _strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively (the graph has a few hundred modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    root.mkdir()
    shutil.copy(ROOT / "pyproject.toml", root)
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return root


def test_the_import_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


def test_there_are_no_import_cycles() -> None:
    assert _cycles(ROOT) == []


def test_a_layer_violation_and_its_cycle_are_caught(tmp_path: Path) -> None:
    """The checks are real: the model importing the live layer breaks both."""
    root = _copy_tree(tmp_path)
    text = root / "dataflow" / "model" / "_refs.py"
    text.write_text(text.read_text() + "\nfrom dataflow.live import _consumer  # noqa\n")
    result = _lint_imports(root)
    assert result.returncode == 1
    assert "dataflow.model is not allowed to import dataflow.live" in result.stdout
    assert any("dataflow.model._refs" in component for component in _cycles(root))


def test_a_private_import_from_outside_the_core_is_caught(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    init = root / "training" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom dataflow.model import _fold  # noqa\n")
    result = _lint_imports(root)
    assert result.returncode == 1
    assert "training is not allowed to import dataflow.model._fold" in result.stdout


def _sizes() -> tuple[list[str], list[str]]:
    modules, classes = [], []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            name = path.relative_to(ROOT).as_posix()
            if len(source.splitlines()) > MAX_MODULE_LINES:
                modules.append(f"{name}: {len(source.splitlines())} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef):
                    assert node.end_lineno is not None
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_CLASS_LINES:
                        classes.append(f"{name}::{node.name}: {length} lines")
    return modules, classes


def test_modules_and_classes_stay_small() -> None:
    modules, classes = _sizes()
    assert modules == [], f"modules over {MAX_MODULE_LINES} lines"
    assert classes == [], f"classes over {MAX_CLASS_LINES} lines"


def test_the_graph_builder_sees_function_local_imports() -> None:
    """The cycle check counts imports inside functions (they hide cycles otherwise)."""
    graph = grimp.build_graph("dataflow", include_external_packages=False, cache_dir=None)
    importers = graph.find_modules_that_directly_import("dataflow.demo")
    assert "dataflow.cli" in {m.rsplit(".", 1)[0] for m in importers} | importers
