"""attention kernels (flash style: k_attention_fwd, k_attention_bwd_delta, k_attention_bwd) against the NumPy pair."""

import json

import numpy as np
import pytest
import torch

from microgpt.kernels import attention as ka
from microgpt.kernels import qkrope as kq
from microgpt.kernels import tuning
from microgpt.ops import attention as ref
from microgpt.ops import qkrope as ref_qkrope
from tests.ops.test_attention import torch_qkrope_reference

from ._kutil import DEVICE, DTYPES, ON_GPU, TOL, TUNER, check, compare, h, rounded, t

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


def _doc_start(rng: np.random.Generator, B: int, T: int, docs: int) -> np.ndarray:
    """(B, T) int32 document starts of random tokens with `docs` <|endoftext|> (id 0) a row (ops' doc_starts)."""
    tokens = rng.integers(1, 10, (B, T)).astype(np.int32)
    for b in range(B):
        tokens[b, rng.choice(T, size=min(docs, T), replace=False)] = 0
    out = np.empty((B, T), np.int32)
    ref.doc_starts(out, tokens, 0)
    return out


# (B, T, C, NH, window, documents a row): the interpreter's tiles are 16 query rows by 16 keys forward, 32-key tiles
# of 16 rows (dk, dv) and 32-row tiles of 16 keys (dq) backward: windows smaller than a tile, equal to one (16, 32),
# between and past them and past T; documents alone and with a window; head size 128 over several tiles
BOUNDED = [(2, 37, 24, 2, 5, 0), (1, 64, 32, 2, 16, 0), (2, 70, 16, 2, 32, 0), (1, 50, 16, 1, 2, 0),
           (2, 45, 24, 2, 21, 3), (2, 67, 16, 2, None, 4), (1, 40, 16, 1, None, 1), (1, 33, 8, 1, 100, 6),
           (1, 35, 256, 2, 17, 2)]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,NH,window,docs", BOUNDED)
def test_attention_window_and_documents(B, T, C, NH, window, docs, dtype: torch.dtype) -> None:
    """The pair with a window and document starts (each row's first key; whole tiles skipped, the rest masked)
    against the NumPy pair's, both directions."""
    rng = np.random.default_rng(T * 7 + (window or 0) + docs)
    q, k, v, dout = (rounded(rng.standard_normal((B, T, C)), dtype) for _ in range(4))
    win = None if window is None else np.array([window], np.int32)
    doc = _doc_start(rng, B, T, docs) if docs else None
    out, lse = np.empty((B, T, C)), np.empty((B, NH, T))
    ref.attention_forward(out, lse, q, k, v, NH, window=win, doc_start=doc)
    d = {n: np.empty((B, T, C)) for n in ("dq", "dk", "dv")}
    ref.attention_backward(d["dq"], d["dk"], d["dv"], dout, q, k, v, out, lse, NH, window=win, doc_start=doc)

    mask = {"window": None if win is None else t(win), "doc_start": None if doc is None else t(doc)}
    gq, gk, gv = t(q, dtype), t(k, dtype), t(v, dtype)
    gout = torch.full((B, T, C), float("nan"), dtype=dtype, device=DEVICE)
    glse = torch.full((B, NH, T), float("nan"), dtype=torch.float32, device=DEVICE)
    ka.attention_forward(gout, glse, gq, gk, gv, NH, tuner=TUNER, **mask)
    compare("out", gout, out, dtype)
    compare("lse", glse, lse, dtype)
    gd = {n: torch.full((B, T, C), float("nan"), dtype=dtype, device=DEVICE) for n in d}
    delta = torch.empty(B * NH * T, dtype=torch.float32, device=DEVICE)
    ka.attention_backward(
        gd["dq"], gd["dk"], gd["dv"], t(dout, dtype), gq, gk, gv, t(out, dtype), glse, NH, delta=delta, tuner=TUNER,
        **mask,
    )  # fmt: skip
    for n in d:
        compare(n, gd[n], d[n], dtype)


