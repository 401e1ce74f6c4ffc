"""mlp kernels against the NumPy pair: the activation (GELU tanh, ReLU^2) as passes around the GEMMs (k_gelu_fwd,
k_gelu_bwd, k_relu2_fwd, k_relu2_bwd) and in the GEMM tiles' epilogues (k_gemm_act, k_gemm_dact; the TMA tiles'
k_gemm_act_tma, k_gemm_dact_tma under each configuration of gemm_tma.TILES), and the warm-up's choice between them.
ReLU^2 runs as the modern plan has it: where a is kept, h is not (W_1's GEMM stores a alone) and act' reads a."""

import contextlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt.kernels import gemm as kgemm
from microgpt.kernels import gemm_tma, tuning
from microgpt.kernels import mlp as km
from microgpt.kernels.gemm import Gemm
from microgpt.kernels.linear import Matmul
from microgpt.ops import mlp as ref

from ._kutil import DEVICE, DTYPES, MM, ON_GPU, REF_MM, compare, rounded, t


@pytest.mark.parametrize("act", ["gelu", "relu2"])
@pytest.mark.parametrize("recompute", [False, True], ids=["a-kept", "a-recomputed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", [(19, 12), (32, 8)])
def test_mlp(N: int, C: int, dtype: torch.dtype, recompute: bool, act: str) -> None:
    """Forward, then backward with a kept from forward or (recompute) a scratch of noise that backward fills; ReLU^2
    with a kept keeps no h (None), as its plan (memory.pre_activation_kept)."""
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
    ref.mlp_forward(out, hh, a, x, w1, w2, mm=REF_MM, act=act)
    dx, dw1, dw2 = dx0.copy(), dw10.copy(), dw20.copy()
    ref.mlp_backward(dx, dw1, dw2, dout, x, hh, w1, w2, a.copy(), np.empty((N, H)), recompute=False, mm=REF_MM, act=act)

    g = {k: torch.empty(s, dtype=dtype, device=DEVICE) for k, s in (("out", (N, C)), ("h", (N, H)), ("a", (N, H)))}
    gh = None if act == "relu2" and not recompute else g["h"]
    km.mlp_forward(g["out"], gh, g["a"], t(x, dtype), t(w1, dtype), t(w2, dtype), mm=MM, act=act)
    if gh is not None:
        compare("h", gh, hh, dtype)
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
        None if gh is None else t(hh, dtype),
        t(w1, dtype),
        t(w2, dtype),
        g["a"],
        dh,
        recompute=recompute,
        mm=MM,
        act=act,
    )
    compare("dx", gdx, dx, dtype)
    compare("dw1", gdw1, dw1, dtype)
    compare("dw2", gdw2, dw2, dtype)


ACTS = {"gelu": lambda h: F.gelu(h, approximate="tanh"), "relu2": lambda h: F.relu(h).square()}
# each tile with the activation in its epilogue, by its way's name, as (plain GEMM, fused act, fused act')
TILE_WAYS = {"tile": (kgemm.triton_mm, kgemm.triton_mm_act, kgemm.triton_mm_dact)} | {
    name: (
        lambda out, a, b, acc, n=name: gemm_tma.tma_mm(out, a, b, acc, n),
        lambda a, h, x, w, act, n=name: gemm_tma.tma_mm_act(a, h, x, w, act, n),
        lambda dx, dy, w, v, act, n=name: gemm_tma.tma_mm_dact(dx, dy, w, v, act, n),
    )
    for name in gemm_tma.TILES
}
# (activation, whether h is stored): GELU's h and a; ReLU^2's a alone (the modern plan), and h too (recompute_gelu's)
STORES = [("gelu", True), ("relu2", False), ("relu2", True)]


SHAPES = [(70, 24, 24), (9, 5, 7), (130, 16, 12), (300, 40, 56)]  # (N, C, C2): odd widths; (300, ...) walks tiles
# the TMA tiles where they apply (gemm_tma.tma_fits): 16-bit operands whose rows are 16-byte aligned (C, C2 of 8)
EPILOGUE_CASES = [
    (way, dtype, *shape)
    for way in TILE_WAYS
    for dtype in DTYPES
    for shape in SHAPES
    if way == "tile" or (dtype != torch.float32 and shape[1] % 8 == 0 and shape[2] % 8 == 0)
]


