"""mlp kernels (GELU tanh: k_gelu_fwd, k_gelu_bwd, around the GEMMs) against the NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import mlp as km
from microgpt.ops import mlp as ref

from ._kutil import DEVICE, DTYPES, MM, REF_MM, compare, rounded, t


@pytest.mark.parametrize("recompute", [False, True], ids=["a-kept", "a-recomputed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", [(19, 12), (32, 8)])
def test_mlp(N: int, C: int, dtype: torch.dtype, recompute: bool) -> None:
    """Forward, then backward with a kept from forward or (recompute) a scratch of noise that backward fills."""
    rng = np.random.default_rng(N * C)
    H = 4 * C
    x, dout = rounded(rng.standard_normal((N, C)), dtype), rounded(rng.standard_normal((N, C)), dtype)
    w1, w2 = rounded(rng.standard_normal((C, H)) * 0.5, dtype), rounded(rng.standard_normal((H, C)) * 0.3, dtype)
    dx0, dw10, dw20 = (
        rounded(rng.standard_normal((N, C)), dtype),
        rng.standard_normal((C, H)),
        rng.standard_normal((H, C)),
    )
    out, hh, a = np.empty((N, C)), np.empty((N, H)), np.empty((N, H))
    ref.mlp_forward(out, hh, a, x, w1, w2, mm=REF_MM)
    dx, dw1, dw2 = dx0.copy(), dw10.copy(), dw20.copy()
    ref.mlp_backward(dx, dw1, dw2, dout, x, hh, w1, w2, a.copy(), np.empty((N, H)), recompute=False, mm=REF_MM)

    g = {k: torch.empty(s, dtype=dtype, device=DEVICE) for k, s in (("out", (N, C)), ("h", (N, H)), ("a", (N, H)))}
    km.mlp_forward(g["out"], g["h"], g["a"], t(x, dtype), t(w1, dtype), t(w2, dtype), mm=MM)
    compare("h", g["h"], hh, dtype)
    compare("a", g["a"], a, dtype)
    compare("out", g["out"], out, dtype)
    gdx, gdw1, gdw2 = t(dx0, dtype), t(dw10, torch.float32), t(dw20, torch.float32)
    dh = torch.empty(N, H, dtype=dtype, device=DEVICE)
    if recompute:
        g["a"].normal_()
    km.mlp_backward(
        gdx,
        gdw1,
        gdw2,
        t(dout, dtype),
        t(x, dtype),
        t(hh, dtype),
        t(w1, dtype),
        t(w2, dtype),
        g["a"],
        dh,
        recompute=recompute,
        mm=MM,
    )
    compare("dx", gdx, dx, dtype)
    compare("dw1", gdw1, dw1, dtype)
    compare("dw2", gdw2, dw2, dtype)
