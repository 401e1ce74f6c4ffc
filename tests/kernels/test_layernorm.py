"""layernorm kernels (k_layernorm_fwd/bwd, and the residual add fused into the forward) against the NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import layernorm as kl
from microgpt.ops import layernorm as ref

from ._kutil import DEVICE, DTYPES, SMS, TUNER, compare, rounded, t

SHAPES = [(7, 37), (33, 64), (1, 5), (40, 130)]  # (N, C): odd widths exercise the column masks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", SHAPES)
def test_layernorm(N: int, C: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(N * C)
    x, dout = (rounded(rng.standard_normal((N, C)) * 2 + 0.5, dtype) for _ in range(2))
    w, b = rounded(rng.standard_normal(C), dtype), rounded(rng.standard_normal(C), dtype)
    dx0, dw0, db0 = rng.standard_normal((N, C)), rng.standard_normal(C), rng.standard_normal(C)
    out, mean, rstd = np.empty((N, C)), np.empty(N), np.empty(N)
    ref.layernorm_forward(out, mean, rstd, x, w, b)
    dx, dw, db = rounded(dx0, dtype), dw0.copy(), db0.copy()
    ref.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd)

    g = {"out": torch.empty(N, C, dtype=dtype, device=DEVICE), "mean": t(np.empty(N, np.float32))}
    g["rstd"] = t(np.empty(N, np.float32))
    kl.layernorm_forward(g["out"], g["mean"], g["rstd"], t(x, dtype), t(w, dtype), t(b, dtype), tuner=TUNER)
    compare("out", g["out"], out, dtype)
    compare("mean", g["mean"], mean, torch.float32)
    compare("rstd", g["rstd"], rstd, torch.float32)
    gdx, gdw, gdb = t(dx0, dtype), t(dw0, torch.float32), t(db0, torch.float32)
    partials = torch.empty(kl.scratch_numel(C, SMS), dtype=torch.float32, device=DEVICE)
    kl.layernorm_backward(
        gdx, gdw, gdb, t(dout, dtype), t(x, dtype), t(w, dtype), g["mean"], g["rstd"], partials=partials, tuner=TUNER
    )
    compare("dx", gdx, dx, dtype)
    compare("dw", gdw, dw, dtype)
    compare("db", gdb, db, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", SHAPES)
def test_residual_layernorm_forward(N: int, C: int, dtype: torch.dtype) -> None:
    """The fused kernel against the NumPy LayerNorm of the rounded sum (tests/ops checks the NumPy entry point),
    and byte for byte against the kernels it replaces (k_residual_fwd, then k_layernorm_fwd reading the sum)."""
    rng = np.random.default_rng(7 + N * C)
    x, y = (rounded(rng.standard_normal((N, C)) * 2 + 0.5, dtype) for _ in range(2))
    w, b = rounded(rng.standard_normal(C), dtype), rounded(rng.standard_normal(C), dtype)
    s = rounded(x + y, dtype)  # the kernel stores the sum in dtype and normalizes it as stored
    out, mean, rstd = np.empty((N, C)), np.empty(N), np.empty(N)
    ref.layernorm_forward(out, mean, rstd, s, w, b)
    gx, gy, gw, gb = t(x, dtype), t(y, dtype), t(w, dtype), t(b, dtype)

    def run(fused: bool) -> list[torch.Tensor]:
        gs, gout = t(rng.standard_normal((N, C)), dtype), t(rng.standard_normal((N, C)), dtype)  # overwritten
        gmean, grstd = (t(rng.standard_normal(N).astype(np.float32)) for _ in range(2))
        if fused:
            kl.residual_layernorm_forward(gs, gout, gmean, grstd, gx, gy, gw, gb, tuner=TUNER)
        else:
            torch.add(gx, gy, out=gs)  # the add in the operands' dtype, as the fused kernel rounds it
            kl.layernorm_forward(gout, gmean, grstd, gs, gw, gb, tuner=TUNER)
        return [gs, gout, gmean, grstd]

    fused, two = run(True), run(False)
    for name, got, want in zip(("s", "out", "mean", "rstd"), fused, (s, out, mean, rstd)):
        compare(name, got, want, dtype if name in ("s", "out") else torch.float32)
    for name, a, c in zip(("s", "out", "mean", "rstd"), fused, two):
        assert torch.equal(a, c), f"{name}: the fused kernel differs from the add + layernorm"
