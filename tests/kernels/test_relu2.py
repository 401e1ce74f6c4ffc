"""relu2 kernels (k_relu2_fwd, also in place; k_relu2_bwd in place, from a) against the NumPy pair, and the slope
2 sqrt(a), its root rounded to a's dtype, against 2 max(h, 0) over every bf16 and fp16 value."""

import numpy as np
import pytest
import torch

from microgpt.kernels import relu2 as kr
from microgpt.ops import relu2 as ref

from ._kutil import DEVICE, DTYPES, ON_GPU, compare, rounded, t

SHAPES = [(7, 37), (33, 64), (1, 5), (3, 1500)]  # (N, 4C): 4500 elements span three programs, the last one short


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,F", SHAPES)
def test_relu2(N: int, F: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(N * F + 3)
    h, da = rounded(rng.standard_normal((N, F)) * 2 - 0.3, dtype), rounded(rng.standard_normal((N, F)), dtype)
    h.flat[::11] = 0.0
    a, dh = np.empty((N, F)), da.copy()
    ref.relu2_forward(a, h)
    ref.relu2_backward_h(dh, h)  # the float64 reference from h: the kernel's from a must round to it

    ga, gdh = t(rng.standard_normal((N, F)), dtype), t(da, dtype)  # ga: noise the forward overwrites
    kr.relu2_forward(ga, t(h, dtype))
    kr.relu2_backward(gdh, ga)
    compare("a", ga, a, dtype)
    compare("dh", gdh, dh, dtype)
    over = t(h, dtype)
    kr.relu2_forward(over, over)  # in place: a over h
    assert torch.equal(over, ga)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's squares past the dtype's range: inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_slope_from_a_is_max_h_0_over_every_value(dtype: torch.dtype) -> None:
    """k_relu2_bwd from a = relu2(h) gives dh = 2 max(h, 0) (da = 1) bit for bit for every finite h of the dtype
    whose square is a normal number (ops/relu2.py: bf16 from 2^-63, fp16 in [2^-7, 256)); and where a is an fp16
    subnormal, within 2^-11.5. Bit for bit where fp32 -> bf16 rounds to nearest (the GPU's cvt.rn); Triton's
    interpreter truncates that cast (cast_impl passes no rounding mode; its fp16 casts are NumPy's, to nearest), so
    there a bf16 slope whose fp32 root lies just under r is one unit in its last place lower."""
    h = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    h = h[h.float().isfinite()].to(DEVICE).contiguous()
    a, dh = torch.empty_like(h), torch.ones_like(h)
    kr.relu2_forward(a, h)
    kr.relu2_backward(dh, a)
    want = 2 * h.float().clamp_min(0)
    normal = (a.float() >= torch.finfo(dtype).tiny) & a.float().isfinite()
    if ON_GPU or dtype == torch.float16:
        assert torch.equal(dh.float()[normal], want[normal])
    else:
        ulp = torch.exp2(torch.floor(torch.log2(want[normal])) - 7)
        assert torch.isin((want[normal] - dh.float()[normal]) / ulp, torch.tensor([0.0, 1.0])).all()
    low = h.float() < 2 ** (-7 if dtype == torch.float16 else -63)
    assert (dh.float() - want)[low].abs().max().item() <= 2**-11.5
    assert normal[~low & (h.float() < (256.0 if dtype == torch.float16 else 2.0**64))].all()
