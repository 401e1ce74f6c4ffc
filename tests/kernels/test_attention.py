"""attention kernels (flash style: k_attention_fwd, k_attention_bwd_delta, k_attention_bwd) against the NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import attention as ka
from microgpt.ops import attention as ref

from ._kutil import DEVICE, DTYPES, TUNER, compare, rounded, t

# (B, T, C, NH): hs = 12 (padded to 16 lanes), 16, 4; T not a multiple of the tiles; T = 1; hs = 128 (the modern
# block's head size: ANDREA-120M modern has 6 heads of 128) over several tiles of rows and keys
SHAPES = [(2, 37, 24, 2), (1, 64, 32, 2), (2, 5, 8, 2), (1, 1, 16, 1), (2, 35, 256, 2), (1, 3, 128, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,NH", SHAPES)
def test_attention(B: int, T: int, C: int, NH: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(B * T * C + NH)
    q, k, v, dout = (rounded(rng.standard_normal((B, T, C)), dtype) for _ in range(4))
    d0 = {n: rounded(rng.standard_normal((B, T, C)), dtype) for n in ("dq", "dk", "dv")}
    out, lse = np.empty((B, T, C)), np.empty((B, NH, T))
    ref.attention_forward(out, lse, q, k, v, NH)
    d = {n: x.copy() for n, x in d0.items()}
    ref.attention_backward(d["dq"], d["dk"], d["dv"], dout, q, k, v, out, lse, NH)

    gq, gk, gv = t(q, dtype), t(k, dtype), t(v, dtype)
    gout = torch.empty(B, T, C, dtype=dtype, device=DEVICE)
    glse = torch.empty(B, NH, T, dtype=torch.float32, device=DEVICE)
    ka.attention_forward(gout, glse, gq, gk, gv, NH, tuner=TUNER)
    compare("out", gout, out, dtype)
    compare("lse", glse, lse, dtype)
    gd = {n: t(x, dtype) for n, x in d0.items()}
    delta = torch.empty(B * NH * T, dtype=torch.float32, device=DEVICE)
    # backward from the reference's out (rounded like the kernel's): isolates the backward's own error
    ka.attention_backward(
        gd["dq"], gd["dk"], gd["dv"], t(dout, dtype), gq, gk, gv, t(out, dtype), glse, NH, delta=delta, tuner=TUNER
    )
    for n in d:
        compare(n, gd[n], d[n], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B,Tmax,C,NH,pos,n",
    [
        (2, 40, 24, 2, 33, 1),
        (1, 48, 16, 2, 9, 21),
        (2, 20, 8, 1, 0, 20),
        (2, 40, 256, 2, 21, 1),
        (1, 50, 256, 2, 13, 19),
    ],
)
def test_attention_cached(B: int, Tmax: int, C: int, NH: int, pos: int, n: int, dtype: torch.dtype) -> None:
    """The inference step's attention over the KV cache against the NumPy pair's (decode, a window inside the
    sequence, a prefill filling the cache; head size 128 too); the cache past pos + n holds noise the kernel must
    not read."""
    rng = np.random.default_rng(B * Tmax + pos + n)
    q = rounded(rng.standard_normal((B, n, C)), dtype)
    kc, vc = (rounded(rng.standard_normal((B, Tmax, C)), dtype) for _ in range(2))
    out = np.empty((B, n, C))
    ref.attention_forward_cached(out, q, kc, vc, pos, NH)
    gk, gv = t(kc, dtype), t(vc, dtype)
    gk[:, pos + n :], gv[:, pos + n :] = 1e4, -1e4
    gout = torch.full((B, n, C), float("nan"), dtype=dtype, device=DEVICE)
    ka.attention_forward_cached(gout, t(q, dtype), gk, gv, pos, NH)
    compare("out", gout, out, dtype)
