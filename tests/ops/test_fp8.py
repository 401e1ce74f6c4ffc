"""precision "fp8": the scale rule, the E4M3 cast, the amax histories, and the linear and MLP pairs with E4M3
operands against PyTorch autograd in float64 on operands torch quantizes itself at the scale the rule gives (the
NumPy reference specifies what the GPU computes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt import fp8
from microgpt.fp8 import Fp8Weight
from microgpt.ops import fp8 as ref
from microgpt.ops.crossentropy import crossentropy_backward, crossentropy_forward, crossentropy_forward_backward
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


def slot(history: list[float] | None = None) -> np.ndarray:
    """An operand's slot, its history as given (newest first)."""
    s = np.zeros(fp8.OSLOT, np.float32)
    if history:
        s[fp8.HIST : fp8.HIST + len(history)] = history
    return s


def torch_e4m3(x: np.ndarray, k: int) -> np.ndarray:
    """torch's E4M3 conversion of clamp(x * 2^k, +-448) (an independent implementation), as bytes."""
    y = torch.from_numpy(np.asarray(x, np.float32) * np.float32(2.0**k)).clamp(-448, 448)
    return y.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_cast_is_the_rounding_torch_does_at_that_scale() -> None:
    """q = E4M3(x * 2^k), round to nearest even, the largest magnitude within 448: ml_dtypes' bytes are
    torch's for normals, subnormals, signed zeros and ties; a current cast records the amax twice (pre, amax)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 3.7, rng.standard_normal(500) * 1e-4, [0.0, -0.0]])
    x = np.concatenate([x, (np.arange(-64, 64) + 0.5) * 2.0**-12]).astype(np.float32)  # ties among subnormals
    s = slot()
    q, inv = ref.cast(x, s, current=True)
    amax = np.abs(x).max()
    k = fp8.scale_exponent(float(amax))
    assert inv == np.float32(2.0**-k) and s[: fp8.HIST].tolist() == [2.0**-k, amax, amax, 0]
    np.testing.assert_array_equal(q.view(np.uint8), torch_e4m3(x, k))
    back = q.astype(np.float32) * inv
    assert np.abs(q.astype(np.float32)).max() <= 448.0
    normal = np.abs(x) * 2.0**k >= 2.0**-6
    assert np.all(np.abs(back - x)[normal] <= np.abs(x)[normal] * 2.0**-4)  # 3 mantissa bits: half an ulp


def test_delayed_cast_scales_by_the_history_and_saturates() -> None:
    """Without priming the scale comes from the largest amax in the history, not from x: values beyond it
    saturate at +-448, smaller ones lose precision to the wider range; inf and NaN become NaN (0x7F), and only
    finite values reach the recorded amax."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(3000) * 5).astype(np.float32)
    x[:3] = [np.inf, -np.inf, np.nan]
    for hist in ([2.0, 9.0, 1.0], [40.0], [3e-3, 1e-3]):
        s = slot(hist)
        q, inv = ref.cast(x, s)
        k = fp8.scale_exponent(max(hist))
        assert inv == np.float32(2.0**-k)
        finite = np.isfinite(x)
        np.testing.assert_array_equal(q.view(np.uint8)[finite], torch_e4m3(x[finite], k))
        assert q.view(np.uint8)[:3].tolist() == [0x7F] * 3
        assert s[fp8.AMAX] == np.abs(x[finite]).max() and s[fp8.PRE] == 0
        if max(hist) < np.abs(x[finite]).max():
            assert np.abs(q.astype(np.float32)[finite]).max() == 448.0  # saturated, not NaN


