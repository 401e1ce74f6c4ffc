"""kernels/ holds no mutable module state: what a run chooses, plans or loads belongs to the runtime's objects (the
Tuner, the Gemm router, CublasLt), created, bound and dropped with it, never to a module.

Read from the source: no `global` statement, and every name a module binds at its top level is a CONSTANT (upper
case) or a type alias. Then run: a training step and an inference step on the triton backend (the interpreter in CI)
through two runtimes, and every module-level value of every kernels module is what it was before (the module's own
names: the interpreter injects a few of its own into the modules whose kernels it runs)."""

from __future__ import annotations

import ast
import ctypes
import importlib
import inspect
import re
import types
from pathlib import Path

import numpy as np

from microgpt.config import ModelConfig, TrainConfig
from microgpt.engine import params
from microgpt.engine.backend import triton_backend
from microgpt.engine.infer import make_infer_state
from microgpt.engine.state import make_state
from microgpt.engine.step import Step

KERNELS = Path(__file__).resolve().parents[2] / "microgpt" / "kernels"
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")


def top_level_names(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(name, value) for every name the module binds at its top level (also inside a top-level if/else)."""
    out = []
    for node in tree.body:
        body = [*node.body, *node.orelse] if isinstance(node, ast.If) else [node]
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for elt in target.elts if isinstance(target, ast.Tuple) else [target]:
                        out.append((elt.id, stmt.value))
            elif isinstance(stmt, ast.AnnAssign):
                out.append((stmt.target.id, stmt.value))
    return out


def test_the_source_binds_constants_only() -> None:
    bad = []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        bad += [f"{path.name}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        for name, value in top_level_names(tree):
            alias = isinstance(value, ast.Subscript) and name[:1].isupper()  # e.g. ChunkLogits = Callable[...]
            if not (CONSTANT.match(name) or alias):
                bad.append(f"{path.name}: module-level name {name!r} is not a constant")
    assert bad == [], "\n".join(bad)


def test_the_checker_flags_state() -> None:
    tree = ast.parse("_cache = {}\nif X:\n    _launches = {}\nA = 1\n")
    names = [n for n, _ in top_level_names(tree)]
    assert names == ["_cache", "_launches", "A"]
    assert [n for n in names if not CONSTANT.match(n)] == ["_cache", "_launches"]
    table = {"k": [1, 2], "one": ctypes.c_float(1.0)}  # an UPPER_CASE table mutated at run time is caught by value
    snap = freeze(table)
    table["k"].append(3)
    assert freeze(table) != snap
    table["k"].pop()
    table["one"].value = 2.0
    assert freeze(table) != snap


def freeze(x: object) -> object:
    """A comparable snapshot of a module-level value (containers deep, ctypes scalars by value)."""
    if isinstance(x, ctypes._SimpleCData):
        return ("ctypes", type(x).__name__, x.value)
    if isinstance(x, dict):
        return ("dict", tuple((k, freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(freeze(v) for v in x))
    if isinstance(x, (set, frozenset)):
        return (type(x).__name__, frozenset(freeze(v) for v in x))
    return x


def module_values() -> dict[str, object]:
    """Every kernels module's top-level data (not modules, functions, classes or Triton kernels), frozen."""
    out = {}
    for path in sorted(KERNELS.glob("*.py")):
        module = importlib.import_module(
            f"microgpt.kernels.{path.stem}" if path.stem != "__init__" else "microgpt.kernels"
        )
        for name, value in vars(module).items():
            if name.startswith("__") or isinstance(value, types.ModuleType) or inspect.isclass(value):
                continue
            if callable(value) or type(value).__module__.startswith("triton"):
                continue
            out[f"{module.__name__}.{name}"] = freeze(value)
    return out


def test_running_leaves_every_module_value_as_it_was() -> None:
    before = module_values()
    m = ModelConfig(vocab_size=40, d_model=16, n_layer=1, n_head=2, seq_len=8)
    rng = np.random.default_rng(0)
    batch = [tuple(rng.integers(0, 40, (2, 8)).astype(np.int32) for _ in range(2))]
    for _ in range(2):  # two runtimes, each with its own tuner and router
        S = make_state(m, TrainConfig(micro_batch=2, backend="triton"), triton_backend("fp32"))
        Step(S)(batch, 1e-3)
        inf = make_infer_state(m, triton_backend("fp32"), 1, params.init_weights(m, 0))
        tokens, _ = inf.inputs(1, 3)
        inf.K.copy_in(tokens, np.array([[1, 2, 3]], np.int32))
        inf.run(tokens, 0)
    after = module_values()  # (the Triton interpreter adds names of its own to a module it runs kernels of)
    changed = [name for name in before if after.get(name) != before[name]]
    assert changed == [], changed
