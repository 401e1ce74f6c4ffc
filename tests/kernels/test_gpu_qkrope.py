"""On the GPU, at the modern block's ANDREA-120M shape (C 768, 6 heads of 128, T 1024): the qkrope kernels against the
NumPy pair, decode_qkrope against the training forward (bit for bit), and attention at head size 128 (training
forward and backward under every tile configuration the warm-up may choose, the backward through qkrope by each of its
ways, over the KV cache, flash-decoding) against float64 references.

Run on the GPU machine: MICROGPT_TEST_GPU=1 python3 -m pytest -m gpu tests/kernels/test_gpu_modern.py
Relative error ||got - ref|| / ||ref||: fp32 under 1e-5, bf16 under 1e-2 (the reference sees the same rounded
inputs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from microgpt.kernels import attention as ka
from microgpt.kernels import decode as kd
from microgpt.kernels import qkrope as kq
from microgpt.ops import attention as ref_attention
from microgpt.ops import decode as ref_decode
from microgpt.ops import qkrope as ref_qkrope

from ._kutil import ON_GPU, SMS, TUNER

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs CUDA")]

B, T, C, NH = 4, 1024, 768, 6
D, N = C // NH, B * T
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rnd(*shape, dtype=torch.float32, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float64) * scale + shift).to(dtype)


def host(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()


def close(name: str, got: torch.Tensor, want, dtype: torch.dtype) -> None:
    got = host(got)
    want = want if isinstance(want, np.ndarray) else host(want)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < TOL[dtype], f"{name} ({dtype}): rel err {err:.2e} >= {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_qkrope_gpu(dtype):
    """Forward at position 0 and at a later window (a prefill after a cached prefix), q and k views of a (3, N, C)
    projection; the backward from the forward's outputs; v untouched; the same bits twice."""
    torch.manual_seed(10)
    rope = torch.from_numpy(ref_qkrope.rope_tables(T, D)).cuda()
    for pos, t in ((300, 77), (0, T)):  # the backward below runs from the second, at position 0
        qkv = rnd(3, B * t, C, dtype=dtype, scale=1.5, shift=0.2)
        x = host(qkv)
        v0 = qkv[2].clone()
        q, k = qkv[0].view(B, t, C), qkv[1].view(B, t, C)
        rstd = torch.full((2, B * t, NH), float("nan"), device="cuda")
        kq.qkrope_forward(q, k, rstd, rope, n_head=NH, pos=pos)
        want_rstd = np.empty((2, B * t, NH))
        ref_qkrope.qkrope_forward(
            x[0].reshape(B, t, C), x[1].reshape(B, t, C), want_rstd, host(rope), n_head=NH, pos=pos
        )
        close(f"q at {pos}", q, x[0].reshape(B, t, C), dtype)
        close(f"k at {pos}", k, x[1].reshape(B, t, C), dtype)
        close(f"rstd at {pos}", rstd, want_rstd, torch.float32)
        assert torch.equal(qkv[2], v0), "v is not the op's"
    dqkv = rnd(3, N, C, dtype=dtype)
    g = host(dqkv)
    dq, dk = dqkv[0].view(B, T, C), dqkv[1].view(B, T, C)
    again = dqkv.clone()
    kq.qkrope_backward(dq, dk, q, k, rstd, rope, n_head=NH)
    kq.qkrope_backward(again[0].view(B, T, C), again[1].view(B, T, C), q, k, rstd, rope, n_head=NH)
    assert torch.equal(dqkv, again), "backward is deterministic"
    ref_qkrope.qkrope_backward(
        g[0].reshape(B, T, C), g[1].reshape(B, T, C), host(q), host(k), host(rstd), host(rope), n_head=NH
    )
    close("dq", dq, g[0].reshape(B, T, C), dtype)
    close("dk", dk, g[1].reshape(B, T, C), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_qkrope_is_the_forward_gpu(dtype):
    """32 decode rows at ragged positions (the last one T - 1): each row is k_qkrope_fwd on a one-row window at its
    position, bit for bit, and the NumPy twin's to the dtype's rounding."""
    torch.manual_seed(11)
    b = 32
    rope = torch.from_numpy(ref_qkrope.rope_tables(T, D)).cuda()
    positions = torch.randint(0, T, (b,), device="cuda", dtype=torch.int32)
    positions[-1] = T - 1
    qkv = rnd(3, b, C, dtype=dtype, scale=1.5, shift=0.2)
    want, x = qkv.clone(), host(qkv)
    rstd = torch.empty(2, 1, NH, device="cuda")
    for i, p in enumerate(positions.tolist()):
        kq.qkrope_forward(want[0, i : i + 1, None], want[1, i : i + 1, None], rstd, rope, n_head=NH, pos=p)
    kd.decode_qkrope(qkv[0], qkv[1], positions, rope, n_head=NH)
    assert torch.equal(qkv, want), "a decode row is the training forward at its position, bit for bit"
    ref_decode.decode_qkrope(x[0], x[1], positions.cpu().numpy(), host(rope), n_head=NH)
    close("q", qkv[0], x[0], dtype)
    close("k", qkv[1], x[1], dtype)


def attention_reference(q, k, v, dout):
    """Causal attention in float64 autograd on (b, T, C): (q, k, v leaves with their grads, out, lse)."""
    b = q.shape[0]
    rq, rk, rv = (z.detach().double().requires_grad_(True) for z in (q, k, v))
    qh, kh, vh = (z.view(b, T, NH, D).transpose(1, 2) for z in (rq, rk, rv))
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    out = (torch.softmax(s, -1) @ vh).transpose(1, 2).reshape(b, T, C)
    (out * dout.double()).sum().backward()
    return rq, rk, rv, out, torch.logsumexp(s, -1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_head_size_128_gpu(dtype, monkeypatch):
    """The training attention at 6 heads of 128 (q, k normed as qkrope leaves them: scores of order sqrt(D)); in
    bf16 under each tile configuration the warm-up may choose, forced (one that does not fit this GPU gives way to
    the next that does, as in training); backward deterministic."""
    torch.manual_seed(12)
    b = 2
    q, k = (rnd(b, T, C, dtype=dtype) for _ in range(2))
    v, dout = rnd(b, T, C, dtype=dtype), rnd(b, T, C, dtype=dtype)
    rq, rk, rv, ref, lse_ref = attention_reference(q, k, v, dout)
    out, lse, delta = torch.empty_like(q), torch.empty(b, NH, T, device="cuda"), torch.empty(b * NH * T, device="cuda")
    n_fwd, n_bwd = len(ka.configs("fwd", D)[0]), len(ka.configs("bwd", D)[0])
    configs = range(max(n_fwd, n_bwd)) if dtype == torch.bfloat16 else [None]
    for i in configs:
        if i is not None:
            monkeypatch.setenv("MICROGPT_ATTENTION_FWD", str(min(i, n_fwd - 1)))
            monkeypatch.setenv("MICROGPT_ATTENTION_BWD", str(min(i, n_bwd - 1)))
        dq, dk, dv = (torch.randn_like(q) for _ in range(3))
        ka.attention_forward(out, lse, q, k, v, NH, tuner=TUNER)
        ka.attention_backward(dq, dk, dv, dout, q, k, v, out, lse, NH, delta=delta, tuner=TUNER)
        for name, got, want in (
            ("out", out, ref),
            ("lse", lse, lse_ref),
            ("dq", dq, rq.grad),
            ("dk", dk, rk.grad),
            ("dv", dv, rv.grad),
        ):
            close(f"config {i}: {name}", got, want, dtype)
        dq2, dk2, dv2 = (torch.randn_like(q) for _ in range(3))
        ka.attention_backward(dq2, dk2, dv2, dout, q, k, v, out, lse, NH, delta=delta, tuner=TUNER)
        assert torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2), f"config {i}: deterministic"


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_through_qkrope_gpu(dtype, monkeypatch):
    """The modern block's backward, attention's through qkrope's (kernels/attention.py qkrope=...), at 6 heads of 128
    with a window and documents: each way (the fused epilogue, attention then the pass) forced, in bf16 under each tile
    configuration the warm-up may choose, against float64 autograd of attention over qkrope; each deterministic, and
    the two ways equal to within rounding (dv: the same bits)."""
    torch.manual_seed(14)
    b = 2
    rope = torch.from_numpy(ref_qkrope.rope_tables(T, D)).cuda()
    xq, xk, v, dout = (rnd(b, T, C, dtype=dtype, scale=1.5, shift=0.2) for _ in range(4))
    lq, lk = (z.detach().double().requires_grad_(True) for z in (xq, xk))
    cos, sin = (rope[i].double().repeat(1, 2)[None, :, None, :] for i in (0, 1))

    def normed_rotated(x):
        xh = x.view(b, T, NH, D)
        xh = xh * torch.rsqrt(xh.pow(2).mean(-1, keepdim=True) + kq.EPS)
        half = torch.cat([-xh[..., D // 2 :], xh[..., : D // 2]], -1)
        return (xh * cos + half * sin).reshape(b, T, C)

    window, ds = 300, torch.zeros(b, T, dtype=torch.int32, device="cuda")
    ds[:, 400:] = 400  # a document starts at 400 in every row
    i, j = torch.arange(T, device="cuda")[:, None], torch.arange(T, device="cuda")[None, :]
    hidden = (j > i) | (i - j >= window) | (j < ds[:, :, None].long())
    yq, yk = normed_rotated(lq), normed_rotated(lk)
    rv = v.detach().double().requires_grad_(True)
    qh, kh, vh = (z.view(b, T, NH, D).transpose(1, 2) for z in (yq, yk, rv))
    sc = ((qh @ kh.transpose(-1, -2)) / math.sqrt(D)).masked_fill(hidden[:, None], float("-inf"))
    ((torch.softmax(sc, -1) @ vh).transpose(1, 2).reshape(b, T, C) * dout.double()).sum().backward()
    q, k = xq.clone(), xk.clone()
    rstd = torch.empty(2, b * T, NH, device="cuda")
    kq.qkrope_forward(q, k, rstd, rope, n_head=NH)
    mask = {"window": torch.tensor([window], dtype=torch.int32, device="cuda"), "doc_start": ds}
    out, lse, delta = torch.empty_like(q), torch.empty(b, NH, T, device="cuda"), torch.empty(b * NH * T, device="cuda")
    ka.attention_forward(out, lse, q, k, v, NH, tuner=TUNER, **mask)
    n_bwd = len(ka.configs("bwd", D)[0])
    kw = {"delta": delta, "tuner": TUNER, "qkrope": (rstd, rope), **mask}
    for c in range(n_bwd) if dtype == torch.bfloat16 else [None]:
        if c is not None:
            monkeypatch.setenv("MICROGPT_ATTENTION_BWD", str(c))
        got = {}
        for way in ("fused", "pass"):
            monkeypatch.setenv("MICROGPT_ATTENTION_QKROPE", way)
            runs = [[torch.randn_like(q) for _ in range(3)] for _ in range(2)]
            for grads in runs:
                ka.attention_backward(*grads, dout, q, k, v, out, lse, NH, **kw)
            assert all(torch.equal(x, y) for x, y in zip(*runs)), f"config {c} {way}: deterministic"
            for name, x, want in zip(("dq", "dk", "dv"), runs[0], (lq.grad, lk.grad, rv.grad)):
                close(f"config {c} {way}: {name}", x, want, dtype)
            got[way] = runs[0]
        for name, a, p in zip(("dq", "dk"), got["fused"], got["pass"]):
            close(f"config {c}: {name} fused against pass", a, p, dtype)
        assert torch.equal(got["fused"][2], got["pass"][2]), f"config {c}: dv"


@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_and_decode_attention_head_size_128_gpu(dtype):
    """Attention over the KV cache (a window of 100 queries after 700 cached positions) and flash-decoding (32 rows
    at ragged positions of permuted cache rows) at 6 heads of 128, against the NumPy pairs; the cache past what a
    row may read holds noise."""
    torch.manual_seed(13)
    b, pos, t = 2, 700, 100
    kc, vc = rnd(b, T, C, dtype=dtype), rnd(b, T, C, dtype=dtype)
    q = rnd(b, t, C, dtype=dtype)
    want = np.empty((b, t, C))
    ref_attention.attention_forward_cached(want, host(q), host(kc), host(vc), pos, NH)
    kc[:, pos + t :], vc[:, pos + t :] = 1e4, -1e4
    out = torch.full_like(q, float("nan"))
    ka.attention_forward_cached(out, q, kc, vc, pos, NH)
    close("cached", out, want, dtype)

    rows = 32
    kc, vc = rnd(rows, T, C, dtype=dtype), rnd(rows, T, C, dtype=dtype)
    q = rnd(rows, C, dtype=dtype)
    positions = torch.randint(0, T, (rows,), device="cuda", dtype=torch.int32)
    positions[0] = T - 1
    slots = torch.randperm(rows, device="cuda").to(torch.int32)
    want = np.empty((rows, C))
    ref_decode.decode_attention(want, host(q), host(kc), host(vc), positions.cpu().numpy(), slots.cpu().numpy(), NH)
    for p, s in zip(positions.tolist(), slots.tolist()):
        kc[s, p + 1 :], vc[s, p + 1 :] = 1e4, -1e4
    for n in (1, rows):  # batch 1 splits the keys most
        partials = torch.full((kd.partials_numel(n, T, C, NH, SMS),), float("nan"), device="cuda")
        out = torch.full((n, C), float("nan"), dtype=dtype, device="cuda")
        kd.decode_attention(out, q[:n], kc, vc, positions[:n], slots[:n], NH, partials=partials, sm_count=SMS)
        close(f"decode, {n} rows", out, want[:n], dtype)
