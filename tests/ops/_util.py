"""Shared checks for the op tests: relative error against a reference, with readable failures."""

import numpy as np
import torch

F64_TOL = 1e-10  # float64 against float64 torch: only rounding differs
F32_TOL = 1e-5  # float32 run against the float64 reference


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| (over all elements); NaN if either side has a NaN.

    Where b is exactly zero (e.g. dq, dk of attention with T = 1), ||a - b|| itself: an absolute error.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    scale = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (scale if scale > 0 else 1.0))


def check(name: str, actual, expected, tol: float) -> None:
    """Assert rel_err(actual, expected) < tol; on failure show the max abs diff and the first mismatches.

    NaN never passes: a NaN anywhere makes the error NaN, and NaN < tol is False.
    """
    if isinstance(expected, torch.Tensor):
        expected = expected.detach().numpy()
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    assert a.shape == b.shape, f"{name}: shape {a.shape} != expected {b.shape}"
    err = rel_err(a, b)
    if err < tol:
        return
    diff = np.abs(a - b)
    bad = np.argwhere(~(diff <= tol * np.abs(b).max()))[:5]  # ~(<=) also flags NaN
    lines = [
        f"  at {tuple(int(i) for i in idx)}: got {float(a[tuple(idx)])!r}, expected {float(b[tuple(idx)])!r}"
        for idx in bad
    ]
    raise AssertionError(
        f"{name}: rel err {err:.3e} >= {tol:.0e}, max abs diff {np.nanmax(diff):.3e}, "
        f"{np.isnan(a).sum()} NaN; first mismatches:\n" + "\n".join(lines)
    )


def tt(x: np.ndarray) -> torch.Tensor:
    """A float64 torch leaf that needs a gradient, copied from x (so torch never writes into x)."""
    return torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True)


def noise_like(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random gradient-buffer contents: a backward must add to them, not overwrite them."""
    return rng.standard_normal(shape).astype(dtype)


def check_outputs_and_added_grads(
    got: dict, ref: dict, noise: dict, outputs: tuple[str, ...], tol: float, written: tuple[str, ...] = ()
) -> None:
    """Forward outputs against the reference, then each grad buffer minus the noise it was pre-filled with:
    equal to the reference gradient only if backward added into the buffer (+=) rather than overwrote it. The
    buffers in `written` (input gradients with one writer) must hold the gradient itself: the noise overwritten."""
    for k in outputs:
        check(k, got[k], ref[k], tol)
    for k in noise:
        check(k, got[k] if k in written else got[k] - noise[k], ref[k], tol)
