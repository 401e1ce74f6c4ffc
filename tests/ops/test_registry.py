"""The registry lists the GPT-2 block's six pairs and the modern block's four (its skip connections' pair among them),
the step's helpers, the decode step's ops and its greedy pick, each row naming both halves, and the ops package stays
free of torch and triton."""

import importlib
import subprocess
import sys

from microgpt.ops import HELPERS, OPS, OpPair


def test_registry_has_the_pairs() -> None:
    expected = [
        "embedding",
        "layernorm",
        "linear",
        "attention",
        "mlp",
        "crossentropy",
        "rmsnorm",
        "relu2",
        "qkrope",
        "skip",
    ]
    assert list(OPS) == expected
    for name, pair in OPS.items():
        assert isinstance(pair, OpPair) and pair.name == name
        assert pair.numpy == f"microgpt.ops.{name}" and pair.triton == f"microgpt.kernels.{name}"
        assert pair.functions[:2] == (f"{name}_forward", f"{name}_backward")
    assert list(HELPERS) == ["gradclip", "adamw", "muon", "decode", "argmax"]


def test_every_row_names_functions_both_halves_have() -> None:
    for row in [*OPS.values(), *HELPERS.values()]:
        ref = importlib.import_module(row.numpy)
        for fn in row.functions:
            assert callable(getattr(ref, fn)), f"{row.numpy}.{fn}"
            assert getattr(ref, fn).__module__ == row.numpy


def test_ops_import_no_gpu_stack() -> None:
    """The CPU path must run where torch and triton are not installed."""
    code = (
        "import sys, microgpt.ops, microgpt.engine.backend, microgpt.engine.state, microgpt.engine.step; "
        "microgpt.engine.backend.numpy_backend(); bad = {'torch', 'triton'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
