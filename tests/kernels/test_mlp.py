"""mlp kernels against the NumPy pair: the activation (GELU tanh, ReLU^2) as passes around the GEMMs (k_gelu_fwd,
k_gelu_bwd, k_relu2_fwd, k_relu2_bwd) and in the GEMM tile's epilogues (k_gemm_act, k_gemm_dact), and the warm-up's
choice between them."""

import contextlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt.kernels import gemm as kgemm
from microgpt.kernels import mlp as km
from microgpt.kernels import tuning
from microgpt.kernels.gemm import Gemm
from microgpt.kernels.linear import Matmul
from microgpt.ops import mlp as ref

from ._kutil import DEVICE, DTYPES, MM, REF_MM, compare, rounded, t


@pytest.mark.parametrize("act", ["gelu", "relu2"])
@pytest.mark.parametrize("recompute", [False, True], ids=["a-kept", "a-recomputed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", [(19, 12), (32, 8)])
def test_mlp(N: int, C: int, dtype: torch.dtype, recompute: bool, act: str) -> None:
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
    ref.mlp_forward(out, hh, a, x, w1, w2, mm=REF_MM, act=act)
    dx, dw1, dw2 = dx0.copy(), dw10.copy(), dw20.copy()
    ref.mlp_backward(dx, dw1, dw2, dout, x, hh, w1, w2, a.copy(), np.empty((N, H)), recompute=False, mm=REF_MM, act=act)

    g = {k: torch.empty(s, dtype=dtype, device=DEVICE) for k, s in (("out", (N, C)), ("h", (N, H)), ("a", (N, H)))}
    km.mlp_forward(g["out"], g["h"], g["a"], t(x, dtype), t(w1, dtype), t(w2, dtype), mm=MM, act=act)
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
        act=act,
    )
    compare("dx", gdx, dx, dtype)
    compare("dw1", gdw1, dw1, dtype)
    compare("dw2", gdw2, dw2, dtype)


ACTS = {"gelu": lambda h: F.gelu(h, approximate="tanh"), "relu2": lambda h: F.relu(h).square()}


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C,C2", [(70, 24, 24), (9, 5, 7), (130, 16, 12)])  # a tile and a half of rows; odd widths
def test_mlp_epilogue_tiles(N: int, C: int, C2: int, dtype: torch.dtype, act: str) -> None:
    """The tile with the activation in its epilogue, h = x @ w1 and a = act(h) (k_gemm_act), and with its derivative,
    dh = (dout @ w2.T) * act'(h) (k_gemm_dact), against autograd (float64, from the rounded inputs), and against the
    same tile's GEMM (k_gemm: one main loop) followed by the pass, bit for bit: both round the sum before the
    activation. C2: w2's output width (C in the MLP)."""
    rng = np.random.default_rng(N * C + C2)
    H = 4 * C
    x, w1 = rounded(rng.standard_normal((N, C)), dtype), rounded(rng.standard_normal((C, H)) * 0.5, dtype)
    w2, dout = rounded(rng.standard_normal((H, C2)) * 0.3, dtype), rounded(rng.standard_normal((N, C2)), dtype)
    g = {k: torch.full((N, H), float("nan"), dtype=dtype, device=DEVICE) for k in ("h", "a", "dh")}
    kgemm.triton_mm_act(g["a"], g["h"], t(x, dtype), t(w1, dtype), act)
    kgemm.triton_mm_dact(g["dh"], t(dout, dtype), t(w2, dtype).t(), g["h"], act)

    rx, r1, r2 = (torch.from_numpy(v).requires_grad_(True) for v in (x, w1, w2))
    hh = rx @ r1
    hh.retain_grad()
    (ACTS[act](hh) @ r2 * torch.from_numpy(dout)).sum().backward()
    compare("h", g["h"], hh.detach().numpy(), dtype)
    compare("a", g["a"], ACTS[act](hh).detach().numpy(), dtype)
    compare("dh", g["dh"], hh.grad.numpy(), dtype)

    h0, a0, dh0 = (torch.empty(N, H, dtype=dtype, device=DEVICE) for _ in range(3))
    kgemm.triton_mm(h0, t(x, dtype), t(w1, dtype), False)
    kgemm.ACTIVATIONS[act][0](a0, h0)
    kgemm.triton_mm(dh0, t(dout, dtype), t(w2, dtype).t(), False)
    kgemm.ACTIVATIONS[act][1](dh0, g["h"])
    assert torch.equal(g["h"], h0) and torch.equal(g["a"], a0) and torch.equal(g["dh"], dh0)