@pytest.mark.parametrize("pos,n,window,docs", [(33, 1, 5, 0), (9, 21, 16, 3), (0, 40, 7, 4), (20, 19, None, 5)])
def test_attention_cached_window_and_documents(pos: int, n: int, window, docs) -> None:
    """The inference step's attention with a window and its queries' document starts (a strided view of a (B, T)
    buffer, as the model hands it) against the NumPy pair's."""
    rng = np.random.default_rng(pos * 5 + n)
    B, Tmax, C, NH, dtype = 2, 48, 16, 2, torch.float32
    q = rounded(rng.standard_normal((B, n, C)), dtype)
    kc, vc = (rounded(rng.standard_normal((B, Tmax, C)), dtype) for _ in range(2))
    win = None if window is None else np.array([window], np.int32)
    doc = _doc_start(rng, B, Tmax, docs) if docs else None
    out = np.empty((B, n, C))
    ref.attention_forward_cached(
        out, q, kc, vc, pos, NH, window=win, doc_start=None if doc is None else doc[:, pos : pos + n]
    )
    gk, gv = t(kc, dtype), t(vc, dtype)
    gk[:, pos + n :], gv[:, pos + n :] = 1e4, -1e4
    gout = torch.full((B, n, C), float("nan"), dtype=dtype, device=DEVICE)
    gdoc = None if doc is None else t(doc)[:, pos : pos + n]
    ka.attention_forward_cached(
        gout, t(q, dtype), gk, gv, pos, NH, window=None if win is None else t(win), doc_start=gdoc
    )
    compare("out", gout, out, dtype)


@pytest.mark.parametrize("B,n,docs", [(3, 37, 4), (1, 16, 0), (2, 5, 5), (2, 50, 1)])
def test_doc_starts(B: int, n: int, docs: int) -> None:
    """k_doc_starts (a scan in blocks, the running maximum carried) against the NumPy reference, into a strided
    view from a strided view."""
    rng = np.random.default_rng(B * n + docs)
    tokens = rng.integers(0 if docs else 1, 4, (B, n + 3)).astype(np.int32)
    expected = np.empty((B, n), np.int32)
    ref.doc_starts(expected, tokens[:, 3:], 0)
    got = torch.full((B, n + 5), -7, dtype=torch.int32, device=DEVICE)
    ka.doc_starts(got[:, 5:], t(tokens)[:, 3:], 0)
    assert got[:, 5:].cpu().numpy().tolist() == expected.tolist()
    assert (got[:, :5] == -7).all()


def test_a_window_over_scores_far_below_zero() -> None:
    """Every score of a row far below zero (uniform attention over its window): a row that has seen no key of a tile
    yet keeps its running maximum at -inf and shifts by 0 only for that tile, so its first visible keys' exp2 does
    not underflow to a 0 / 0."""
    rng = np.random.default_rng(3)
    B, T, C, NH = 1, 40, 16, 1
    u = rng.standard_normal(C)
    q, k = np.tile(u, (B, T, 1)), np.tile(-40 * u, (B, T, 1))  # every score -40 |u|^2 / 4: ~ -400 (base 2: ~ -580)
    v = rng.standard_normal((B, T, C))
    win = np.array([5], np.int32)
    out, lse = np.empty((B, T, C)), np.empty((B, NH, T))
    ref.attention_forward(out, lse, q, k, v, NH, window=win)
    gout = torch.full((B, T, C), float("nan"), device=DEVICE)
    glse = torch.full((B, NH, T), float("nan"), device=DEVICE)
    ka.attention_forward(gout, glse, t(q, torch.float32), t(k, torch.float32), t(v, torch.float32), NH, tuner=TUNER,
                         window=t(win))  # fmt: skip
    compare("out", gout, out, torch.float32)
    compare("lse", glse, lse, torch.float32)


# (B, T, H, D, window, documents a row): odd T over several of the interpreter's tiles, heads of 16 (the smallest
# tile), 32 and 128 (the modern block's), causal, with a window, with documents, with both; heads of 12, whose halves
# do not fill the 16-lane tile: the pass way alone
QKROPE = [(2, 37, 3, 16, None, 0), (1, 45, 2, 16, 7, 0), (2, 35, 1, 32, None, 3), (1, 33, 2, 128, 21, 2),
          (1, 19, 2, 12, None, 0)]  # fmt: skip


def _qkrope_case(B: int, T: int, H: int, D: int, window, docs: int, dtype: torch.dtype) -> dict:
    """Attention over qkrope's outputs: autograd's gradients w.r.t. qkrope's input ("want"), the NumPy op's from the
    outputs as the kernel sees them ("spec"), and the kernels' arguments ("args", "kw")."""
    rng = np.random.default_rng(B * T * H + D + (window or 0) + docs)
    C = H * D
    inp = {n: rounded(rng.standard_normal((B, T, C)), dtype) for n in ("q", "k", "v", "dout")}
    rope = ref_qkrope.rope_tables(T + 3, D)
    win = None if window is None else np.array([window], np.int32)
    doc = _doc_start(rng, B, T, docs) if docs else None
    want = torch_qkrope_reference(inp, H, rope, window, doc)
    y_q, y_k = (rounded(want[n].detach().numpy(), dtype) for n in ("y_q", "y_k"))
    rstd = want["rstd"].detach().numpy().astype(np.float32)
    out, lse = np.empty((B, T, C)), np.empty((B, H, T))
    ref.attention_forward(out, lse, y_q, y_k, inp["v"], H, window=win, doc_start=doc)
    spec = {n: np.empty((B, T, C)) for n in ("dq", "dk", "dv")}
    mask = {"window": win, "doc_start": doc}
    ref.attention_backward(*spec.values(), inp["dout"], y_q, y_k, inp["v"], out, lse, H, **mask, qkrope=(rstd, rope))
    args = [t(x, dtype) for x in (inp["dout"], y_q, y_k, inp["v"], out)] + [t(lse.astype(np.float32)), H]
    kw = {n: None if x is None else t(x) for n, x in mask.items()}
    kw |= {"delta": torch.empty(B * H * T, device=DEVICE), "qkrope": (t(rstd), t(rope))}
    return {"want": {n: want[n].detach().numpy() for n in spec}, "spec": spec, "args": args, "kw": kw}


