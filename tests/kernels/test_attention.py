"""attention kernels (flash style: k_attention_fwd, k_attention_bwd_delta, k_attention_bwd) against the NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import attention as ka
from microgpt.ops import attention as ref

from ._kutil import DEVICE, DTYPES, TUNER, compare, rounded, t

# (B, T, C, NH): hs = 12 (padded to 16 lanes), 16, 4; T not a multiple of the tiles; T = 1
SHAPES = [(2, 37, 24, 2), (1, 64, 32, 2), (2, 5, 8, 2), (1, 1, 16, 1)]


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
    ka.attention_backward(gd["dq"], gd["dk"], gd["dv"], t(dout, dtype), gq, gk, gv, t(out, dtype), glse, NH,
                          delta=delta, tuner=TUNER)  # fmt: skip
    for n in d:
        compare(n, gd[n], d[n], dtype)
