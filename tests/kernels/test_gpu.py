"""Every kernel pair at ANDREA-120M layer shapes on the GPU against PyTorch autograd (float64 on the GPU).

Run on the GPU machine: MICROGPT_TEST_GPU=1 python3 -m pytest -m gpu tests/kernels
Relative error ||got - ref|| / ||ref||: fp32 under 1e-5, bf16/fp16 under 1e-2 (the reference sees the same
rounded inputs). Weight-grad buffers (fp32 in every precision) start as noise to prove the +=.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from microgpt.kernels import crossentropy as kc
from microgpt.kernels.gemm import torch_scaled_mm

from ._kutil import GEMM, MM, ON_GPU, SMS, TUNER

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs CUDA")]

B, T, C, NH, V = 4, 1024, 768, 12, 50304
N = B * T
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rnd(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float64) * scale).to(dtype)


def leaf(x):
    return x.detach().double().requires_grad_(True)


def close(name, got, ref, dtype):
    got, ref = got.double(), ref.detach().double()
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"{name} ({dtype}): rel err {err:.2e} >= {TOL[dtype]:.0e}"


def wgrad(*shape):
    """A weight-grad buffer: fp32, noise-filled; returns (buffer, its initial copy)."""
    g = torch.randn(*shape, device="cuda")
    return g, g.clone()


@pytest.mark.parametrize("chunk", [8192, 1024])  # one sort chunk; one chunk per sequence
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_gpu(dtype, chunk):
    from microgpt.kernels import embedding as k

    torch.manual_seed(0)
    tok = torch.randint(0, V, (B, T), device="cuda", dtype=torch.int32)
    wte, wpe, dout = rnd(V, C, dtype=dtype), rnd(T, C, dtype=dtype), rnd(B, T, C, dtype=dtype)
    out = torch.empty(B, T, C, device="cuda", dtype=dtype)
    k.embedding_forward(out, tok, wte, wpe)
    (dwte, dwte0), (dwpe, dwpe0) = wgrad(V, C), wgrad(T, C)
    k.embedding_backward(
        dwte, dwpe, dout, tok, order=torch.empty(N, device="cuda", dtype=torch.int32), chunk=chunk, tuner=TUNER
    )
    rwte, rwpe = leaf(wte), leaf(wpe)
    ref = rwte[tok.long()] + rwpe
    (ref * dout.double()).sum().backward()
    close("out", out, ref, dtype)
    close("dwte", dwte - dwte0, rwte.grad, dtype)
    close("dwpe", dwpe - dwpe0, rwpe.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_gpu(dtype):
    from microgpt.kernels import layernorm as k

    torch.manual_seed(1)
    x, w, b, dout = rnd(N, C, dtype=dtype), rnd(C, dtype=dtype), rnd(C, dtype=dtype), rnd(N, C, dtype=dtype)
    out, mean, rstd = torch.empty_like(x), torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    k.layernorm_forward(out, mean, rstd, x, w, b, tuner=TUNER)
    dx = torch.zeros_like(x)
    (dw, dw0), (db, db0) = wgrad(C), wgrad(C)
    part = torch.empty(k.scratch_numel(C, SMS), device="cuda")
    k.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, partials=part, tuner=TUNER)
    rx, rw, rb = leaf(x), leaf(w), leaf(b)
    ref = F.layer_norm(rx, (C,), rw, rb, 1e-5)
    (ref * dout.double()).sum().backward()
    close("out", out, ref, dtype)
    close("dx", dx, rx.grad, dtype)
    close("dw", dw - dw0, rw.grad, dtype)
    close("db", db - db0, rb.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("OC", [C, 3 * C])
def test_linear_gpu(dtype, OC):
    from microgpt.kernels import linear as k

    torch.manual_seed(2)
    x, w, dout = rnd(N, C, dtype=dtype), rnd(C, OC, dtype=dtype, scale=0.05), rnd(N, OC, dtype=dtype)
    out = torch.empty(N, OC, device="cuda", dtype=dtype)
    k.linear_forward(out, x, w, mm=MM)
    dx = torch.zeros_like(x)
    dw, dw0 = wgrad(C, OC)
    k.linear_backward(dx, dw, dout, x, w, mm=MM)
    rx, rw = leaf(x), leaf(w)
    ref = rx @ rw
    (ref * dout.double()).sum().backward()
    close("out", out, ref, dtype)
    close("dx", dx, rx.grad, dtype)
    close("dw", dw - dw0, rw.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_qkv_gpu(dtype):
    """The attention's input projection: three weights, one batched GEMM forward and for the weight gradients, the
    input gradient summed over the three (written over what dx held)."""
    from microgpt.kernels import linear as k

    torch.manual_seed(5)
    x, w, dout = rnd(N, C, dtype=dtype), rnd(3, C, C, dtype=dtype, scale=0.05), rnd(3, N, C, dtype=dtype)
    out = torch.empty(3, N, C, device="cuda", dtype=dtype)
    k.linear_forward(out, x, w, mm=MM)
    dx = rnd(N, C, dtype=dtype)
    dw, dw0 = wgrad(3, C, C)
    k.linear_backward(dx, dw, dout, x, w, mm=MM)
    rx, rw = leaf(x), leaf(w)
    ref = torch.stack([rx @ rw[g] for g in range(3)])
    (ref * dout.double()).sum().backward()
    close("out", out, ref, dtype)
    close("dx", dx, rx.grad, dtype)
    close("dw", dw - dw0, rw.grad, dtype)


def attention_reference(q, kk, v, dout):
    """Causal attention in float64 autograd on (b, T, C) inputs: (leaves q, k, v with their grads of sum(out *
    dout), out, the masked scores s)."""
    b, hs = q.shape[0], C // NH
    rq, rk, rv = leaf(q), leaf(kk), leaf(v)
    qh, kh, vh = (z.view(b, T, NH, hs).transpose(1, 2) for z in (rq, rk, rv))
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(hs)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref = (torch.softmax(s, -1) @ vh).transpose(1, 2).reshape(b, T, C)
    (ref * dout.double()).sum().backward()
    return rq, rk, rv, ref, s


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_gpu(dtype):
    from microgpt.kernels import attention as k

    torch.manual_seed(3)
    q, kk, v, dout = (rnd(B, T, C, dtype=dtype) for _ in range(4))
    out, lse = torch.empty_like(q), torch.empty(B, NH, T, device="cuda")
    k.attention_forward(out, lse, q, kk, v, NH, tuner=TUNER)
    dq, dk, dv = (torch.randn_like(q) for _ in range(3))  # written, not added: what they held must not matter
    delta = torch.empty(B * NH * T, device="cuda")
    k.attention_backward(dq, dk, dv, dout, q, kk, v, out, lse, NH, delta=delta, tuner=TUNER)
    rq, rk, rv, ref, s = attention_reference(q, kk, v, dout)
    close("out", out, ref, dtype)
    close("lse", lse, torch.logsumexp(s, -1), dtype)
    close("dq", dq, rq.grad, dtype)
    close("dk", dk, rk.grad, dtype)
    close("dv", dv, rv.grad, dtype)
    dq2, dk2, dv2 = (torch.randn_like(q) for _ in range(3))
    k.attention_backward(dq2, dk2, dv2, dout, q, kk, v, out, lse, NH, delta=delta, tuner=TUNER)
    assert torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2), "backward is deterministic"


@pytest.mark.parametrize("recompute", [False, True], ids=["a-kept", "a-recomputed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_gpu(dtype, recompute):
    from microgpt.kernels import mlp as k

    torch.manual_seed(4)
    x, dout = rnd(N, C, dtype=dtype), rnd(N, C, dtype=dtype)
    w1, w2 = rnd(C, 4 * C, dtype=dtype, scale=0.05), rnd(4 * C, C, dtype=dtype, scale=0.03)
    out, h, a, dh = (torch.empty(N, n, device="cuda", dtype=dtype) for n in (C, 4 * C, 4 * C, 4 * C))
    k.mlp_forward(out, h, a, x, w1, w2, mm=MM)
    if recompute:
        a.normal_()  # a scratch between the calls: backward must not read what forward left there
    dx = torch.zeros_like(x)
    (dw1, dw10), (dw2, dw20) = wgrad(C, 4 * C), wgrad(4 * C, C)
    k.mlp_backward(dx, dw1, dw2, dout, x, h, w1, w2, a, dh, mm=MM, recompute=recompute)
    rx, r1, r2 = leaf(x), leaf(w1), leaf(w2)
    ref = F.gelu(rx @ r1, approximate="tanh") @ r2
    (ref * dout.double()).sum().backward()
    close("out", out, ref, dtype)
    close("dx", dx, rx.grad, dtype)
    close("dw1", dw1 - dw10, r1.grad, dtype)
    close("dw2", dw2 - dw20, r2.grad, dtype)


ACT_REF = {"gelu": lambda h: F.gelu(h, approximate="tanh"), "relu2": lambda h: F.relu(h).square()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mlp_gelu_epilogue_gpu(dtype, monkeypatch):
    """cuBLASLt's GELU_AUX epilogue under every algorithm its heuristic offers, against the GEMM + pass: h bit for
    bit; a within one unit in the last place of tanh-GELU of the exact product plus 1e-5 (cuBLASLt's GELU is within
    6e-6 of tanh-GELU in fp32: dev/gelu_epilogue_bench.py)."""
    from microgpt.kernels import cublaslt
    from microgpt.kernels.gemm import Gemm
    from microgpt.kernels.tuning import Tuner

    lt = cublaslt.CublasLt.load()
    assert lt is not None
    torch.manual_seed(5)
    x, w1 = rnd(N, C, dtype=dtype), rnd(C, 4 * C, dtype=dtype, scale=0.05)
    h0, a0, h, a = (torch.empty(N, 4 * C, device="cuda", dtype=dtype) for _ in range(4))
    monkeypatch.setenv("MICROGPT_MLP_ACT", "pass")
    Gemm(Tuner(), lt).mm_act(a0, h0, x, w1, "gelu")  # a router of its own: no remembered choice overrides the forced
    ref = F.gelu(x.double() @ w1.double(), approximate="tanh")
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0**-14))) - (7 if dtype == torch.bfloat16 else 10))
    n = lt.n_algos(a, x, w1, h, cublaslt.GELU_AUX)
    assert n >= 1
    for i in range(n):
        h.fill_(float("nan"))
        a.fill_(float("nan"))
        lt.gelu_aux(a, h, x, w1, i)
        assert torch.equal(h, h0), f"algorithm {i}: h differs from the GEMM's"
        a1 = a.clone()
        lt.gelu_aux(a, h, x, w1, i)
        assert torch.equal(a, a1) and torch.equal(h, h0), f"algorithm {i}: a second run differs (not deterministic)"
        worst = ((a.double() - ref).abs() / (ulp + 1e-5)).max().item()
        assert worst <= 1.0, f"algorithm {i}: a is {worst:.2f} x (one unit in the last place + 1e-5) from tanh-GELU"


def tma_tiles(dtype) -> list[str]:
    """The TMA tiles' names where this GPU has TMA (sm_90 and newer) and dtype is theirs (16-bit)."""
    from microgpt.kernels import gemm_tma

    return list(gemm_tma.TILES) if torch.cuda.get_device_capability()[0] >= 9 and dtype != torch.float32 else []


