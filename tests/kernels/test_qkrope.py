"""qkrope kernels (k_qkrope_fwd, k_qkrope_bwd) against the NumPy pair, on q and k views strided inside a projection
buffer: the (3, N, C) buffer's [0] and [1] as the model hands them in, and columns of a (b, t, 3C) buffer (rows 3C
apart); v, the buffer's third part, must come out untouched."""

import numpy as np
import pytest
import torch

from microgpt.kernels import qkrope as kq
from microgpt.ops import qkrope as ref

from ._kutil import DEVICE, DTYPES, compare, h, rounded, t

# (b, t, H, D, pos): one row; odd t with three heads; D 128 (H 6 is the modern ANDREA-120M's) past position 0; D 2;
# D 12 and 96, whose halves (6, 48 lanes) leave lanes of the tile masked
SHAPES = [(1, 1, 1, 2, 0), (2, 7, 3, 8, 0), (2, 5, 6, 128, 9), (1, 3, 2, 128, 0), (3, 2, 1, 2, 5), (2, 3, 3, 12, 4),
          (1, 4, 2, 96, 0)]  # fmt: skip


def parts(buf, C: int, interleaved: bool):
    """q, k, v (b, t, C) views of a projection buffer: (3, b, t, C) -> [i], or (b, t, 3C) -> its column blocks."""
    if interleaved:
        return buf[:, :, :C], buf[:, :, C : 2 * C], buf[:, :, 2 * C :]
    return buf[0], buf[1], buf[2]


@pytest.mark.parametrize("interleaved", [False, True], ids=["qkv-3NC", "rows-3C"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,T,H,D,pos", SHAPES)
def test_qkrope(b: int, T: int, H: int, D: int, pos: int, dtype: torch.dtype, interleaved: bool) -> None:
    """The forward at pos against the NumPy forward (q, k rewritten in place, rstd); then, from the NumPy forward's
    outputs (rounded as the kernel's would be) and rstd, the backward at position 0 against the NumPy backward."""
    rng = np.random.default_rng(b * T * H + D + pos)
    C = H * D
    shape = (b, T, 3 * C) if interleaved else (3, b, T, C)
    buf = rounded(rng.standard_normal(shape) * 1.5 + 0.3, dtype)
    rope = ref.rope_tables(pos + T + 2, D)
    grope = t(rope)
    gbuf = t(buf, dtype)
    q, k, v = parts(buf, C, interleaved)
    rstd = np.empty((2, b * T, H))
    ref.qkrope_forward(q, k, rstd, rope, n_head=H, pos=pos)
    gq, gk, gv = parts(gbuf, C, interleaved)
    grstd = torch.full((2, b * T, H), float("nan"), device=DEVICE)
    kq.qkrope_forward(gq, gk, grstd, grope, n_head=H, pos=pos)
    compare("q", gq, q, dtype)
    compare("k", gk, k, dtype)
    compare("rstd", grstd, rstd, dtype)
    np.testing.assert_array_equal(h(gv), v)

    # backward at position 0, from the forward's outputs there
    buf = rounded(rng.standard_normal(shape) * 1.5 + 0.3, dtype)
    q, k, _ = parts(buf, C, interleaved)
    ref.qkrope_forward(q, k, rstd, rope, n_head=H)
    buf = rounded(buf, dtype)
    q, k, _ = parts(buf, C, interleaved)
    gbuf, grstd = t(buf, dtype), t(rstd.astype(np.float32))
    gq, gk, gv = parts(gbuf, C, interleaved)
    dshape = (3, b, T, C)  # the gradients as the model holds them: dqkv (3, N, C)
    dbuf = rounded(rng.standard_normal(dshape), dtype)
    gdbuf = t(dbuf, dtype)
    ref.qkrope_backward(dbuf[0], dbuf[1], q, k, h(grstd), rope, n_head=H)
    kq.qkrope_backward(gdbuf[0], gdbuf[1], gq, gk, grstd, grope, n_head=H)
    compare("dq", gdbuf[0], dbuf[0], dtype)
    compare("dk", gdbuf[1], dbuf[1], dtype)
    np.testing.assert_array_equal(h(gdbuf[2]), dbuf[2])
    np.testing.assert_array_equal(h(gv), buf[..., 2 * C :] if interleaved else buf[2])


def test_views_must_split_into_even_heads() -> None:
    """An odd head size, q's columns not adjacent, or positions past the table are refused before anything is
    launched."""
    q = torch.zeros(1, 2, 12, device=DEVICE)
    rstd, rope = torch.zeros(2, 2, 4, device=DEVICE), t(ref.rope_tables(2, 6))
    with pytest.raises(ValueError, match="even size"):
        kq.qkrope_forward(q, q, rstd, rope, n_head=4)  # D = 3
    with pytest.raises(ValueError, match="unit column stride"):
        kq.qkrope_forward(q, torch.zeros(1, 12, 2, device=DEVICE).transpose(1, 2), rstd, rope, n_head=2)
    with pytest.raises(ValueError, match="past the rope table"):
        kq.qkrope_forward(q, q, rstd, rope, n_head=2, pos=1)