def _backward(case: dict, dtype: torch.dtype, tuner: tuning.Tuner) -> dict[str, torch.Tensor]:
    """dq, dk, dv by the launcher (NaN first: every element must be stored)."""
    shape = case["args"][0].shape
    got = {n: torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for n in ("dq", "dk", "dv")}
    ka.attention_backward(*got.values(), *case["args"], tuner=tuner, **case["kw"])
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,H,D,window,docs", QKROPE)
def test_attention_backward_through_qkrope(B, T, H, D, window, docs, dtype, tmp_path, monkeypatch) -> None:
    """With qkrope=(rstd, rope), the interpreter's way (the fused epilogue where the head fills the tile) against the
    NumPy op and against autograd of attention over qkrope; then the pass way (attention, then kernels/qkrope.py's
    pass), forced as MICROGPT_ATTENTION_QKROPE forces it on a GPU, against the first: the same bits in the interpreter
    (the epilogue rounds each tile as the pass reads it, and the interpreter's sums over a head's lanes run in one
    order either way), the same to within rounding on a GPU (there the sums' order follows each kernel's layout)."""
    case = _qkrope_case(B, T, H, D, window, docs, dtype)
    first = _backward(case, dtype, TUNER)
    for n, x in first.items():
        compare(n, x, case["spec"][n], dtype)
        compare(n, x, case["want"][n], dtype)
    monkeypatch.setenv("MICROGPT_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "INTERPRET", False)  # the tuner's interpreter shortcut off: the variable forces
    monkeypatch.setenv("MICROGPT_ATTENTION_QKROPE", "pass")
    passes = []
    monkeypatch.setattr(kq, "qkrope_backward", lambda *a, k=kq.qkrope_backward, **kw: (passes.append(1), k(*a, **kw)))
    second = _backward(case, dtype, tuning.Tuner("test-device"))
    assert passes == [1]
    for n, x in second.items():
        check(n, h(x), h(first[n]), TOL[dtype])
        assert ON_GPU or torch.equal(x, first[n]), n
    assert torch.equal(second["dv"], first["dv"])  # dv: the same kernel's, untouched by either way


@pytest.mark.parametrize("faster", ["fused", "pass"])
def test_the_warm_up_chooses_each_qkrope_way(tmp_path, monkeypatch, faster: str) -> None:
    """The launcher as the warm-up runs it (the interpreter's shortcut off, each way's time a stand-in figure): the
    faster way is recorded in the device's cache and runs from then on, and dq, dk, dv match the NumPy op whichever
    it is."""
    monkeypatch.setenv("MICROGPT_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "INTERPRET", False)
    tuner = tuning.Tuner("test-device")
    figures = {"fused": 2.0, "pass": 2.0, faster: 1.0}
    order = iter(["fused", "pass"])  # the ways are timed in order

    def timed(fn) -> float:
        fn()
        return figures[next(order)]

    monkeypatch.setattr(tuner, "_time", timed)
    passes = []
    monkeypatch.setattr(kq, "qkrope_backward", lambda *a, k=kq.qkrope_backward, **kw: (passes.append(1), k(*a, **kw)))
    dtype = torch.float32  # one fixed tile configuration for attention itself: the ways alone are chosen
    case = _qkrope_case(2, 37, 2, 16, 9, 2, dtype)
    with tuner.window():
        got = _backward(case, dtype, tuner)
    assert json.loads(tuner.path.read_text())["attention_qkrope"] == {"37:2x16:torch.float32:bounded": faster}
    assert len(passes) == 1 + (faster == "pass")  # both timed, then the choice run
    for n, x in got.items():
        compare(n, x, case["spec"][n], dtype)
    passes.clear()
    got = _backward(case, dtype, tuner)  # outside the window: the recorded way alone
    assert len(passes) == (faster == "pass")
    for n, x in got.items():
        compare(n, x, case["spec"][n], dtype)
