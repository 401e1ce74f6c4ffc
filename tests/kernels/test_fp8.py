"""precision "fp8" on the triton backend: the E4M3 casts byte for byte, and the FP8 linear and MLP pairs against
the NumPy reference (microgpt/ops/fp8.py). In CI the Triton interpreter runs them (casts, and the scaled GEMM as
our tile kernel) with fp32 activations, where both sides cast the very same values and only the order of the fp32
sums differs; on the GPU (MICROGPT_TEST_GPU=1) the same tests run cuBLASLt's FP8 GEMM, plus bf16 activations as
trained (bf16 is broken in the interpreter: kernels/_kutil.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from microgpt import fp8
from microgpt.fp8 import Fp8Weight
from microgpt.kernels import fp8 as k8
from microgpt.kernels import fp8_cast as kc
from microgpt.kernels import linear as klinear
from microgpt.kernels import mlp as kmlp
from microgpt.kernels.tuning import Tuner
from microgpt.ops import fp8 as ref
from microgpt.ops import linear as rlinear
from microgpt.ops import mlp as rmlp
from microgpt.ops.rows import SERIAL

from ._kutil import DEVICE, GEMM, ON_GPU, TUNER, check, h, rounded, t

F8 = torch.float8_e4m3fn
# activations as the kernels get them: fp32 everywhere, bf16 (the fp8 runs' compute dtype) on the GPU
ACTS = [torch.float32] + ([torch.bfloat16] if ON_GPU else [])
# fp32 outputs: the interpreter's sums are fp32 ones; Hopper's FP8 tensor cores add the products in a narrower
# accumulator that cuBLASLt promotes to fp32 every few K-blocks (measured: rel err 3.6e-5 to 1.3e-4)
TOL = {torch.float32: 5e-4 if ON_GPU else 1e-5, torch.bfloat16: 2e-2}


def bytes_of(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.uint8).cpu().numpy()


def oslot(history: list[float] | None = None) -> np.ndarray:
    s = np.zeros(fp8.OSLOT, np.float32)
    if history:
        s[fp8.HIST : fp8.HIST + len(history)] = history
    return s


def test_cast_matches_torch_byte_for_byte() -> None:
    """A primed cast (the amax launch, then the cast) against torch's own E4M3 conversion of x * 2^k: normals,
    subnormals, ties, signed zeros, in both layouts, G = 3 blocks side by side; the slot holds
    [2^-k, amax, amax, 0] and no history."""
    rng = np.random.default_rng(0)
    G, R, C = 3, 48, 32
    x = (rng.standard_normal((G, R, C)) * 2.3).astype(np.float32)
    x[0, 0, :16] = (np.arange(16) + 0.5) * 2.0**-11  # ties at the subnormal step once scaled
    x[1, 1, :4] = [0.0, -0.0, 1e-30, -1e-30]
    slot = torch.zeros(fp8.OSLOT, device=DEVICE)
    rows, trans = torch.empty(R, G * C, dtype=F8, device=DEVICE), torch.empty(G, C, R, dtype=F8, device=DEVICE)
    kc.cast(TUNER, t(x), slot, rows, trans, prime=True)
    k = fp8.scale_exponent(float(np.abs(x).max()))
    want = torch.from_numpy(x * np.float32(2.0**k)).to(F8).view(torch.uint8).numpy()
    np.testing.assert_array_equal(bytes_of(rows), np.concatenate(list(want), axis=1))
    np.testing.assert_array_equal(bytes_of(trans), want.transpose(0, 2, 1))
    amax = np.abs(x).max()
    assert h(slot).tolist() == [2.0**-k, amax, amax, 0] + [0] * fp8.HISTORY


def test_cast_scale_follows_the_rule_at_the_edges() -> None:
    """The scale from the amax's bits equals fp8.scale_exponent for amaxes across the whole range."""
    for amax in [448.0, 449.0, 1.75, 1.7500001, 3e-20, 5e4, 2.0**-126, 1e-40, 3e38]:
        x = np.array([[amax, -amax / 3]], np.float32)
        slot = torch.zeros(fp8.OSLOT, device=DEVICE)
        kc.cast(TUNER, t(x), slot, torch.empty(1, 2, dtype=F8, device=DEVICE), None, prime=True)
        assert h(slot)[0] == 2.0 ** -fp8.scale_exponent(float(np.float32(amax))), amax