@pytest.mark.parametrize("act,store_h", STORES, ids=["gelu", "relu2-a-alone", "relu2-h-too"])
@pytest.mark.parametrize("way,dtype,N,C,C2", EPILOGUE_CASES)
def test_mlp_epilogue_tiles(way: str, dtype: torch.dtype, N: int, C: int, C2: int, act: str, store_h: bool) -> None:
    """Each tile with the activation in its epilogue, h = x @ w1 and a = act(h) (k_gemm_act, k_gemm_act_tma; ReLU^2's
    a alone, or h too) and with its derivative, dh = (dout @ w2.T) * act'(h) (k_gemm_dact, k_gemm_dact_tma; GELU's
    read from h, ReLU^2's from a), against autograd (float64, from the rounded inputs), and against the same tile's
    GEMM under the same configuration (k_gemm, k_gemm_tma: one main loop) followed by the pass (a alone: the GEMM into
    a, the pass over it in place), bit for bit: both round the sum before the activation. C2: w2's output width (C in
    the MLP). (300, 40, 56) makes 3 x 2 tiles of 128 x 128, which tma_persistent's two programs off CUDA walk in
    turn; the TMA tiles read w2.T through w2's descriptor, and K (C, or 4C) is never a multiple of their BK of 64."""
    rng = np.random.default_rng(N * C + C2)
    H = 4 * C
    x, w1 = rounded(rng.standard_normal((N, C)), dtype), rounded(rng.standard_normal((C, H)) * 0.5, dtype)
    w2, dout = rounded(rng.standard_normal((H, C2)) * 0.3, dtype), rounded(rng.standard_normal((N, C2)), dtype)
    g = {k: torch.full((N, H), float("nan"), dtype=dtype, device=DEVICE) for k in ("h", "a", "dh")}
    gx, gw1, gw2, gdout = t(x, dtype), t(w1, dtype), t(w2, dtype), t(dout, dtype)
    if way != "tile":
        assert gemm_tma.tma_fits(gx, gw1, g["h"], g["a"]) and gemm_tma.tma_fits(gdout, gw2.t(), g["dh"], g["h"])
    mm, mm_act, mm_dact = TILE_WAYS[way]
    read = "a" if act == "relu2" else "h"  # what act' reads (ops/linear.FROM_OUTPUT)
    mm_act(g["a"], g["h"] if store_h else None, gx, gw1, act)
    mm_dact(g["dh"], gdout, gw2.t(), g[read], act)

    rx, r1, r2 = (torch.from_numpy(v).requires_grad_(True) for v in (x, w1, w2))
    hh = rx @ r1
    hh.retain_grad()
    (ACTS[act](hh) @ r2 * torch.from_numpy(dout)).sum().backward()
    if store_h:
        compare("h", g["h"], hh.detach().numpy(), dtype)
    else:
        assert g["h"].isnan().all()  # not written
    compare("a", g["a"], ACTS[act](hh).detach().numpy(), dtype)
    compare("dh", g["dh"], hh.grad.numpy(), dtype)

    h0, a0, dh0 = (torch.empty(N, H, dtype=dtype, device=DEVICE) for _ in range(3))
    mm(h0 if store_h else a0, gx, gw1, False)
    kgemm.ACTIVATIONS[act][0](a0, h0 if store_h else a0)
    mm(dh0, gdout, gw2.t(), False)
    kgemm.ACTIVATIONS[act][1](dh0, g[read])
    assert (not store_h or torch.equal(g["h"], h0)) and torch.equal(g["a"], a0) and torch.equal(g["dh"], dh0)