def test_roll_pushes_the_amax_and_forgets_on_request() -> None:
    """Each micro-batch's amax becomes the newest entry; after HISTORY more the oldest is gone; the scale follows
    the largest entry still held. roll(shift=False) (evaluation) clears what was met and keeps the history."""
    slots = np.zeros((2, 3, fp8.OSLOT), np.float32)
    amaxes = np.linspace(1.0, 50.0, fp8.HISTORY + 3).astype(np.float32)[::-1]  # decreasing: the first is the largest
    for i, a in enumerate(amaxes):
        x = np.array([a, -a / 2], np.float32)
        _, inv = ref.cast(x, slots[1, 2], current=(i == 0))
        want = amaxes[0] if i <= fp8.HISTORY else amaxes[i - fp8.HISTORY]  # the largest of the last HISTORY
        assert inv == np.float32(2.0 ** -fp8.scale_exponent(float(want))), i
        ref.Matmul(None).roll(slots)
        held = amaxes[max(0, i - fp8.HISTORY + 1) : i + 1][::-1]
        np.testing.assert_array_equal(slots[1, 2, fp8.HIST : fp8.HIST + len(held)], held)
        assert slots[1, 2, fp8.PRE] == slots[1, 2, fp8.AMAX] == 0
    assert not slots[0].any() and not slots[1, :2].any()  # only the slot that was cast into moved
    before = slots.copy()
    ref.cast(np.array([1e4], np.float32), slots[1, 2])
    ref.Matmul(None).roll(slots, shift=False)
    np.testing.assert_array_equal(slots[..., 1:], before[..., 1:])


def dq(a: np.ndarray, inv: float) -> torch.Tensor:
    """E4M3 values times their inverse scale, as a float64 torch leaf: the operand the GEMM multiplies."""
    return torch.tensor(a.astype(np.float64) * float(inv), requires_grad=True)


def tq(x: np.ndarray | torch.Tensor, amax: float) -> torch.Tensor:
    """x quantized by torch at the scale the rule gives for amax, in float64, as a leaf."""
    k = fp8.scale_exponent(float(np.float32(amax)))
    q = torch.from_numpy(torch_e4m3(np.asarray(x, np.float32), k)).view(torch.float8_e4m3fn)
    return (q.to(torch.float64) * 2.0**-k).requires_grad_()


def weight(
    rng: np.random.Generator, G: int, C: int, OC: int, priming: bool = True, histories: tuple[float, float] = (0.0, 0.0)
) -> Fp8Weight:
    """A site's weight with its E4M3 copies cast; its input's and output gradient's slots hold the given history
    (one entry each; priming: none)."""
    master = (rng.standard_normal((G, C, OC)) * 0.3).astype(np.float32)
    w = Fp8Weight(
        "w",
        master,
        np.zeros((C, G * OC), E4M3),
        np.zeros((G, OC, C), E4M3),
        np.zeros(fp8.SLOT, np.float32),
        slot([histories[0]]),
        slot([histories[1]]),
        fp8.Priming(priming),
    )
    ref.Matmul(None).cast_weights([w])
    return w


def test_cast_weights_writes_both_layouts_of_one_quantization() -> None:
    rng = np.random.default_rng(1)
    w = weight(rng, 3, 8, 5)
    amax = np.abs(w.master).max()
    k = fp8.scale_exponent(float(amax))
    assert w.scale.tolist() == [2.0**-k, amax, amax, 0]
    q = torch_e4m3(w.master, k)
    for g in range(3):
        np.testing.assert_array_equal(w.w8[:, g * 5 : (g + 1) * 5].view(np.uint8), q[g])
        np.testing.assert_array_equal(w.w8t[g].T.view(np.uint8), q[g])


# delayed: the histories are 0.6x and 2.5x the operands' own amaxes (x saturates, dout loses range)
SCALING = {"primed": None, "delayed": (0.6, 2.5)}


