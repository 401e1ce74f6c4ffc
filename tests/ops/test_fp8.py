"""precision "fp8": the scale rule, the E4M3 cast, and the linear and MLP pairs with E4M3 operands against PyTorch
autograd in float64 on the same quantized operands (the NumPy reference specifies what the GPU computes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt import fp8
from microgpt.fp8 import Fp8Weight
from microgpt.ops import fp8 as ref
from microgpt.ops.linear import linear_backward, linear_forward
from microgpt.ops.mlp import mlp_backward, mlp_forward

from ._util import check

E4M3 = ref.e4m3()


@pytest.mark.parametrize("seed", range(3))
def test_scale_is_the_largest_power_of_two_that_fits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    amaxes = np.exp(rng.uniform(-80, 80, 2000)).tolist() + [448.0, 448.0 * (1 + 2**-23), 1.75, 0.875 * 2**-3, 1e-45]
    for amax in amaxes:
        k = fp8.scale_exponent(amax)
        assert fp8.K_MIN <= k <= fp8.K_MAX
        assert amax * 2.0**k <= fp8.E4M3_MAX, amax
        assert k == fp8.K_MAX or amax * 2.0 ** (k + 1) > fp8.E4M3_MAX, amax
    assert fp8.scale_exponent(0.0) == 0 and fp8.scale_exponent(448.0) == 0 and fp8.scale_exponent(449.0) == -1


def test_quantize_is_the_rounding_torch_does_at_that_scale() -> None:
    """q = E4M3(x * 2^k), round to nearest even, the largest magnitude within 448: ml_dtypes' bytes are
    torch's (an independent E4M3 implementation) for normals, subnormals, signed zeros and ties."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 3.7, rng.standard_normal(500) * 1e-4, [0.0, -0.0]])
    x = np.concatenate([x, (np.arange(-64, 64) + 0.5) * 2.0**-12]).astype(np.float32)  # ties among subnormals
    q, inv = ref.quantize(x)
    k = fp8.scale_exponent(float(np.abs(x).max()))
    assert inv == np.float32(2.0**-k)
    want = torch.from_numpy(x * np.float32(2.0**k)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(q.view(np.uint8), want)
    back = q.astype(np.float32) * inv
    assert np.abs(q.astype(np.float32)).max() <= 448.0
    normal = np.abs(x) * 2.0**k >= 2.0**-6
    assert np.all(np.abs(back - x)[normal] <= np.abs(x)[normal] * 2.0**-4)  # 3 mantissa bits: half an ulp


def dq(a: np.ndarray, inv: float) -> torch.Tensor:
    """E4M3 values times their inverse scale, as a float64 torch leaf: the operand the GEMM multiplies."""
    return torch.tensor(a.astype(np.float64) * float(inv), requires_grad=True)


def weight(rng: np.random.Generator, G: int, C: int, OC: int) -> Fp8Weight:
    master = (rng.standard_normal((G, C, OC)) * 0.3).astype(np.float32)
    w = Fp8Weight("w", master, np.zeros((C, G * OC), E4M3), np.zeros((G, OC, C), E4M3), np.zeros(fp8.SLOT, np.float32))
    ref.cast_weights([w])
    return w


def test_cast_weights_writes_both_layouts_of_one_quantization() -> None:
    rng = np.random.default_rng(1)
    w = weight(rng, 3, 8, 5)
    q, inv = ref.quantize(w.master)
    assert w.scale.tolist() == [inv, np.abs(w.master).max(), 0, 0]
    for g in range(3):
        np.testing.assert_array_equal(w.w8[:, g * 5 : (g + 1) * 5].view(np.uint8), q[g].view(np.uint8))
        np.testing.assert_array_equal(w.w8t[g].T.view(np.uint8), q[g].view(np.uint8))


@pytest.mark.parametrize("G,N,C,OC", [(1, 21, 12, 36), (3, 17, 16, 16), (1, 5, 7, 3)])
def test_linear_fp8_against_torch_float64(G: int, N: int, C: int, OC: int) -> None:
    """Forward and both backward GEMMs on the E4M3 operands: x, dout (one scale over the G gradients) and w."""
    rng = np.random.default_rng(10 + G * N)
    w = weight(rng, G, C, OC)
    x = rng.standard_normal((N, C)).astype(np.float32)
    shape = (N, OC) if G == 1 else (G, N, OC)
    dout = rng.standard_normal(shape).astype(np.float32) * 0.1
    out = np.zeros(shape, np.float32)
    linear_forward(out, x, w)
    dx = rng.standard_normal((N, C)).astype(np.float32)  # noise: backward writes dx
    noise = rng.standard_normal(w.master.shape if G > 1 else (C, OC)).astype(np.float32)
    dw = noise.copy()
    linear_backward(dx, dw, dout, x, w)

    xq, wq = dq(*ref.quantize(x)), dq(*ref.quantize(w.master))
    d8, dinv = ref.quantize(ref.groups(dout, G))
    dq_all = torch.tensor(d8.astype(np.float64) * float(dinv))
    want = torch.stack([xq @ wq[g] for g in range(G)])
    want.backward(torch.stack([dq_all[:, g * OC : (g + 1) * OC] for g in range(G)]))
    check("out", out.reshape(G, N, OC), want, 1e-6)
    check("dx", dx, xq.grad, 1e-6)
    check("dw", (dw - noise).reshape(G, C, OC), wq.grad, 1e-6)


@pytest.mark.parametrize("N,C", [(19, 8), (4, 16)])
def test_mlp_fp8_against_torch_float64(N: int, C: int) -> None:
    """gelu(x @ w1) @ w2 with E4M3 x, a = gelu(h), w1, w2 and, backward, E4M3 dout and dh. The float64 side casts
    its own a and dh with the same rule; fp32 against float64 may round a rare element to a neighbouring E4M3
    value, hence a tolerance above the linear pair's."""
    rng = np.random.default_rng(20 + N)
    w1, w2 = weight(rng, 1, C, 4 * C), weight(rng, 1, 4 * C, C)
    x = rng.standard_normal((N, C)).astype(np.float32)
    dout = rng.standard_normal((N, C)).astype(np.float32) * 0.1
    out, h, a, dh = (np.zeros(s, np.float32) for s in [(N, C), (N, 4 * C), (N, 4 * C), (N, 4 * C)])
    mlp_forward(out, h, a, x, w1, w2)
    dx = rng.standard_normal((N, C)).astype(np.float32)  # noise: backward writes dx
    dw1, dw2 = np.zeros((C, 4 * C), np.float32), np.zeros((4 * C, C), np.float32)
    mlp_backward(dx, dw1, dw2, dout, x, h, w1, w2, a, dh)

    xq, w1q, w2q = dq(*ref.quantize(x)), dq(*ref.quantize(w1.master[0])), dq(*ref.quantize(w2.master[0]))
    ht = (xq @ w1q).detach().requires_grad_()
    at = F.gelu(ht, approximate="tanh")
    aq = dq(*ref.quantize(at.detach().numpy()))
    want = aq @ w2q
    want.backward(dq(*ref.quantize(dout)))
    at.backward(aq.grad)  # dh = (dout @ w2.T) * gelu'(h)
    dhq = dq(*ref.quantize(ht.grad.numpy()))
    (xq @ w1q).backward(dhq)  # the first linear's backward from the E4M3 dh
    check("h", h, ht, 1e-6)
    check("out", out, want, 2e-3)
    check("dw2", dw2, w2q.grad, 2e-3)
    check("dw1", dw1, w1q.grad, 2e-3)
    check("dx", dx, xq.grad, 2e-3)