@pytest.mark.parametrize("faster", ["pass", "tile", *gemm_tma.TILES])
@pytest.mark.parametrize("act", list(ACTS))
def test_the_warm_up_chooses_each_mlp_way(tmp_path, monkeypatch, act: str, faster: str) -> None:
    """The router's mm_act and mm_dact as the warm-up runs them (the interpreter's shortcut off, each candidate's time
    a stand-in figure), in fp16 with the TMA tiles offered (off a GPU the router is told to; on one, where it has
    them): the faster way is recorded in the device's cache and runs from then on, and the MLP through it matches the
    NumPy pair, whichever it is. ReLU^2's as the modern plan runs it: a stored alone, act' read from a."""
    tma = not ON_GPU or torch.cuda.get_device_capability()[0] >= 9
    offered = ["pass", "tile", *(gemm_tma.TILES if tma else ())]
    if faster not in offered:
        pytest.skip("this GPU has no TMA")
    monkeypatch.setenv("MICROGPT_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "INTERPRET", False)
    tuner = tuning.Tuner("test-device")
    figures = dict.fromkeys(offered, 2.0) | {faster: 1.0}
    order = iter(offered * 2)  # candidates are timed in order: mm_act's, then mm_dact's

    def timed(fn) -> float:
        fn()
        return figures[next(order)]

    monkeypatch.setattr(tuner, "_time", timed)
    # the pass ways' plain GEMMs (a GPU's router would time their ways too, through the stand-in): one way, forced
    monkeypatch.setenv("MICROGPT_GEMM", "triton")
    fused: list[str] = []  # the fused ways run, by name
    for name in ("triton_mm_act", "triton_mm_dact", "tma_mm_act", "tma_mm_dact"):
        kernel = getattr(kgemm, name)
        way = (lambda args: "tile") if name.startswith("triton") else (lambda args: args[-1])  # a TMA tile's: its last
        monkeypatch.setattr(kgemm, name, lambda *args, k=kernel, w=way: (fused.append(w(args)), k(*args)))
    mm = Matmul(Gemm(tuner, None, tma=tma))

    N, C, dtype = 33, 8, torch.float16
    tuner.set_probe(torch.zeros(2 * kgemm.PROBE_ROWS * 4 * C, device=DEVICE))  # the plan's GEMM probe
    rng = np.random.default_rng(7)
    x, dout = rounded(rng.standard_normal((N, C)), dtype), rounded(rng.standard_normal((N, C)), dtype)
    w1 = rounded(rng.standard_normal((C, 4 * C)) * 0.5, dtype)
    w2 = rounded(rng.standard_normal((4 * C, C)) * 0.3, dtype)
    out, hh, a = np.empty((N, C)), np.empty((N, 4 * C)), np.empty((N, 4 * C))
    ref.mlp_forward(out, hh, a, x, w1, w2, mm=REF_MM, act=act)
    dx, dw1, dw2 = np.empty((N, C)), np.zeros((C, 4 * C)), np.zeros((4 * C, C))
    ref.mlp_backward(dx, dw1, dw2, dout, x, hh, w1, w2, a, np.empty((N, 4 * C)), recompute=False, mm=REF_MM, act=act)

    shapes = {"out": (N, C), "h": (N, 4 * C), "a": (N, 4 * C)}
    g = {k: torch.empty(s, dtype=dtype, device=DEVICE) for k, s in shapes.items()}
    gx, gw1, gw2, gdout = t(x, dtype), t(w1, dtype), t(w2, dtype), t(dout, dtype)
    chosen = [] if faster == "pass" else [faster]
    gh = None if act == "relu2" else g["h"]
    with tuner.window():
        km.mlp_forward(g["out"], gh, g["a"], gx, gw1, gw2, mm=mm, act=act)
    assert fused == offered[1:] + chosen  # each fused way timed, then the choice run
    tables = json.loads(tuner.path.read_text())
    assert list(tables["mlp_act"].values()) == [faster]
    dh = torch.empty(N, 4 * C, dtype=dtype, device=DEVICE)  # one buffer, as planned: its alignment is in the GEMM's key
    for _ in range(2):  # in the window (timed), then outside it (the recorded choice)
        fused.clear()
        gdx = torch.empty(N, C, dtype=dtype, device=DEVICE)
        gdw1, gdw2 = torch.zeros(C, 4 * C, device=DEVICE), torch.zeros(4 * C, C, device=DEVICE)
        with tuner.window() if not tables.get("mlp_dact") else contextlib.nullcontext():
            km.mlp_backward(gdx, gdw1, gdw2, gdout, gx, gh, gw1, gw2, g["a"], dh, mm=mm, recompute=False, act=act)
        tables = json.loads(tuner.path.read_text())
        assert list(tables["mlp_dact"].values()) == [faster]
        compare("dx", gdx, dx, dtype)
        compare("dw1", gdw1, dw1, dtype)
        compare("dw2", gdw2, dw2, dtype)
    assert fused == chosen  # outside the window: the recorded way alone
    if gh is not None:
        compare("h", gh, hh, dtype)
    compare("a", g["a"], a, dtype)
    compare("out", g["out"], out, dtype)