@pytest.mark.parametrize("config", ["32x32w4", "64x64w8", "64x64w1"])
@pytest.mark.parametrize("history", [[2.0, 9.0, 1.0], [40.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 77.0], [3e-3]])
def test_delayed_cast_matches_numpy_byte_for_byte(history: list[float], config: str, monkeypatch) -> None:
    """Scaled by the history (the largest of its 16 words): saturation at +-448 where x outgrew it, NaN for inf
    and NaN, and the slot's words (2^-k, the finite amax recorded) as the reference leaves them; with the
    transpose stored as 4-byte, 8-byte words and single bytes (40 rows: a partial tile of words)."""
    monkeypatch.setattr(kc, "CAST_CONFIGS", {config: kc.CAST_CONFIGS[config]})
    tuner = Tuner()  # its own: a choice the shared tuner made under another configuration table is not remembered
    rng = np.random.default_rng(len(history))
    x = (rng.standard_normal((40, 24)) * 5).astype(np.float32)
    x[3, :3] = [np.inf, -np.inf, np.nan]
    ns = oslot(history)
    want, _ = ref.cast(x, ns)
    slot = t(oslot(history))
    rows, trans = torch.empty(40, 24, dtype=F8, device=DEVICE), torch.empty(1, 24, 40, dtype=F8, device=DEVICE)
    kc.cast(tuner, t(x), slot, rows, trans)
    np.testing.assert_array_equal(bytes_of(rows), want.view(np.uint8))
    np.testing.assert_array_equal(bytes_of(trans)[0], want.view(np.uint8).T)
    assert h(slot).tolist() == ns.tolist()


@pytest.mark.parametrize("act", ["gelu", "relu2"])
@pytest.mark.parametrize("prime", [True, False])
def test_activation_casts_match_numpy(prime: bool, act: str) -> None:
    """The MLP's casts that compute their operand: a = act(h), dh = da * act'(h), against ops/linear.ACTIVATIONS in
    fp32 cast by the reference. GELU's two tanh differ in the last fp32 bit now and then, which can move an element
    to the neighbouring E4M3 value: at most one step, in a small fraction of elements; ReLU^2's arithmetic is the
    reference's, so its bytes are equal."""
    from microgpt.ops.linear import ACTIVATIONS

    rng = np.random.default_rng(7)
    hh = (rng.standard_normal((64, 48)) * 2).astype(np.float32)
    da = (rng.standard_normal((64, 48)) * 0.05).astype(np.float32)
    a, dh = np.empty_like(hh), da.copy()
    forward, backward = ACTIVATIONS[act]
    forward(a, hh, SERIAL)
    backward(dh, hh, SERIAL)
    fwd_op, bwd_op = kc.CAST_OPS[act]
    for op, y, x2 in ((fwd_op, a, None), (bwd_op, dh, da)):
        history = None if prime else [float(np.abs(y).max()) * 0.7]
        ns = oslot(history)
        want, _ = ref.cast(y, ns, current=prime)
        slot = t(oslot(history))
        rows, trans = torch.empty(64, 48, dtype=F8, device=DEVICE), torch.empty(1, 48, 64, dtype=F8, device=DEVICE)
        kc.cast(TUNER, t(hh), slot, rows, trans, prime, op=op, x2=None if x2 is None else t(x2))
        got = bytes_of(rows).astype(np.int16)
        np.testing.assert_array_equal(bytes_of(trans)[0].T, got)
        diff = np.abs((got & 0x7F) - (want.view(np.uint8).astype(np.int16) & 0x7F))
        assert diff.max() <= (1 if act == "gelu" else 0) and (diff > 0).mean() < 0.01, (op, diff.max())
        got_slot, want_slot = h(slot), ns
        assert got_slot[0] == want_slot[0], op  # the same scale
        np.testing.assert_allclose(got_slot[1:3], want_slot[1:3], rtol=1e-6)  # the amaxes met


