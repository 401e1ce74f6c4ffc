"""The package's layering (the README's Layout), read from the source: no import cycle anywhere (module- and
function-level imports alike), op pairs and kernels import nothing of the project above them, the proxy never
imports the trainer, and the data package depends on config and nothing of the engine."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "microgpt"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (`from pkg import mod` counts as importing pkg.mod)."""
    paths = {module_name(p): p for p in PKG.rglob("*.py")}
    packages = {name for name, p in paths.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if name in packages else name.split(".")[:-1]
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for target in targets:
                if target in paths and target != name and not (name.startswith(target + ".") and target in packages):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _imports_within(prefix: str, allowed: tuple[str, ...]) -> dict[str, set[str]]:
    """For modules under prefix: the project modules they import outside prefix and `allowed`."""
    bad = {}
    for name, deps in import_graph().items():
        if name == prefix or name.startswith(prefix + "."):
            outside = {d for d in deps if not d.startswith(prefix) and d not in allowed}
            if outside:
                bad[name] = outside
    return bad


def test_kernels_import_nothing_above_kernels() -> None:
    assert _imports_within("microgpt.kernels", ("microgpt.fp8",)) == {}


def test_ops_import_nothing_above_ops() -> None:
    assert _imports_within("microgpt.ops", ("microgpt.fp8",)) == {}


def test_fp8_format_imports_nothing_of_the_project() -> None:
    """microgpt/fp8.py (the E4M3 format both backends share) is a leaf: ops and kernels may import it."""
    assert import_graph()["microgpt.fp8"] == set()


def test_the_proxy_never_imports_the_trainer() -> None:
    graph = import_graph()
    engine_side = {"microgpt.trainer", "microgpt.step", "microgpt.state", "microgpt.model", "microgpt.backend"}
    for name, deps in graph.items():
        if name.startswith("microgpt.proxy") or name == "microgpt.training_proxy":
            assert not deps & engine_side, f"{name} imports {deps & engine_side}"


def test_data_depends_on_config_and_nothing_of_the_engine() -> None:
    graph = import_graph()
    engine_side = {"microgpt.trainer", "microgpt.step", "microgpt.state", "microgpt.model", "microgpt.backend",
                   "microgpt.memory", "microgpt.checkpoint", "microgpt.kernels", "microgpt.ops"}  # fmt: skip
    for name, deps in graph.items():
        if name.startswith("microgpt.data."):
            bad = {d for d in deps if d in engine_side or d.startswith(("microgpt.kernels.", "microgpt.ops."))}
            assert not bad, f"{name} imports {bad}"
