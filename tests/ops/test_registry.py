"""The registry lists the seven pairs, and the ops package stays free of torch and triton."""

import subprocess
import sys

import microgpt.ops as ops
from microgpt.ops import OPS, OpPair


def test_registry_has_the_seven_pairs() -> None:
    expected = ["embedding", "layernorm", "linear", "attention", "mlp", "residual", "crossentropy"]
    assert list(OPS) == expected
    for name, pair in OPS.items():
        assert isinstance(pair, OpPair) and pair.name == name
        assert pair.forward.__name__ == f"{name}_forward"
        assert pair.backward.__name__ == f"{name}_backward"
        assert pair.forward.__module__ == f"microgpt.ops.{name}"


def test_helpers_are_exported() -> None:
    for name in ("adamw_step", "grad_norm_partial", "grad_norm_final", "clip_coef", "grad_scale"):
        assert callable(getattr(ops, name))


def test_ops_import_no_gpu_stack() -> None:
    """The CPU path must run where torch and triton are not installed."""
    code = "import sys, microgpt.ops; bad = {'torch', 'triton'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