@pytest.mark.parametrize("scaling", SCALING)
@pytest.mark.parametrize("G,N,C,OC", [(1, 21, 12, 36), (3, 17, 16, 16), (1, 5, 7, 3)])
def test_linear_fp8_against_torch_float64(G: int, N: int, C: int, OC: int, scaling: str) -> None:
    """Forward and both backward GEMMs on the E4M3 operands: x, dout (one scale over the G gradients) and w, each
    at its slot's scale (primed: its own amax; delayed: the history's)."""
    rng = np.random.default_rng(10 + G * N)
    x = rng.standard_normal((N, C)).astype(np.float32)
    shape = (N, OC) if G == 1 else (G, N, OC)
    dout = rng.standard_normal(shape).astype(np.float32) * 0.1
    f = SCALING[scaling]
    ax, ad = float(np.abs(x).max()), float(np.abs(dout).max())
    hx, hd = (ax, ad) if f is None else (ax * f[0], ad * f[1])
    w = weight(rng, G, C, OC, priming=f is None, histories=(0.0, 0.0) if f is None else (hx, hd))
    out = np.zeros(shape, np.float32)
    linear_forward(out, x, w, mm=ref.Matmul(None))
    dx = rng.standard_normal((N, C)).astype(np.float32)  # noise: backward writes dx
    noise = rng.standard_normal(w.master.shape if G > 1 else (C, OC)).astype(np.float32)
    dw = noise.copy()
    linear_backward(dx, dw, dout, x, w, mm=ref.Matmul(None))
    assert w.xslot[fp8.AMAX] == np.float32(ax) and w.gslot[fp8.AMAX] == np.float32(ad)  # recorded for the roll

    xq, wq = tq(x, hx), tq(w.master, np.abs(w.master).max())
    dq_all = tq(ref.groups(dout, G), hd).detach()
    want = torch.stack([xq @ wq[g] for g in range(G)])
    want.backward(torch.stack([dq_all[:, g * OC : (g + 1) * OC] for g in range(G)]))
    check("out", out.reshape(G, N, OC), want, 1e-6)
    check("dx", dx, xq.grad, 1e-6)
    check("dw", (dw - noise).reshape(G, C, OC), wq.grad, 1e-6)


@pytest.mark.parametrize("scaling", SCALING)
@pytest.mark.parametrize("N,C", [(19, 8), (4, 16)])
def test_mlp_fp8_against_torch_float64(N: int, C: int, scaling: str) -> None:
    """gelu(x @ w1) @ w2 with E4M3 x, a = gelu(h), w1, w2 and, backward, E4M3 dout and dh. The float64 side
    quantizes its own a and dh at the scales the reference used; fp32 against float64 may round a rare element to
    a neighbouring E4M3 value, hence a tolerance above the linear pair's."""
    rng = np.random.default_rng(20 + N)
    w1, w2 = weight(rng, 1, C, 4 * C), weight(rng, 1, 4 * C, C)
    x = rng.standard_normal((N, C)).astype(np.float32)
    dout = rng.standard_normal((N, C)).astype(np.float32) * 0.1
    f = SCALING[scaling]
    if f is not None:  # histories: the amaxes a primed pass over the same inputs met, moved by the factors
        out, h, a, dh = (np.zeros(s, np.float32) for s in [(N, C), (N, 4 * C), (N, 4 * C), (N, 4 * C)])
        mlp_forward(out, h, a, x, w1, w2, mm=ref.Matmul(None))
        mlp_backward(
            np.zeros((N, C), np.float32),
            np.zeros((C, 4 * C), np.float32),
            np.zeros((4 * C, C), np.float32),
            dout,
            x,
            h,
            w1,
            w2,
            a,
            dh,
            mm=ref.Matmul(None),
            recompute=False,
        )
        for w in (w1, w2):
            for s, fac in ((w.xslot, f[0]), (w.gslot, f[1])):
                s[fp8.HIST] = s[fp8.AMAX] * fac
                s[fp8.PRE] = s[fp8.AMAX] = 0
            w.priming.on = False
    hist = {(i, j): w.xslot if j == "x" else w.gslot for i, w in ((1, w1), (2, w2)) for j in "xg"}
    out, h, a, dh = (np.zeros(s, np.float32) for s in [(N, C), (N, 4 * C), (N, 4 * C), (N, 4 * C)])
    mlp_forward(out, h, a, x, w1, w2, mm=ref.Matmul(None))
    dx = rng.standard_normal((N, C)).astype(np.float32)  # noise: backward writes dx
    dw1, dw2 = np.zeros((C, 4 * C), np.float32), np.zeros((4 * C, C), np.float32)
    mlp_backward(dx, dw1, dw2, dout, x, h, w1, w2, a, dh, mm=ref.Matmul(None), recompute=False)

    def scale_of(i: int, j: str) -> float:  # the amax the reference scaled by: its own (primed), or the history's
        s = hist[(i, j)]
        return float(s[fp8.PRE] if f is None else s[fp8.HIST])

    xq, w1q, w2q = tq(x, scale_of(1, "x")), tq(w1.master[0], w1.scale[1]), tq(w2.master[0], w2.scale[1])
    ht = (xq @ w1q).detach().requires_grad_()
    at = F.gelu(ht, approximate="tanh")
    aq = tq(at.detach().numpy(), scale_of(2, "x"))
    want = aq @ w2q
    want.backward(tq(dout, scale_of(2, "g")).detach())
    at.backward(aq.grad)  # dh = (dout @ w2.T) * gelu'(h)
    dhq = tq(ht.grad.numpy(), scale_of(1, "g")).detach()
    (xq @ w1q).backward(dhq)  # the first linear's backward from the E4M3 dh
    check("h", h, ht, 1e-6)
    check("out", out, want, 2e-3)
    check("dw2", dw2, w2q.grad, 2e-3)
    check("dw1", dw1, w1q.grad, 2e-3)
    check("dx", dx, xq.grad, 2e-3)


