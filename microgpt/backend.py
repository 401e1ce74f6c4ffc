"""Backends: the namespace `K` that model.py and engine.py call.

A backend exposes every op pair's forward/backward under the registry's names, the clipping helpers,
AdamW, and a few buffer utilities (alloc, zero_, copy_in, to_numpy, loss_weights, loss_sum). The NumPy
backend is the reference and the default; the Triton backend (microgpt.kernels) mirrors it on the GPU
and is imported only when asked for, so the CPU path never imports torch or triton.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from microgpt import ops
from microgpt.config import ConfigError

NUMPY_DTYPES = {"f32": np.float32, "compute": np.float32, "i32": np.int32, "u8": np.uint8}


def _numpy_loss_weights(dlosses: np.ndarray, targets: np.ndarray) -> None:
    """dlosses = d(mean loss over non-ignored tokens)/d(per-token loss)."""
    valid = targets >= 0
    dlosses[...] = valid / max(1, int(valid.sum()))


def _numpy_loss_sum(losses: np.ndarray, targets: np.ndarray) -> tuple[float, int]:
    """(sum of per-token losses, number of non-ignored tokens); ignored tokens carry loss 0."""
    return float(losses.sum(dtype=np.float64)), int((targets >= 0).sum())


def _numpy_copy_in(dst: np.ndarray, src: np.ndarray) -> None:
    dst[...] = src


def numpy_backend() -> SimpleNamespace:
    K = SimpleNamespace(name="numpy", precision="fp32", device="cpu")
    for pair in ops.OPS.values():
        setattr(K, pair.forward.__name__, pair.forward)
        setattr(K, pair.backward.__name__, pair.backward)
        if pair.forward_backward is not None:
            setattr(K, pair.forward_backward.__name__, pair.forward_backward)
    for name in ("grad_norm_partial", "grad_norm_final", "grad_scale", "adamw_step"):
        setattr(K, name, getattr(ops, name))
    K.alloc = lambda numel, kind: np.zeros(numel, dtype=NUMPY_DTYPES[kind])
    K.zero_ = lambda x: x.fill(0)
    K.copy_in = _numpy_copy_in
    K.to_numpy = lambda x: np.asarray(x)
    K.loss_weights = _numpy_loss_weights
    K.loss_sum = _numpy_loss_sum
    K.synchronize = lambda: None
    return K


def get_backend(name: str, precision: str) -> Any:
    """The backend namespace; what this machine cannot run is a ConfigError naming the field (CLI: exit 2)."""
    if name == "numpy":
        return numpy_backend()
    if name == "triton":
        try:
            from microgpt import kernels  # torch + triton: only on this path
        except ImportError as e:
            raise ConfigError(f"train.backend 'triton' needs torch and triton ({e.name} is missing): "
                              "pip install -e '.[gpu]'") from None  # fmt: skip
        try:
            return kernels.triton_backend(precision)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"train.backend 'triton': {e}") from None
    raise ConfigError(f"train.backend: unknown backend {name!r}")
