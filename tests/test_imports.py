"""The package's layering (DESIGN.md section 2), read from the source: no import cycle anywhere (module- and
function-level imports alike), and every import runs down the wings' order (WINGS): the ground floor, then the op
pairs, the kernels and the data pipeline, then the engine and the proxy, then the use of a model, then the run,
then the command line. A module imports its own wing and the wings below it, never one beside or above."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "microgpt"


def module_name(path: Path, pkg: Path = PKG) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from pkg import mod` counts as importing pkg.mod), read from the
    package at `pkg` (this tree's microgpt/ unless told: dev/import_graph.py reads an older commit's too)."""
    paths = {module_name(p, pkg): p for p in pkg.rglob("*.py")}
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


# The wings in order, bottom up: a module may import its own wing and any wing of a lower rank. Wings of one rank
# stand beside each other and import nothing of each other (the proxy talks to the engine through the run's command
# line, JSON lines, signals and files; the data pipeline knows nothing of the engine). The ground floor is every
# module at the package's top level but the command line: formats and helpers every wing may read.
WINGS = {"ground": 0, "ops": 1, "kernels": 1, "data": 1, "engine": 2, "proxy": 2, "use": 3, "run": 4, "cli": 5}
COMMAND_LINE = ("microgpt.cli", "microgpt.__main__", "microgpt.training_proxy")
ALLOWED_BESIDE = {("kernels", "ops")}  # the Triton pairs may read their NumPy specification's constants


def wing(module: str) -> str:
    """The wing a module lives in: its subpackage, "cli" for the command line, else the ground floor."""
    if module in COMMAND_LINE:
        return "cli"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) else "ground"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs up or across the wings' order, as "a (wing) -> b (wing)"."""
    bad = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            a, b = wing(name), wing(dep)
            if a != b and (WINGS[b] > WINGS[a] or (WINGS[b] == WINGS[a] and (a, b) not in ALLOWED_BESIDE)):
                bad.append(f"{name} ({a}) -> {dep} ({b})")
    return bad


def test_every_import_runs_down_the_wings() -> None:
    assert upward_imports(import_graph()) == []


def test_every_module_has_a_wing() -> None:
    assert {wing(name) for name in import_graph()} <= set(WINGS)


def test_the_wing_check_finds_an_upward_import() -> None:
    graph = {
        "microgpt.engine.model": {"microgpt.use.sample"},
        "microgpt.proxy.supervisor": {"microgpt.run.job"},
        "microgpt.data.loader": {"microgpt.ops.rows"},
        "microgpt.use.sample": {"microgpt.engine.model"},
    }
    assert upward_imports(graph) == [
        "microgpt.data.loader (data) -> microgpt.ops.rows (ops)",
        "microgpt.engine.model (engine) -> microgpt.use.sample (use)",
        "microgpt.proxy.supervisor (proxy) -> microgpt.run.job (run)",
    ]


def test_op_pairs_and_kernels_read_only_the_fp8_format_of_the_ground_floor() -> None:
    """ops/ and kernels/ are the engine's leaves: of the ground floor they read the E4M3 format (microgpt/fp8.py),
    nothing else, so an op pair can be lifted out with its test."""
    graph = import_graph()
    for name, deps in graph.items():
        if wing(name) in ("ops", "kernels"):
            ground = {d for d in deps if wing(d) == "ground"}
            assert ground <= {"microgpt.fp8"}, f"{name} imports {ground}"


def test_fp8_format_imports_nothing_of_the_project() -> None:
    """microgpt/fp8.py (the E4M3 format both backends share) is a leaf: ops and kernels may import it."""
    assert import_graph()["microgpt.fp8"] == set()