@pytest.mark.parametrize("faster", ["pass", "tile"])
@pytest.mark.parametrize("act", list(ACTS))
def test_the_warm_up_chooses_each_mlp_way(tmp_path, monkeypatch, act: str, faster: str) -> None:
    """The router's mm_act and mm_dact as the warm-up runs them (the interpreter's shortcut off, each candidate's time
    a stand-in figure): the faster way is recorded in the device's cache and runs from then on, and the MLP through
    it matches the NumPy pair, whichever it is."""
    monkeypatch.setenv("MICROGPT_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "INTERPRET", False)
    tuner = tuning.Tuner("test-device")
    figures = {"pass": 2.0, "tile": 2.0, faster: 1.0}
    order = iter(["pass", "tile"] * 2)  # candidates are timed in order: mm_act's, then mm_dact's

    def timed(fn) -> float:
        fn()
        return figures[next(order)]

    monkeypatch.setattr(tuner, "_time", timed)
    # the pass ways' plain GEMMs (a GPU's router would time their ways too, through the stand-in): one way, forced
    monkeypatch.setenv("MICROGPT_GEMM", "triton")
    tiles: list[str] = []
    for name in ("triton_mm_act", "triton_mm_dact"):
        kernel = getattr(kgemm, name)
        monkeypatch.setattr(kgemm, name, lambda *args, k=kernel, n=name: (tiles.append(n), k(*args)))
    mm = Matmul(Gemm(tuner, None))

    N, C, dtype = 33, 8, torch.float32
    tuner.set_probe(torch.zeros(2 * kgemm.PROBE_ROWS * 4 * C, device=DEVICE))  # the plan's GEMM probe
    rng = np.random.default_rng(7)
    x, dout = rng.standard_normal((N, C)), rng.standard_normal((N, C))
    w1, w2 = rng.standard_normal((C, 4 * C)) * 0.5, rng.standard_normal((4 * C, C)) * 0.3
    out, hh, a = np.empty((N, C)), np.empty((N, 4 * C)), np.empty((N, 4 * C))
    ref.mlp_forward(out, hh, a, x, w1, w2, mm=REF_MM, act=act)
    dx, dw1, dw2 = np.empty((N, C)), np.zeros((C, 4 * C)), np.zeros((4 * C, C))
    ref.mlp_backward(dx, dw1, dw2, dout, x, hh, w1, w2, a, np.empty((N, 4 * C)), recompute=False, mm=REF_MM, act=act)

    shapes = {"out": (N, C), "h": (N, 4 * C), "a": (N, 4 * C)}
    g = {k: torch.empty(s, dtype=dtype, device=DEVICE) for k, s in shapes.items()}
    gx, gw1, gw2, gdout = t(x, dtype), t(w1, dtype), t(w2, dtype), t(dout, dtype)
    with tuner.window():
        km.mlp_forward(g["out"], g["h"], g["a"], gx, gw1, gw2, mm=mm, act=act)
    assert tiles == ["triton_mm_act"] * (2 if faster == "tile" else 1)  # timed, then (the choice) run
    tables = json.loads(tuner.path.read_text())
    assert list(tables["mlp_act"].values()) == [faster]
    dh = torch.empty(N, 4 * C, device=DEVICE)  # one buffer, as planned: its alignment is part of the GEMM's key
    for _ in range(2):  # in the window (timed), then outside it (the recorded choice)
        tiles.clear()
        gdx = torch.empty(N, C, device=DEVICE)
        gdw1, gdw2 = torch.zeros(C, 4 * C, device=DEVICE), torch.zeros(4 * C, C, device=DEVICE)
        with tuner.window() if not tables.get("mlp_dact") else contextlib.nullcontext():
            km.mlp_backward(gdx, gdw1, gdw2, gdout, gx, g["h"], gw1, gw2, g["a"], dh, mm=mm, recompute=False, act=act)
        tables = json.loads(tuner.path.read_text())
        assert list(tables["mlp_dact"].values()) == [faster]
        compare("dx", gdx, dx, dtype)
        compare("dw1", gdw1, dw1, dtype)
        compare("dw2", gdw2, dw2, dtype)
    assert tiles == (["triton_mm_dact"] if faster == "tile" else [])  # outside the window: the recorded way alone
    compare("h", g["h"], hh, dtype)
    compare("a", g["a"], a, dtype)
    compare("out", g["out"], out, dtype)
