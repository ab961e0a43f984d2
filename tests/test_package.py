"""The package as a whole: its front door, its import graph, the size of its modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir)
PACKAGES = {
    "entrain_data": "entrain_data",
    "workers": "entrain_data.workers",
    "adapters": "entrain_data.adapters",
    "examples/demo": "entrain_data.demo",
}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules that ``name`` imports when it is imported (function bodies excluded; imports
    under ``if TYPE_CHECKING`` included, except in a package's lazy front door)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.stem == "__init__"
    base = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not (is_package and _is_type_checking(node)):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")
                    parent = ".".join(parts[: len(parts) - node.level + 1])
                    mod = f"{parent}.{node.module}" if node.module else parent
                else:
                    mod = node.module or ""
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in node.names)

    visit(tree.body)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: _module_level_imports(n, p, set(mods)) for n, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (c := dfs(m)):
                return c
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (c := dfs(n)):
            return c
    return None


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_finds_a_cycle():  # the check above can fail
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_neither_workers_nor_adapters():
    graph = _graph()
    outside = ("entrain_data.workers", "entrain_data.adapters", "entrain_data.demo")
    bad = {
        n: sorted(m for m in deps if m.startswith(outside))
        for n, deps in graph.items()
        if not n.startswith(outside)
    }
    assert not {n: d for n, d in bad.items() if d}


@pytest.mark.parametrize("folder", [*PACKAGES, "bench", "examples"])
def test_no_module_over_500_lines(folder):
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / folder).glob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_front_door_is_lazy_and_complete():
    code = (
        "import sys, entrain_data\n"
        "heavy = [m for m in ('torch', 'pyarrow', 'zmq') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from entrain_data import (EntrainLoader, ParallelPlan, make_plan, assign, Microbatch,\n"
        "    EntrainError, InvalidInput, SampleError, PlanError, EntrainTimeout, WorkerDied,\n"
        "    ProtocolError)\n"
        "import entrain_data.client, entrain_data.plan, entrain_data.planner, entrain_data.batch\n"
        "assert EntrainLoader is entrain_data.client.EntrainLoader\n"
        "assert ParallelPlan is entrain_data.plan.ParallelPlan\n"
        "assert make_plan is entrain_data.planner.make_plan\n"
        "assert Microbatch is entrain_data.batch.Microbatch\n"
        "assert set(entrain_data.__all__) <= set(dir(entrain_data))\n"
        "for name in entrain_data.__all__: getattr(entrain_data, name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_unknown_name_is_an_attribute_error():
    import entrain_data

    with pytest.raises(AttributeError, match="no_such_name"):
        entrain_data.no_such_name  # noqa: B018


def test_version_matches_the_installed_distribution():
    import entrain_data

    assert entrain_data.__version__ == version("entrain-data")
    out = subprocess.run(
        [sys.executable, "-m", "entrain_data.cli", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == f"entrain-data {entrain_data.__version__}"