@pytest.mark.skipif(not ON_GPU, reason="the GPU's conversion instruction (the interpreter runs the bits)")
def test_gpu_conversion_equals_the_bit_rule_for_every_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """k_cast's E4M3 byte by the GPU's conversion against _e4m3_bits, the rule the NumPy reference and the
    interpreter follow, for all 2^32 fp32 bit patterns (scale 1: history 448): tiles of finite values take the
    conversion alone, tiles with an inf or a NaN the clamped one with non-finite values made NaN (here the patterns
    of exponent 255 fill whole tiles; test_delayed_cast_matches_numpy_byte_for_byte mixes them with finite ones)."""
    rows, cols = 1 << 14, 1 << 12
    x = torch.empty(rows, cols, dtype=torch.int32, device=DEVICE)
    got, want = (torch.empty(rows, cols, dtype=F8, device=DEVICE) for _ in range(2))
    slot = t(oslot([448.0]))
    step = torch.arange(rows * cols, dtype=torch.int32, device=DEVICE).view(rows, cols)
    for chunk in range((1 << 32) // (rows * cols)):
        torch.add(step, chunk * rows * cols - (1 << 31), out=x)  # int32 wraps: every pattern once over the chunks
        for hw, out in ((True, got), (False, want)):
            monkeypatch.setattr(kc, "HW_CVT", hw)
            kc.cast(TUNER, x.view(torch.float32), slot, out, None)
        bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
        assert len(bad) == 0, (chunk, x[bad[0, 0], bad[0, 1]].item(), got.view(torch.uint8)[bad[0, 0], bad[0, 1]])


def test_roll_matches_numpy() -> None:
    rng = np.random.default_rng(3)
    slots = rng.uniform(0, 5, (2, 4, 2, fp8.OSLOT)).astype(np.float32)
    for shift in (True, False, True):
        ts = t(slots)
        matmul8(1, 1).roll(ts, shift)
        ref.Matmul(None).roll(slots, shift)
        np.testing.assert_array_equal(h(ts), slots)
        slots[..., fp8.PRE : fp8.AMAX + 1] = rng.uniform(0, 5, (2, 4, 2, 2))


def weights_pair(
    rng: np.random.Generator, G: int, C: int, OC: int, N: int, history: tuple[float, float] | None = None
) -> tuple[Fp8Weight, Fp8Weight]:
    """The same site's weights cast by the NumPy reference and by the kernels: the same bytes and scale (the
    kernels' site also holds its input's transposed E4M3 copy for N tokens, as the plan gives it). history: the
    one entry of its input's and output gradient's histories (None: priming)."""
    master = (rng.standard_normal((G, C, OC)) * 0.2).astype(np.float32)
    hx, hg = ([v] for v in history) if history is not None else (None, None)
    nw = Fp8Weight(
        "w",
        master,
        np.zeros((C, G * OC), ref.e4m3()),
        np.zeros((G, OC, C), ref.e4m3()),
        np.zeros(fp8.SLOT, np.float32),
        oslot(hx),
        oslot(hg),
        fp8.Priming(history is None),
    )
    tw = Fp8Weight(
        "w",
        t(master),
        torch.empty(C, G * OC, dtype=F8, device=DEVICE),
        torch.empty(G, OC, C, dtype=F8, device=DEVICE),
        torch.zeros(fp8.SLOT, device=DEVICE),
        t(oslot(hx)),
        t(oslot(hg)),
        fp8.Priming(history is None),
        torch.empty(C * N, dtype=F8, device=DEVICE),
    )
    ref.Matmul(None).cast_weights([nw])
    matmul8(1, 1).cast_weights([tw])
    np.testing.assert_array_equal(bytes_of(tw.w8), nw.w8.view(np.uint8))
    np.testing.assert_array_equal(bytes_of(tw.w8t), nw.w8t.view(np.uint8))
    assert h(tw.scale).tolist() == nw.scale.tolist()
    return nw, tw


def matmul8(N: int, C: int, head: fp8.Fp8Head | None = None) -> k8.Matmul:
    """fp8's GEMM sites over the planned scratch for N tokens of width C (as precision.Fp8.rows plans it)."""
    scratch = {name: torch.zeros(N * 4 * C, dtype=F8, device=DEVICE) for name in fp8.SCRATCH}
    return k8.Matmul(GEMM, head, {**scratch, "fp8_wgrad": torch.zeros(4 * C * C, device=DEVICE)})


# the histories' one entry for the delayed cases: x outgrew its history (saturates), dout did not
HISTORIES = {"primed": None, "delayed": (1.5, 0.9)}


@pytest.mark.parametrize("scaling", HISTORIES)
@pytest.mark.parametrize("dtype", ACTS)
@pytest.mark.parametrize("G", [1, 3])
def test_linear_fp8_matches_numpy(G: int, dtype: torch.dtype, scaling: str) -> None:
    """Outputs, and the slots the casts leave (scales and the amaxes met), as the reference's."""
    rng = np.random.default_rng(G)
    N, C, OC = 64, 32, (48 if G == 1 else 32)  # the scratch holds N x 4C: the QKV site is G x C wide
    nw, tw = weights_pair(rng, G, C, OC, N, HISTORIES[scaling])
    shape = (N, OC) if G == 1 else (G, N, OC)
    x, dout = (
        rounded(rng.standard_normal((N, C)).astype(np.float32), dtype).astype(np.float32),
        rounded(rng.standard_normal(shape).astype(np.float32) * 0.1, dtype).astype(np.float32),
    )
    mm = matmul8(N, C)
    out_n, dx_n, dw_n = (
        np.zeros(shape, np.float32),
        np.zeros((N, C), np.float32),
        np.ones(tw.master.shape)[0 if G == 1 else slice(None)].astype(np.float32),
    )
    rlinear.linear_forward(out_n, x, nw, mm=ref.Matmul(None))
    rlinear.linear_backward(dx_n, dw_n, dout, x, nw, mm=ref.Matmul(None))
    out_t = torch.zeros(shape, dtype=dtype, device=DEVICE)
    dx_t = t(rng.standard_normal((N, C)).astype(np.float32), dtype)  # noise: backward writes dx
    dw_t = torch.ones(dw_n.shape, device=DEVICE)
    klinear.linear_forward(out_t, t(x, dtype), tw, mm=mm)
    klinear.linear_backward(dx_t, dw_t, t(dout, dtype), t(x, dtype), tw, mm=mm)
    check("out", h(out_t), out_n, TOL[dtype])
    check("dx", h(dx_t), dx_n, TOL[dtype])
    check("dw", h(dw_t) - 1, dw_n - 1, TOL[dtype])
    for name in ("xslot", "gslot"):  # bf16 rounds the gradient's operand on the GPU side only: its amax moves
        np.testing.assert_allclose(h(getattr(tw, name)), getattr(nw, name), rtol=0 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", ACTS)
def test_linear_fp8_forward_of_fewer_rows_than_planned(dtype: torch.dtype) -> None:
    """The inference plan's buffers are sized for its N = B*T rows and a step runs fewer (a decode step: one a
    sequence): the QKV site's forward over 5 rows reads and writes the first 5 rows' worth of the scratch and of
    the site's transposed copy, as the reference computes them."""
    rng = np.random.default_rng(9)
    N, n, C = 64, 5, 32
    nw, tw = weights_pair(rng, 3, C, C, N)
    x = rounded(rng.standard_normal((n, C)).astype(np.float32), dtype).astype(np.float32)
    out_n = np.zeros((3, n, C), np.float32)
    rlinear.linear_forward(out_n, x, nw, mm=ref.Matmul(None))
    out_t = torch.zeros(3, n, C, dtype=dtype, device=DEVICE)
    klinear.linear_forward(out_t, t(x, dtype), tw, mm=matmul8(N, C))
    check("out", h(out_t), out_n, TOL[dtype])


@pytest.mark.parametrize("act", ["gelu", "relu2"])
@pytest.mark.parametrize("scaling", HISTORIES)
@pytest.mark.parametrize("dtype", ACTS)
def test_mlp_fp8_matches_numpy(dtype: torch.dtype, scaling: str, act: str) -> None:
    rng = np.random.default_rng(5)
    N, C = 64, 16
    hist = HISTORIES[scaling]
    (w1n, w1t), (w2n, w2t) = weights_pair(rng, 1, C, 4 * C, N, hist), weights_pair(rng, 1, 4 * C, C, N, hist)
    x = rounded(rng.standard_normal((N, C)).astype(np.float32), dtype).astype(np.float32)
    dout = rounded(rng.standard_normal((N, C)).astype(np.float32) * 0.1, dtype).astype(np.float32)
    out_n, h_n, a_n, dh_n = (np.zeros(s, np.float32) for s in [(N, C), (N, 4 * C), (N, 4 * C), (N, 4 * C)])
    dx_n, dw1_n, dw2_n = np.zeros((N, C), np.float32), np.zeros((C, 4 * C), np.float32), np.zeros((4 * C, C))
    rmlp.mlp_forward(out_n, h_n, a_n, x, w1n, w2n, mm=ref.Matmul(None), act=act)
    rmlp.mlp_backward(
        dx_n, dw1_n, dw2_n, dout, x, h_n, w1n, w2n, a_n, dh_n, mm=ref.Matmul(None), recompute=False, act=act
    )
    mm = matmul8(N, C)
    out_t, dx_t = torch.zeros(N, C, dtype=dtype, device=DEVICE), torch.zeros(N, C, dtype=dtype, device=DEVICE)
    h_t, dh_t = (torch.zeros(N, 4 * C, dtype=dtype, device=DEVICE) for _ in range(2))
    dw1_t, dw2_t = torch.zeros(C, 4 * C, device=DEVICE), torch.zeros(4 * C, C, device=DEVICE)
    # no buffer for a = act(h): in fp8 it exists only in E4M3 (the plan has none: Precision.act_planned)
    kmlp.mlp_forward(out_t, h_t, None, t(x, dtype), w1t, w2t, mm=mm, act=act)
    args = (dx_t, dw1_t, dw2_t, t(dout, dtype), t(x, dtype), h_t, w1t, w2t, None, dh_t)
    kmlp.mlp_backward(*args, mm=mm, recompute=True, act=act)
    # bf16 rounds h before a = gelu(h) is cast, and on the GPU the FP8 tensor cores' narrower sums (TOL) reach the
    # casts of a and dh: either moves a few elements to a neighbouring E4M3 value (measured on the GPU with fp32
    # activations: dx rel err 1.4e-3)
    tol = 5e-2 if dtype != torch.float32 else 5e-3 if ON_GPU else TOL[dtype]
    for name, got, want in [
        ("h", h_t, h_n),
        ("out", out_t, out_n),
        ("dx", dx_t, dx_n),
        ("dw1", dw1_t, dw1_n),
        ("dw2", dw2_t, dw2_n),
    ]:
        check(name, h(got), want, tol)


def test_fp8_on_a_gpu_without_fp8_tensor_cores_names_the_field(monkeypatch) -> None:
    """An A100 (compute capability 8.0) has no FP8 tensor cores: get_backend refuses with one ConfigError naming
    train.precision. (No such GPU here: the device queries are what is replaced, the check is the real one.)"""
    from microgpt import config
    from microgpt.engine import backend

    monkeypatch.setattr(k8, "INTERPRET", False)
    monkeypatch.setattr(k8.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(k8.torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(k8.torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(config.ConfigError, match=r"^train.precision 'fp8' needs FP8 tensor cores .* A100.* is 8\.0"):
        backend.get_backend("triton", "fp8")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", ACTS)
def test_head_fp8_matches_numpy(dtype: torch.dtype, fused: bool) -> None:
    """The LM head's logits GEMM on E4M3 operands (wte's copy from cast_weights, x cast in the call at its own
    amax): the same E4M3 wte bytes and scale words as the reference, then losses, lse and both gradients (which
    read the exact wte) as the reference's, chunk by chunk (R does not divide N)."""
    from microgpt.kernels import crossentropy as kce
    from microgpt.ops import crossentropy as rce

    rng = np.random.default_rng(11)
    N, C, V, R = 40, 32, 64, 16
    wte = rounded((rng.standard_normal((V, C)) * 0.5).astype(np.float32), dtype).astype(np.float32)
    x = rounded(rng.standard_normal((N, C)).astype(np.float32), dtype).astype(np.float32)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[::3] = -1
    dlosses = (rng.random(N) / N).astype(np.float32)
    nh = fp8.Fp8Head(
        wte, wte, np.zeros((V, C), ref.e4m3()), np.zeros(fp8.SLOT, np.float32), np.zeros(fp8.SLOT, np.float32)
    )
    th = fp8.Fp8Head(
        t(wte, dtype),
        t(wte),
        torch.empty(V, C, dtype=F8, device=DEVICE),
        torch.zeros(fp8.SLOT, device=DEVICE),
        torch.zeros(fp8.SLOT, device=DEVICE),
    )
    ref.Matmul(None).cast_weights([nh])
    matmul8(1, 1).cast_weights([th])
    np.testing.assert_array_equal(bytes_of(th.w8), nh.w8.view(np.uint8))
    assert h(th.scale).tolist() == nh.scale.tolist()

    # what the head adds into: dx in the activations' dtype, small beside the head's term so that bf16's rounding
    # of the sum stays relative to that term
    dx0 = rounded((rng.standard_normal((N, C)) * 1e-3).astype(np.float32), dtype).astype(np.float32)
    dwte0 = rng.standard_normal((V, C)).astype(np.float32)
    losses, lse, dx, dwte = np.zeros(N, np.float32), np.zeros(N, np.float32), dx0.copy(), dwte0.copy()
    f32 = dict(dtype=torch.float32, device=DEVICE)
    g = [torch.zeros(N, **f32), torch.zeros(N, **f32), t(dx0.copy(), dtype), t(dwte0.copy())]  # t() may share memory
    gx, gt, gdl, mm, rmm = t(x, dtype), t(targets), t(dlosses), matmul8(N, C, th), ref.Matmul(nh)
    logits, rlogits = torch.zeros(R, V, dtype=dtype, device=DEVICE), np.zeros((R, V), np.float32)
    if fused:
        rce.crossentropy_forward_backward(losses, lse, dx, dwte, dlosses, x, nh.w, targets, rlogits, mm=rmm)
        kce.crossentropy_forward_backward(*g, gdl, gx, th.w, gt, logits, mm=mm, tuner=TUNER)
    else:
        rce.crossentropy_forward(losses, lse, x, nh.w, targets, rlogits, mm=rmm)
        rce.crossentropy_backward(dx, dwte, dlosses, x, nh.w, targets, lse, rlogits, mm=rmm)
        kce.crossentropy_forward(g[0], g[1], gx, th.w, gt, logits, mm=mm, tuner=TUNER)
        kce.crossentropy_backward(g[2], g[3], gdl, gx, th.w, gt, g[1], logits, mm=mm, tuner=TUNER)
    np.testing.assert_array_equal(h(th.xslot), nh.xslot)  # x's scale and amax: the same values cast
    x8, _ = ref.cast(x, np.zeros(fp8.SLOT, np.float32), current=True)
    np.testing.assert_array_equal(bytes_of(mm.q.view(mm.q.x8, N, C)), x8.view(np.uint8))
    for name, got, want, base in zip(("losses", "lse", "dx", "dwte"), g, (losses, lse, dx, dwte), (0, 0, dx0, dwte0)):
        check(name, h(got) - base, want - base, TOL[dtype])  # the gradients: what the head added


def test_weights_cast_one_launch_pair_per_site_matches_numpy() -> None:
    """A triton fp8 state's weights' cast: each site's weights in every layer lie at one stride in the plan, so
    `stack` gives one launch pair per site (and the head's), and every layer's E4M3 layouts and scale equal the
    reference's cast of its own masters. Weights that lie anywhere (here, a site's two layers swapped) go one by
    one, to the same bytes."""
    from microgpt import config
    from microgpt.engine import backend
    from microgpt.engine.state import make_state

    m = config.ModelConfig(vocab_size=64, d_model=16, n_layer=3, n_head=2, seq_len=16)
    S = make_state(m, config.TrainConfig(micro_batch=1, precision="fp8"), backend.get_backend("triton", "fp8"))
    sites, head = S.prec.sites, S.prec.head
    runs = kc.stack([*sites, head])
    at = list(range(len(sites) + 1))  # each run's positions in the list
    assert [(at[i], tuple(r[0].shape)) for i, r in runs] == [([12], tuple(head.master.shape))] + [
        ([i, i + 4, i + 8], (m.n_layer, *w.master.shape)) for i, w in enumerate(sites[:4])
    ]

    def assert_reference(ws: list[Fp8Weight]) -> None:
        for w in ws:
            nw = Fp8Weight(
                w.name,
                h(w.master),
                np.zeros(tuple(w.w8.shape), ref.e4m3()),
                np.zeros(tuple(w.w8t.shape), ref.e4m3()),
                np.zeros(fp8.SLOT, np.float32),
                None,
                None,
                fp8.Priming(False),
            )
            ref.Matmul(None).cast_weights([nw])
            np.testing.assert_array_equal(bytes_of(w.w8), nw.w8.view(np.uint8), err_msg=w.name)
            np.testing.assert_array_equal(bytes_of(w.w8t), nw.w8t.view(np.uint8), err_msg=w.name)
            assert h(w.scale).tolist() == nw.scale.tolist(), w.name

    rng = np.random.default_rng(5)
    for w in sites:  # masters of different amaxes a layer, so a slot mixed up between layers shows
        w.master.copy_(t(rng.standard_normal(tuple(w.master.shape)).astype(np.float32) * rng.uniform(0.05, 3)))
    S.prec.cast_weights()
    assert_reference(sites)
    swapped = [sites[4], sites[0], sites[8]]  # w_qkv of layers 1, 0, 2: no one stride
    assert [tuple(r[0].shape) for _, r in kc.stack(swapped)] == [tuple(w.master.shape) for w in swapped]
    for w in swapped:
        w.w8.zero_(), w.w8t.zero_()
    S.prec.mm.cast_weights(swapped)
    assert_reference(swapped)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's exp2 of a masked -inf score
def test_adamw_takes_the_weights_amaxes_bit_for_bit() -> None:
    """A training plan whose E4M3 weights are each at least a block of AdamW long has fp8's amax table: the step's
    AdamW records every weight's amax and the weights' cast takes it (no amax launch). After a step (and the
    warm-up's, which updates nothing), the E4M3 copies and slots are those the casts give the same masters taking
    their own amax, bit for bit, and the recorded amaxes are cleared."""
    from microgpt import config
    from microgpt.engine import backend
    from microgpt.engine.state import make_state
    from microgpt.engine.step import Step

    m = config.ModelConfig(vocab_size=64, d_model=48, n_layer=2, n_head=3, seq_len=16)  # W_O: 2,304 elements
    t = config.TrainConfig(micro_batch=1, precision="fp8", grad_clip=1.0)
    rng = np.random.default_rng(4)
    S = make_state(m, t, backend.get_backend("triton", "fp8"))
    assert "fp8_amax_blocks" in S.arena and S.prec.amaxes is not None
    masters = h(S.p)
    Step(S)([(rng.integers(0, m.vocab_size, (1, m.seq_len)).astype(np.int32),) * 2], 1e-2)
    assert not np.array_equal(h(S.p), masters), "the step updates the masters"
    assert not h(S.prec.amaxes).any(), "the cast clears the amaxes AdamW recorded"
    ws = [*S.prec.sites, S.prec.head]

    def copies() -> list[np.ndarray]:
        return [bytes_of(a) for w in ws for a in (w.w8, w.w8t) if a is not None] + [h(w.scale) for w in ws]

    taken = copies()
    S.prec.cast_weights()  # the same masters, each cast taking its own amax
    for a, b in zip(taken, copies()):
        np.testing.assert_array_equal(a, b)
