"""fp8 lives in its homes (issue 45): the E4M3 format on the ground floor (microgpt/fp8.py), the precision object
(microgpt/engine/precision.py), the NumPy reference (microgpt/ops/fp8.py) and the GPU's casts and GEMM sites
(microgpt/kernels/fp8.py, kernels/fp8_*.py). Every other module reaches fp8 through the precision's interface
(its Matmul, its rows, its state) and does not name it.

"Names fp8", read from the source: a module's code -- identifiers (names, attributes, arguments, definitions,
imports, keywords) and string constants other than docstrings; not its comments or docstrings -- holds a word
matching FP8_WORD. A module outside the homes that names fp8 is either in ALLOWED, with the reason it must, or a
leak. dev/import_graph.py prints the same count for any commit.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_imports import PKG, module_name

FP8_WORD = re.compile(r"fp8|float8|e4m3|amax", re.IGNORECASE)


def is_home(module: str) -> bool:
    """The precision object's module, and the fp8 modules of the ground floor, ops/ and kernels/ (read by file name,
    so that an older layout -- microgpt/precision.py at the top -- is measured alike)."""
    parts = module.split(".")
    if parts[-1] == "precision":
        return True
    return bool(re.fullmatch(r"fp8(_\w+)?", parts[-1])) and (len(parts) == 2 or parts[1] in ("ops", "kernels"))


def code_words(source: str) -> list[str]:
    """The identifiers and non-docstring string constants of a module's code, in the order ast.walk meets them."""
    tree = ast.parse(source)
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, scopes)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, ast.arg):
            words.append(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.append(node.name)
        elif isinstance(node, ast.alias):
            words += [node.name, *([node.asname] if node.asname else [])]
        elif isinstance(node, ast.ImportFrom) and node.module:
            words.append(node.module)
        elif isinstance(node, ast.keyword) and node.arg:
            words.append(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
    return words


def fp8_words(source: str) -> list[str]:
    """The words of a module's code that name fp8 (FP8_WORD), each once, sorted."""
    return sorted({w for w in code_words(source) if FP8_WORD.search(w)})


def naming_fp8(pkg: Path = PKG) -> dict[str, list[str]]:
    """module -> its words naming fp8, for every module of the package at `pkg` outside the homes that has any."""
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        name = module_name(path, pkg)
        if not is_home(name) and (words := fp8_words(path.read_text())):
            out[name] = words
    return out


# The modules outside the homes that must name fp8, and why. Each names it as a choice users make or as a device's
# primitive that the precision builds on, never as arithmetic of its own.
ALLOWED = {
    "microgpt.config": "the precision names users choose (PRECISIONS) and the experiment file's checks of the choice "
    "(which the NumPy backend runs; fp8's d_model multiple of 16), made where the file and field can be named",
    "microgpt.kernels.runtime": "the device's element kinds (the plan's 'f8' is torch.float8_e4m3fn) and the "
    "cuBLASLt workspace its scaled GEMMs take, measured when the precision asks for them (scaled_mm)",
    "microgpt.kernels.cublaslt": "the library's data types: E4M3 operands of the scaled GEMM it offers",
    "microgpt.kernels.check.catalogue": "the compile sweep lists every kernel's launches, fp8's included (each "
    "marked, so the sweep compiles them only where the card has FP8 tensor cores)",
    "microgpt.kernels.check.targets": "which architectures have FP8 tensor cores (Target.fp8): the sweep's table",
}


def test_no_module_outside_the_homes_names_fp8() -> None:
    leaks = {name: words for name, words in naming_fp8().items() if name not in ALLOWED}
    assert leaks == {}, "modules naming fp8 outside its homes (move the logic into the precision, or allow it):\n" + (
        "\n".join(f"{name}: {', '.join(words)}" for name, words in leaks.items())
    )


def test_every_allowed_module_still_names_fp8() -> None:
    """An entry whose module no longer names fp8 goes: the list says what is, not what was."""
    assert sorted(set(ALLOWED) - set(naming_fp8())) == []


def test_the_homes_are_the_four() -> None:
    homes = sorted(n for n in (module_name(p) for p in PKG.rglob("*.py")) if is_home(n))
    assert [h for h in homes if not h.startswith("microgpt.kernels.fp8")] == [
        "microgpt.engine.precision",
        "microgpt.fp8",
        "microgpt.ops.fp8",
    ]
    assert "microgpt.kernels.fp8" in homes


def test_the_criterion_reads_code_not_prose() -> None:
    source = '''"""fp8 in the module's docstring."""
import microgpt.fp8 as formats  # fp8 in a comment
from microgpt import fp8


def f(x, amax=None):
    """E4M3 in a docstring."""
    return g(x, kind="plain", scaled=f"{x} is not e4m3")


class Plain:
    "amax: a docstring too"
    w = torch.float8_e4m3fn
'''
    assert fp8_words(source) == [" is not e4m3", "amax", "float8_e4m3fn", "fp8", "microgpt.fp8"]
    assert fp8_words('"""fp8."""\n# amax\nx = 1\n') == []
    assert is_home("microgpt.kernels.fp8_cast") and is_home("microgpt.precision") and is_home("microgpt.fp8")
    assert not is_home("microgpt.use.fp8") and not is_home("microgpt.engine.fp8_state")