def head(rng: np.random.Generator, V: int, C: int) -> fp8.Fp8Head:
    """An LM head with its E4M3 copy cast (the NumPy backend's: the compute copy is the fp32 masters)."""
    wte = (rng.standard_normal((V, C)) * 0.5).astype(np.float32)
    hd = fp8.Fp8Head(wte, wte, np.zeros((V, C), E4M3), np.zeros(fp8.SLOT, np.float32), np.zeros(fp8.SLOT, np.float32))
    ref.Matmul(None).cast_weights([hd])
    return hd


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("N,C,V,R", [(21, 16, 48, 8), (9, 8, 33, 9), (6, 32, 16, 64)])
def test_head_fp8_against_torch_float64(N: int, C: int, V: int, R: int, fused: bool) -> None:
    """The LM head in fp8: the logits from E4M3 x (its own amax) and E4M3 wte (the optimizer step's copy), the
    losses, lse and both gradients from those logits, the gradient GEMMs on the exact x and wte. The float64 side
    takes the logits' value from its own E4M3 operands and their gradient through the exact ones (a straight-through
    sum); chunks of R rows, ignored rows, and the forward then backward pair as well as the fused call."""
    rng = np.random.default_rng(N * V + R)
    hd = head(rng, V, C)
    x = rng.standard_normal((N, C)).astype(np.float32)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[::4] = -1
    dlosses = rng.standard_normal(N).astype(np.float32)
    losses, lse = np.zeros(N, np.float32), np.zeros(N, np.float32)
    dx = rng.standard_normal((N, C)).astype(np.float32)  # noise: the head adds into both gradients
    dwte = rng.standard_normal((V, C)).astype(np.float32)
    dx0, dwte0 = dx.copy(), dwte.copy()
    logits = np.zeros((R, V), np.float32)
    mm = ref.Matmul(hd)  # the head's logits GEMM in E4M3; its gradient GEMMs read the compute copy hd.w
    if fused:
        crossentropy_forward_backward(losses, lse, dx, dwte, dlosses, x, hd.w, targets, logits, mm=mm)
    else:
        crossentropy_forward(losses, lse, x, hd.w, targets, logits, mm=mm)
        crossentropy_backward(dx, dwte, dlosses, x, hd.w, targets, lse, logits, mm=mm)
    ax, aw = np.abs(x).max(), np.abs(hd.master).max()
    assert hd.xslot.tolist() == [2.0 ** -fp8.scale_exponent(float(ax)), ax, ax, 0]  # current scaling: its own amax
    np.testing.assert_array_equal(hd.w8.view(np.uint8), torch_e4m3(hd.master, fp8.scale_exponent(float(aw))))

    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(hd.w, dtype=torch.float64, requires_grad=True)
    exact = xt @ wt.T
    z = (tq(x, ax) @ tq(hd.master, aw).T).detach() + exact - exact.detach()  # E4M3 value, exact gradient
    tgt = torch.from_numpy(targets).long()
    want = F.cross_entropy(z, tgt, reduction="none", ignore_index=-1)
    (want * torch.from_numpy(dlosses.astype(np.float64))).sum().backward()
    check("losses", losses, want, 1e-6)
    check("lse", lse, torch.logsumexp(z, dim=1), 1e-6)
    check("dx", dx - dx0, xt.grad, 1e-5)
    check("dwte", dwte - dwte0, wt.grad, 1e-5)
    exact_losses = F.cross_entropy(exact.detach(), tgt, reduction="none", ignore_index=-1).numpy()
    assert not np.allclose(losses, exact_losses, rtol=1e-5, atol=0), "the logits must come from the E4M3 operands"