@pytest.mark.parametrize("act", ["gelu", "relu2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_act_tiles_gpu(dtype, act):
    """Our Triton tiles with the activation in their epilogues (k_gemm_act, k_gemm_dact; on sm_90 in 16 bits also
    k_gemm_act_tma, k_gemm_dact_tma under each configuration), against the same tile's GEMM under the same
    configuration (k_gemm, k_gemm_tma: one main loop) and the pass: bit for bit (both round the sum first), twice;
    and against float64. ReLU^2's act' reads a, and its forward stores a alone too (the GEMM into a, the pass in
    place), as the modern plan runs it; its dh equals the one from h, 2 max(h, 0), bit for bit (ops/relu2.py)."""
    from microgpt.kernels import gemm, gemm_tma

    torch.manual_seed(6)
    x, w1, w2 = rnd(N, C, dtype=dtype), rnd(C, 4 * C, dtype=dtype, scale=0.05), rnd(4 * C, C, dtype=dtype, scale=0.03)
    dout = rnd(N, C, dtype=dtype)
    h0, a0, h, a, dh0, dh = (torch.empty(N, 4 * C, device="cuda", dtype=dtype) for _ in range(6))
    ways = {"tile": (gemm.triton_mm, gemm.triton_mm_act, gemm.triton_mm_dact)} | {
        name: (
            lambda out, a, b, acc, n=name: gemm_tma.tma_mm(out, a, b, acc, n),
            lambda a, h, x, w, act, n=name: gemm_tma.tma_mm_act(a, h, x, w, act, n),
            lambda dx, dy, w, v, act, n=name: gemm_tma.tma_mm_dact(dx, dy, w, v, act, n),
        )
        for name in tma_tiles(dtype)
    }
    ref = x.double() @ w1.double()
    for way, (mm, mm_act, mm_dact) in ways.items():
        mm(h0, x, w1, False)
        gemm.ACTIVATIONS[act][0](a0, h0)
        mm(dh0, dout, w2.t(), False)
        read = a0 if act == "relu2" else h0  # what act' reads (ops/linear.FROM_OUTPUT)
        gemm.ACTIVATIONS[act][1](dh0, read)
        close(f"{way} h", h0, ref, dtype)
        if act == "relu2":  # the slope from a is 2 max(h, 0), bit for bit, where a is a normal number
            from_h = torch.empty_like(dh0)
            mm(from_h, dout, w2.t(), False)
            from_h = (from_h.float() * 2 * h0.float().clamp_min(0)).to(dtype)
            normal = a0.float() >= torch.finfo(dtype).tiny
            assert torch.equal(dh0[normal], from_h[normal]), way
        for store_h in (True, False) if act == "relu2" else (True,):
            for _ in range(2):
                for t in (h, a, dh):
                    t.fill_(float("nan"))
                mm_act(a, h if store_h else None, x, w1, act)
                mm_dact(dh, dout, w2.t(), a if act == "relu2" else h, act)
                assert torch.equal(a, a0) and torch.equal(dh, dh0), way
                assert torch.equal(h, h0) if store_h else h.isnan().all(), way


@pytest.mark.parametrize("act", ["gelu", "relu2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_act_epilogues_gpu(dtype, act, monkeypatch):
    """mlp_forward and mlp_backward with each way of the router's mm_act (pass, tile, the TMA tiles on sm_90 in 16
    bits, cuBLASLt's lt0 for GELU in bf16 and fp16) and mm_dact (pass, tile, the TMA tiles) forced, against
    autograd; ReLU^2 as the modern plan runs it (a alone, no h)."""
    from microgpt.kernels import cublaslt, linear
    from microgpt.kernels import mlp as k
    from microgpt.kernels.gemm import Gemm
    from microgpt.kernels.tuning import Tuner

    lt = cublaslt.CublasLt.load()
    torch.manual_seed(5)
    x, w1, w2 = rnd(N, C, dtype=dtype), rnd(C, 4 * C, dtype=dtype, scale=0.05), rnd(4 * C, C, dtype=dtype, scale=0.03)
    dout = rnd(N, C, dtype=dtype)
    out, h, a, dh = (torch.empty(N, n, device="cuda", dtype=dtype) for n in (C, 4 * C, 4 * C, 4 * C))
    rx, r1, r2 = leaf(x), leaf(w1), leaf(w2)
    ref = ACT_REF[act](rx @ r1) @ r2
    (ref * dout.double()).sum().backward()
    fwd = ["pass", "tile", *tma_tiles(dtype)] + (["lt0"] if act == "gelu" and dtype != torch.float32 else [])
    bwd = ["tile", "pass", *tma_tiles(dtype), "tile"]
    for way, bway in zip(fwd, bwd, strict=False):
        monkeypatch.setenv("MICROGPT_MLP_ACT", way)
        monkeypatch.setenv("MICROGPT_MLP_DACT", bway)
        mm = linear.Matmul(Gemm(Tuner(), lt))  # a router of its own: no remembered choice overrides the forced ones
        kept = None if act == "relu2" else h
        k.mlp_forward(out, kept, a, x, w1, w2, mm=mm, act=act)
        dx = torch.zeros_like(x)
        (dw1, dw10), (dw2, dw20) = wgrad(C, 4 * C), wgrad(4 * C, C)
        k.mlp_backward(dx, dw1, dw2, dout, x, kept, w1, w2, a, dh, mm=mm, recompute=False, act=act)
        close(f"{way} out", out, ref, dtype)
        close(f"{bway} dx", dx, rx.grad, dtype)
        close(f"{bway} dw1", dw1 - dw10, r1.grad, dtype)
        close(f"{way} dw2", dw2 - dw20, r2.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_every_way_gpu(dtype):
    """Every way the GEMM router's mm and bmm may choose (the Triton tiles, the TMA tiles on sm_90 in 16 bits,
    torch's cuBLAS call, cuBLASLt under each algorithm its heuristic offers) for the kinds of GEMM a step runs:
    plain, a transposed operand, low-precision operands added into fp32 weight gradients (the randn outputs),
    batched with one input repeated by a zero batch stride, and an input only 8-byte aligned. Each against float64,
    each run twice (the same bits: no way may add with atomics); where it adds, what it added is compared."""
    torch.manual_seed(8)
    x, dout, w = rnd(N, C, dtype=dtype), rnd(N, 3 * C, dtype=dtype, scale=0.1), rnd(C, 3 * C, dtype=dtype, scale=0.05)
    w3, dq3 = rnd(3, C, C, dtype=dtype, scale=0.05), rnd(3, N, C, dtype=dtype)
    empty = dict(device="cuda", dtype=dtype)
    shifted = torch.empty(N * C + 8, **empty)[8 // x.element_size() :][: N * C].view(N, C)
    shifted.copy_(x)  # 8 bytes past a 256-byte boundary: the heuristic must offer only algorithms that run there
    kinds = {  # name: (out, a, b, accumulate)
        "x @ w": (torch.empty(N, 3 * C, **empty), x, w, False),
        "dout @ w^T": (torch.empty(N, C, **empty), dout, w.t(), False),
        "dw += x^T @ dout": (torch.randn(C, 3 * C, device="cuda"), x.t(), dout, True),
        "qkv = x @ w[g]": (torch.empty(3, N, C, **empty), x.expand(3, N, C), w3, False),
        "dw[g] += x^T @ dq[g]": (torch.randn(3, C, C, device="cuda"), x.t().expand(3, C, N), dq3, True),
        "x (8-byte aligned) @ w": (torch.empty(N, 3 * C, **empty), shifted, w, False),
    }
    for name, (out, a, b, acc) in kinds.items():
        start, ref = out.clone(), a.double() @ b.double()
        ways = GEMM._ways(out, a, b)
        assert any(w.startswith("lt") for w in ways) or a is shifted, f"{name}: no cuBLASLt algorithm offered"
        for way in ways:
            out.copy_(start)
            GEMM._run(way, out, a, b, acc)
            first = out.clone()
            out.copy_(start)
            GEMM._run(way, out, a, b, acc)
            assert torch.equal(out, first), f"{name} by {way}: a second run differs"
            close(f"{name} by {way}", out.double() - start.double() if acc else out, ref, dtype)


def test_gemm_scaled_every_way_gpu():
    """Every way the router's mm_scaled may choose for fp8's GEMMs (torch._scaled_mm; cuBLASLt's FP8 GEMM under each
    algorithm its heuristic offers) for the kinds a step runs: the forward, the input gradient, a weight gradient
    added into fp32 (2D, and batched with one input repeated by a zero batch stride), the QKV forward batched, and
    the head's logits. E4M3 operands at power-of-two scales; each way against float64 on the same operands, run
    twice (the same bits); where it adds, what it added is compared, and only cuBLASLt may add without the
    scratch."""
    torch.manual_seed(9)
    f8 = torch.float8_e4m3fn

    def e4m3(*shape):  # an E4M3 operand and its inverse scale, a (1,) device tensor
        q = (torch.randn(*shape, device="cuda") * 64).to(f8)
        return q, torch.tensor([2.0 ** -torch.randint(4, 9, ()).item()], device="cuda")

    x8, ix = e4m3(N, C)  # activation rows
    g8, ig = e4m3(N, 3 * C)  # output-gradient rows
    xt, ixt = e4m3(C, N)  # the saved transposed activation
    g8t, igt = e4m3(3, C, N)  # the output gradients, transposed
    w8, iw = e4m3(C, 3 * C)  # a site's weights as the input gradient reads them
    w8t, iwt = e4m3(3, C, C)  # ... and transposed, as the forward reads them
    wte8, iwte = e4m3(V, C)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    kinds = {  # name: (out, a, ia, b, ib, accumulate)
        "y = x8 @ w8t^T": (torch.empty(N, C, **bf), x8, ix, w8t[0].t(), iwt, False),
        "qkv = x8 @ w8t[g]^T": (torch.empty(3, N, C, **bf), x8.expand(3, N, C), ix, w8t.transpose(1, 2), iwt, False),
        "dx = g8 @ w8^T": (torch.empty(N, C, **bf), g8, ig, w8.t(), iw, False),
        "dw += xt @ g8t^T": (torch.randn(C, C, device="cuda"), xt, ixt, g8t[0].t(), igt, True),
        "dw[g] += xt @ g8t[g]^T": (
            torch.randn(3, C, C, device="cuda"),
            xt.expand(3, C, N),
            ixt,
            g8t.transpose(1, 2),
            igt,
            True,
        ),
        "logits = x8 @ wte8^T": (torch.empty(1024, V, **bf), x8[:1024], ix, wte8.t(), iwte, False),
    }
    wgrad_scratch = torch.zeros(4 * C * C, device="cuda")
    for name, (out, a, ia, b, ib, acc) in kinds.items():
        start = out.clone()
        ref = (a.double() @ b.double()) * (ia.double() * ib.double())
        ways = ["scaled_mm"] + [f"lt{i}" for i in range(GEMM.lt.n_algos(out, a, b, scales=(ia, ib)))]
        assert len(ways) > 1, f"{name}: cuBLASLt offers no FP8 algorithm"
        for way in ways:
            scratch = wgrad_scratch if way == "scaled_mm" else None  # cuBLASLt adds in its epilogue: no scratch
            for run in range(2):
                out.copy_(start)
                if way == "scaled_mm":
                    torch_scaled_mm(out, a, ia, b, ib, acc, scratch)
                else:
                    GEMM.lt.gemm(out, a, b, acc, int(way[2:]), ia, ib)
                if run == 0:
                    first = out.clone()
            assert torch.equal(out, first), f"{name} by {way}: a second run differs"
            got = out.double() - start.double() if acc else out
            # bf16 outputs: bf16's rounding; fp32 sums of the FP8 tensor cores, narrower than fp32's: 5e-4
            err = ((got.double() - ref).norm() / ref.norm()).item()
            assert err < (1e-2 if out.dtype == torch.bfloat16 else 5e-4), f"{name} by {way}: rel err {err:.2e}"


def test_attention_every_configuration_gpu(monkeypatch):
    """Each tile configuration the warm-up may choose for attention, forced, against autograd (bf16, T 1024)."""
    from microgpt.kernels import attention as k

    torch.manual_seed(6)
    q, kk, v, dout = (rnd(1, T, C, dtype=torch.bfloat16) for _ in range(4))
    rq, rk, rv, ref, _ = attention_reference(q, kk, v, dout)
    out, lse, delta = torch.empty_like(q), torch.empty(1, NH, T, device="cuda"), torch.empty(NH * T, device="cuda")
    for half, n in (("FWD", len(k.FWD_CONFIGS)), ("BWD", len(k.BWD_CONFIGS))):
        for i in range(n):
            monkeypatch.setenv(f"MICROGPT_ATTENTION_{half}", str(i))
            dq, dk, dv = (torch.randn_like(q) for _ in range(3))
            k.attention_forward(out, lse, q, kk, v, NH, tuner=TUNER)
            k.attention_backward(dq, dk, dv, dout, q, kk, v, out, lse, NH, delta=delta, tuner=TUNER)
            for name, got, want in (("out", out, ref), ("dq", dq, rq.grad), ("dk", dk, rk.grad), ("dv", dv, rv.grad)):
                close(f"{half.lower()} config {i}: {name}", got, want, torch.bfloat16)
        monkeypatch.delenv(f"MICROGPT_ATTENTION_{half}")


def test_crossentropy_every_configuration_gpu():
    """Each launch configuration of the cross-entropy row kernel (max per lane or per block) at the vocabulary of
    50,304: loss, lse and dlogits against float64 autograd."""
    from microgpt.kernels import crossentropy as k

    torch.manual_seed(7)
    r = 64
    logits = rnd(r, V, dtype=torch.bfloat16, scale=3.0)
    targets = torch.randint(0, V, (r,), device="cuda", dtype=torch.int32)
    targets[5] = -1
    dloss = torch.rand(r, device="cuda")
    lg = leaf(logits)
    loss_ref = F.cross_entropy(lg, targets.long(), ignore_index=-1, reduction="none")
    (loss_ref * dloss.double()).sum().backward()
    lse_ref, d_ref = torch.logsumexp(lg, -1), lg.grad
    for name, config in k.ROW_CONFIGS.items():
        g, loss, lse = logits.clone(), torch.empty(r, device="cuda"), torch.empty(r, device="cuda")
        k.row_launch(loss, lse, g, targets, dloss, V, *config)()
        close(f"{name}: lse", lse, lse_ref, torch.float32)
        close(f"{name}: loss", loss, loss_ref, torch.float32)
        close(f"{name}: dlogits", g, d_ref, torch.bfloat16)


def test_embedding_sort_every_configuration_gpu(monkeypatch):
    """Each launch configuration of the embedding's sort gives the stable order by token, chunk by chunk."""
    from microgpt.kernels import embedding as k
    from microgpt.kernels.tuning import Tuner

    torch.manual_seed(8)
    S, n = k.CHUNK, 2 * k.CHUNK + 3 * T
    tok = torch.randint(0, 300, (n,), device="cuda", dtype=torch.int32)  # few distinct tokens: long runs
    want = torch.cat([torch.argsort(tok[c : c + S], stable=True) for c in range(0, n, S)]).to(torch.int32)
    for name in k.SORT_CONFIGS:
        monkeypatch.setenv("MICROGPT_EMBEDDING_SORT", name)
        order = torch.full((n,), -1, device="cuda", dtype=torch.int32)
        k.sort_tokens(order, tok, S, V, Tuner())  # a tuner of its own: no remembered configuration
        assert torch.equal(order, want), f"sort configuration {name}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_crossentropy_gpu(dtype):
    from microgpt.kernels import crossentropy as k

    torch.manual_seed(5)
    x, wte = rnd(N, C, dtype=dtype), rnd(V, C, dtype=dtype, scale=0.05)
    tgt = torch.randint(0, V, (N,), device="cuda", dtype=torch.int32)
    tgt[::7] = -1
    n_valid = int((tgt >= 0).sum())
    # fp16 runs with a loss scale (the engine's default 2^16): unscaled, most of p*dl (~1e-9) underflows fp16
    scale = 2.0**16 if dtype == torch.float16 else 1.0
    dl = torch.where(tgt >= 0, scale / n_valid, 0.0).float()
    logits = torch.empty(2048, V, device="cuda", dtype=dtype)
    losses, lse = torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    k.crossentropy_forward(losses, lse, x, wte, tgt, logits, mm=MM, tuner=TUNER)
    dx = torch.zeros_like(x)
    dwte, dwte0 = wgrad(V, C)
    dwte *= 1e-6 * scale  # noise at the gradient's scale (~1/N): fp32 rounding of noise + grad must not swamp it
    dwte0 = dwte.clone()
    k.crossentropy_backward(dx, dwte, dl, x, wte, tgt, lse, logits, mm=MM, tuner=TUNER)
    rx, rw = leaf(x), leaf(wte)
    lg = rx @ rw.t()
    ref = F.cross_entropy(lg, tgt.long(), ignore_index=-1, reduction="none")
    ref.sum().mul(scale / n_valid).backward()
    close("losses", losses, ref, dtype)
    close("lse", lse, torch.logsumexp(lg, -1), dtype)
    close("dx", dx, rx.grad, dtype)
    close("dwte", dwte - dwte0, rw.grad, dtype)
    # the training call: the same numbers without the recomputing GEMM
    fused = [torch.empty_like(losses), torch.empty_like(lse), torch.zeros_like(x), dwte0.clone()]
    k.crossentropy_forward_backward(*fused, dl, x, wte, tgt, logits, mm=MM, tuner=TUNER)
    for name, a, b in zip(("losses", "lse", "dx", "dwte"), fused, (losses, lse, dx, dwte)):
        assert torch.equal(a, b), f"{name}: forward_backward differs from forward + backward"


def test_optimizer_gpu():
    from microgpt.kernels import adamw, gradclip

    torch.manual_seed(6)
    n = 10_000_019
    g = torch.randn(n, device="cuda") * 1e-3
    P = -(-n // 65536)
    part, norm = torch.empty(P, device="cuda"), torch.empty(1, device="cuda")
    gradclip.grad_norm_partial(part, g, 65536)
    gradclip.grad_norm_final(norm, part)
    close("norm", norm, g.double().norm().reshape(1), torch.float32)
    p = torch.randn(n, device="cuda")
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    mask = (torch.rand(n, device="cuda") < 0.9).to(torch.uint8)
    ref = p.clone().requires_grad_(False)
    rp = [ref.clone()]
    opt = torch.optim.AdamW(rp, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    rp[0].grad = g.clone()
    rp[0].mul_(1 - 1e-3 * 0.1 * mask.float())  # decoupled decay where the mask is 1
    opt.step()
    hyper = torch.tensor([1e-3, 1 - 0.9, 1 - 0.95, 1.0], device="cuda")  # step 1, gscale 1, no clip
    adamw.adamw_step(p, g.clone(), m, v, mask, None, hyper, norm, 0.9, 0.95, 1e-8, 0.1, float("inf"))
    close("p", p, rp[0], torch.float32)


def _e4m3(x):
    """x -> (E4M3 of x * 2^k, 2^-k) by torch's own conversion, k by the rule of microgpt/fp8.py."""
    from microgpt.fp8 import scale_exponent

    k = scale_exponent(x.abs().max().item())
    return (x.float() * 2.0**k).to(torch.float8_e4m3fn), 2.0**-k


def _dq(x):
    q, inv = _e4m3(x)
    return leaf(q.double() * inv)


def test_linear_fp8_gpu():
    """The QKV site at ANDREA-120M shapes (one scale over its three weights and over its three output gradients),
    cuBLASLt's FP8 GEMMs, bf16 activations: against float64 autograd on the same E4M3 operands."""
    from microgpt.fp8 import OSLOT, SCRATCH, SLOT, Fp8Weight, Priming
    from microgpt.kernels import fp8, linear

    torch.manual_seed(7)
    G = 3
    master = rnd(G, C, C, scale=0.02)
    f8 = torch.float8_e4m3fn
    w = Fp8Weight(
        "w",
        master,
        torch.empty(C, G * C, dtype=f8, device="cuda"),
        torch.empty(G, C, C, dtype=f8, device="cuda"),
        torch.zeros(SLOT, device="cuda"),
        torch.zeros(OSLOT, device="cuda"),
        torch.zeros(OSLOT, device="cuda"),
        Priming(True),
        torch.empty(C * N, dtype=f8, device="cuda"),
    )
    scratch = {name: torch.zeros(N * 4 * C, dtype=f8, device="cuda") for name in SCRATCH}
    mm = fp8.Matmul(GEMM, None, {**scratch, "fp8_wgrad": torch.zeros(4 * C * C, device="cuda")})
    mm.cast_weights([w])
    x, dout = rnd(N, C, dtype=torch.bfloat16), rnd(G, N, C, dtype=torch.bfloat16, scale=1e-3)
    out = torch.empty(G, N, C, dtype=torch.bfloat16, device="cuda")
    linear.linear_forward(out, x, w, mm=mm)
    dx, (dw, dw0) = rnd(N, C, dtype=torch.bfloat16), wgrad(G, C, C)
    linear.linear_backward(dx, dw, dout, x, w, mm=mm)
    rx, rw = _dq(x), _dq(master)
    dcat, dinv = _e4m3(torch.cat(list(dout), dim=1))
    rd = dcat.double() * dinv
    ref = torch.stack([rx @ rw[g] for g in range(G)])
    ref.backward(torch.stack([rd[:, g * C : (g + 1) * C] for g in range(G)]))
    close("out", out, ref, torch.bfloat16)
    close("dx", dx, rx.grad, torch.bfloat16)
    # fp32 out of the FP8 tensor cores, whose sums are narrower than fp32's (tests/kernels/test_fp8.py)
    err = ((dw - dw0).double() - rw.grad).norm() / rw.grad.norm()
    assert err < 5e-4, f"dw: rel err {err:.2e}"


def _three_steps(rng) -> list:
    """Three optimizer steps' inputs for the small step tests: two micro-batches of (tokens, targets), each (2, 64)
    over a vocabulary of 128."""
    import numpy as np

    return [
        [tuple(rng.integers(0, 128, (2, 64)).astype(np.int32) for _ in range(2)) for _ in range(2)] for _ in range(3)
    ]


def test_fp8_step_gpu():
    """Three optimizer steps of a small model, fp8 on the GPU (bf16 activations, cuBLASLt FP8 GEMMs; the first step
    primes the amax histories eagerly, the others replay the CUDA graph) against the NumPy reference's fp8 (fp32
    activations, the same casts): losses, gradient norms and the histories agree to bf16's precision; the E4M3
    weight copies are torch's cast of the updated masters."""
    import numpy as np

    from microgpt.config import ModelConfig, TrainConfig
    from microgpt.engine.backend import numpy_backend, triton_backend
    from microgpt.engine.state import make_state
    from microgpt.engine.step import Step

    m = ModelConfig(vocab_size=128, d_model=64, n_layer=2, n_head=2, seq_len=64)
    steps = _three_steps(np.random.default_rng(8))
    res, hist = {}, {}
    for name in ("numpy", "triton"):
        t = TrainConfig(micro_batch=2, n_micro=2, precision="fp8", backend=name, grad_clip=1.0)
        S = make_state(m, t, numpy_backend(precision_name="fp8") if name == "numpy" else triton_backend("fp8"))
        step = Step(S)
        res[name] = [step(b, 1e-3) for b in steps]
        hist[name] = S.K.to_numpy(S.arena["fp8_slots"])[..., 4:]
    assert (hist["numpy"][..., :6] > 0).all() and not hist["numpy"][..., 6:].any()  # 6 micro-batches so far
    # an amax is one element: bf16 activations (and their rounding before a cast) move it by up to a few percent
    np.testing.assert_allclose(hist["triton"], hist["numpy"], rtol=0.1)
    for a, b in zip(res["triton"], res["numpy"]):
        assert abs(a.loss - b.loss) < 1e-2 * abs(b.loss), (a.loss, b.loss)
        assert abs(a.grad_norm - b.grad_norm) < 3e-2 * b.grad_norm, (a.grad_norm, b.grad_norm)
    assert S.prec.head is not None  # the LM head's logits GEMM runs in E4M3 too (vocabulary 128)
    for name, w in [*((w.name, w) for w in S.prec.sites), ("lm_head", S.prec.head)]:
        q, inv = _e4m3(w.master)
        got, want = (w.w8, q) if w.w8t is None else (w.w8t, q.transpose(1, 2).contiguous())
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        assert w.scale[0].item() == inv


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_gelu_step_gpu(precision, monkeypatch):
    """Three optimizer steps of two micro-batches on the triton backend with a = gelu(h) saved per layer and with
    train.recompute_gelu: the same losses, norms and weights, bit for bit, once both compute a the same way (GELU as
    the pass: cuBLASLt's epilogue rounds differently; one GEMM way: the plans' buffers have other alignments)."""
    import numpy as np

    from microgpt.config import ModelConfig, TrainConfig
    from microgpt.engine.backend import triton_backend
    from microgpt.engine.state import make_state
    from microgpt.engine.step import Step

    # each backend's runtime has its own tuner and router: nothing one run chose is remembered by the other
    monkeypatch.setenv("MICROGPT_MLP_ACT", "pass")
    monkeypatch.setenv("MICROGPT_MLP_DACT", "pass")
    monkeypatch.setenv("MICROGPT_GEMM", "cublas")
    m = ModelConfig(vocab_size=128, d_model=64, n_layer=3, n_head=2, seq_len=64)
    steps = _three_steps(np.random.default_rng(9))
    runs = []
    for recompute in (False, True):
        t = TrainConfig(micro_batch=2, n_micro=2, precision=precision, backend="triton", recompute_gelu=recompute)
        S = make_state(m, t, triton_backend(precision))
        assert (S.arena["a"].dim() == 2) is recompute
        step = Step(S)
        results = [step(b, 1e-3) for b in steps]
        runs.append(([(r.loss, r.grad_norm) for r in results], S.K.to_numpy(S.p).tobytes()))
        step.release()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("config", list(kc.ROW_CONFIGS))
def test_crossentropy_row_with_gradient_repeats_gpu(config):
    """Training's row kernel (GRAD: dlogits written in place) reports, at every launch, the losses of the kernel
    without the gradient: its read of the target's logit cannot race with the in-place stores (issue 35)."""
    rows = 2048
    saved, targets = rnd(rows, V, dtype=torch.bfloat16, scale=0.3), torch.randint(0, V, (rows,), device="cuda")
    targets = targets.to(torch.int32)
    want, lse, losses = (torch.empty(rows, device="cuda") for _ in range(3))
    logits = saved.clone()
    kc.row_launch(want, lse, logits, targets, None, V, *kc.ROW_CONFIGS[config])()
    dlosses = torch.full((rows,), 1.0 / rows, device="cuda")
    differing = 0
    for _ in range(64):
        logits.copy_(saved)
        kc.row_launch(losses, lse, logits, targets, dlosses, V, *kc.ROW_CONFIGS[config])()
        differing += int((losses.view(torch.int32) != want.view(torch.int32)).sum())
    assert differing == 0, f"{differing} losses of 64 x {rows} rows differ from the forward's"
