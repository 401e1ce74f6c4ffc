"""MLP: h = x @ w1 (saved, pre-GELU), a = gelu_tanh(h) (scratch), out = a @ w2. x:(N,C), w1:(C,4C), w2:(4C,C).

Saving h and recomputing a in backward costs one elementwise pass and saves an (N,4C) activation per layer.
Backward (all grads accumulate):
    dh = dout @ w2.T                       (GEMM into the dh scratch)
    a = gelu(h); dh *= gelu'(h)            (k_mlp_bwd: one pass over h and dh writes a and dh)
    dw2 += a.T @ dout ; dw1 += x.T @ dh ; dx = dh @ w1.T (written: its one writer)
The GEMMs go through linear.mm (Triton or cuBLAS, chosen once per shape); with Fp8Weights (precision "fp8")
through fp8.mm8 on E4M3 operands, and GELU and its backward run inside the casts of a and dh (fp8.py).

The two GEMMs that meet GELU (h = x @ w1 in forward, da = dout @ w2.T in backward: both (N,C) @ (C,4C)) may instead
run as one Triton GEMM with GELU in its epilogue (k_mlp_gemm_gelu): forward stores h and a = gelu(h) from the tile
it just summed, backward reads h and stores dh and a, so the (N,4C) elementwise pass and its extra reads and writes
are gone. Every value is the unfused path's (the tile is rounded to the compute type before GELU, as the
stored h and da are). Which runs, fused in one of FUSED_CONFIGS or cuBLAS then the pass, is timed once per GPU and
shape in the warm-up (tuning.py, table "mlp_gelu"); the interpreter runs the fused kernel (MICROGPT_MLP_GELU=name
forces one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from microgpt.fp8 import Fp8Weight
from microgpt.kernels import fp8, tuning
from microgpt.kernels.gelu import gelu, gelu_grad
from microgpt.kernels.gemm import gemm_acc
from microgpt.kernels.linear import mm

BLOCK = 2048


@triton.jit
def k_mlp_fwd(a_ptr, h_ptr, n, BLOCK: tl.constexpr):
    # a, h: (n,) = (N*4C,); a = gelu_tanh(h)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    tl.store(a_ptr + offs, gelu(h).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_mlp_bwd(a_ptr, dh_ptr, h_ptr, n, BLOCK: tl.constexpr):
    # a, dh, h: (n,); in: dh holds d(gelu output); out: a = gelu(h), dh = dh * gelu'(h)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    da = tl.load(dh_ptr + offs, mask=mask).to(tl.float32)
    tl.store(dh_ptr + offs, (da * gelu_grad(h)).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(a_ptr + offs, gelu(h).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_mlp_gemm_gelu(out_ptr, a_ptr, h_ptr, x_ptr, w_ptr, M, N, K, sxm, sxk, swk, swn, BWD: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    IEEE: tl.constexpr):  # fmt: skip
    # y = x (M,K) @ w (K,N), any strides; out, a, h: (M,N) row-major.
    # forward: out = h = y, a = gelu(h). BWD: y is da; h is read; out = dh = da * gelu'(h), a = gelu(h).
    acc, offs_m, offs_n = gemm_acc(x_ptr, w_ptr, M, N, K, sxm, sxk, swk, swn, tl.program_id(0),
                                   BM, BN, BK, GROUP_M, IEEE)  # fmt: skip
    offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32)  # the stored h (forward) or da (backward) of the unfused path
    if BWD:
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (y * gelu_grad(h)).to(dtype), mask=mask)
    else:
        h = y
        tl.store(out_ptr + offs, y.to(dtype), mask=mask)
    tl.store(a_ptr + offs, gelu(h).to(dtype), mask=mask)


@triton.jit
def k_mlp_gemm_gelu_tma(out_desc, a_desc, h_desc, x_desc, w_desc, M, N, K, BWD: tl.constexpr, W_T: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                        PROGRAMS: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    # k_mlp_gemm_gelu persistent, through TMA descriptors: PROGRAMS programs each take tiles pid, pid + PROGRAMS, ...
    # (grouped as gemm_acc orders them). x (M,K); w (K,N), or with W_T its (N,K) rows; out, a, h (M,N).
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True, warp_specialize=WS):
        first_m = (tile // group) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        om = (first_m + (tile % group) % gsize) * BM
        on = ((tile % group) // gsize) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            x = x_desc.load([om, k])
            if W_T:
                acc = tl.dot(x, w_desc.load([on, k]).T, acc)
            else:
                acc = tl.dot(x, w_desc.load([k, on]), acc)
        dtype = out_desc.dtype
        y = acc.to(dtype).to(tl.float32)  # the stored h (forward) or da (backward) of the unfused path
        if BWD:
            h = h_desc.load([om, on]).to(tl.float32)
            out_desc.store([om, on], (y * gelu_grad(h)).to(dtype))
        else:
            h = y
            out_desc.store([om, on], y.to(dtype))
        a_desc.store([om, on], gelu(h).to(dtype))


# Tile configurations of the fused GEMM (BM, BN, BK, warps, stages): candidates against cuBLAS + the pass. fp32
# (checks, not speed) and the interpreter get one each.
# The "tma" ones run persistent on TMA descriptors (the last field: warp specialization), the others one program per
# tile on pointers.
FUSED_CONFIGS = {"tma-128x256w8": (128, 256, 64, 8, 3, False), "tma-128x128w8": (128, 128, 64, 8, 4, False),
                 "tma-128x256w8-ws": (128, 256, 64, 8, 3, True), "tma-128x128w4-ws": (128, 128, 64, 4, 4, True),
                 "fused-128x256w8": (128, 256, 64, 8, 3), "fused-256x128w8": (256, 128, 64, 8, 3)}  # fmt: skip
FP32_CONFIG = {"fused-fp32": (128, 64, 32, 8, 3)}
INTERPRET_CONFIG = {"fused": (32, 32, 32, 4, 1), "tma": (32, 32, 32, 4, 1, False)}
_sms: list[int] = []


def _gemm_gelu(out: torch.Tensor, a: torch.Tensor, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bwd: bool,
               unfused: Callable[[], None]) -> None:  # fmt: skip
    """out, a (M,N) from x (M,K) @ w (K,N) with GELU after (forward) or its backward (bwd): fused in one of
    FUSED_CONFIGS, or `unfused`, whichever the warm-up timed faster for this shape."""
    (M, K), N = x.shape, w.shape[1]

    def fused(BM: int, BN: int, BK: int, warps: int, stages: int) -> Callable[[], None]:
        grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
        return lambda: k_mlp_gemm_gelu[grid](out, a, h, x, w, M, N, K, *x.stride(), *w.stride(), BWD=bwd, BM=BM,
                                             BN=BN, BK=BK, GROUP_M=8, IEEE=x.dtype == torch.float32,
                                             num_warps=warps, num_stages=stages)  # fmt: skip

    w_t = w.stride(0) == 1  # w (K,N) is the transpose of a row-major (N,K)
    wr = w.t() if w_t else w

    def tma(BM: int, BN: int, BK: int, warps: int, stages: int, ws: bool) -> Callable[[], None]:
        if not _sms:
            _sms.append(torch.cuda.get_device_properties(out.device).multi_processor_count if out.is_cuda else 2)
        blocks = {"out": (out, [BM, BN]), "a": (a, [BM, BN]), "h": (h, [BM, BN]), "x": (x, [BM, BK]),
                  "w": (wr, [BN, BK] if w_t else [BK, BN])}  # fmt: skip
        d = {k: TensorDescriptor.from_tensor(t, block) for k, (t, block) in blocks.items()}
        programs = min(_sms[0], triton.cdiv(M, BM) * triton.cdiv(N, BN))
        return lambda: k_mlp_gemm_gelu_tma[(programs,)](d["out"], d["a"], d["h"], d["x"], d["w"], M, N, K, BWD=bwd,
                                                        W_T=w_t, BM=BM, BN=BN, BK=BK, GROUP_M=8, PROGRAMS=programs,
                                                        WS=ws, num_warps=warps, num_stages=stages)  # fmt: skip

    if tuning.INTERPRET or not out.is_cuda:
        configs = INTERPRET_CONFIG
    else:
        configs = FP32_CONFIG if x.dtype == torch.float32 else FUSED_CONFIGS
    # TMA needs rows of a multiple of 16 bytes (the layer shapes have them; some tests' do not)
    tma_ok = all(t.stride(0) * t.element_size() % 16 == 0 for t in (out, a, h, x, wr))
    fusions = {
        name: (tma if len(cfg) == 6 else fused)(*cfg) for name, cfg in configs.items() if len(cfg) == 5 or tma_ok
    }
    # untimed runs take the first: on a GPU what ran before, in the interpreter the fused kernel (CI runs it)
    candidates = fusions | {"unfused": unfused} if tuning.INTERPRET else {"unfused": unfused} | fusions
    key = f"{M}x{K}x{N}:{w.stride()}:{x.dtype}:{'bwd' if bwd else 'fwd'}"
    candidates[tuning.choose("mlp_gelu", key, candidates)]()


def mlp_forward(out: torch.Tensor, h: torch.Tensor, a: torch.Tensor, x: torch.Tensor, w1: torch.Tensor | Fp8Weight,
                w2: torch.Tensor | Fp8Weight, q: fp8.Scratch | None = None) -> None:  # fmt: skip
    C, H = w1.shape
    h2, a2, x2 = h.view(-1, H), a.view(-1, H), x.view(-1, C)
    if isinstance(w1, Fp8Weight) and isinstance(w2, Fp8Weight):
        _mlp_forward_fp8(out.view(-1, C), h2, x2, w1, w2, q)
        return

    def unfused() -> None:
        mm(h2, x2, w1)
        k_mlp_fwd[(triton.cdiv(h2.numel(), BLOCK),)](a2, h2, h2.numel(), BLOCK=BLOCK)

    _gemm_gelu(h2, a2, h2, x2, w1, False, unfused)
    mm(out.view(-1, C), a2, w2)


def _mlp_forward_fp8(out: torch.Tensor, h: torch.Tensor, x: torch.Tensor, w1: Fp8Weight, w2: Fp8Weight,
                     q: fp8.Scratch) -> None:  # fmt: skip
    """mlp_forward's two GEMMs on E4M3 operands (2D views: x, out (N,C); h (N,H)). Each input is cast once, into the
    rows its GEMM reads and the transpose its site keeps for the weight gradient; a = gelu(h) only ever exists in
    E4M3 (its cast computes GELU)."""
    (N, C), H = x.shape, h.shape[1]
    x8, a8 = q.view(q.x8, N, C), q.view(q.x8, N, H)
    fp8.cast(x, w1.xslot, x8, w1.xt.view(C, N), w1.priming.on)
    fp8.mm8(h, x8, w1.xslot[:1], w1.w8t[0].t(), w1.scale[:1])
    fp8.cast(h, w2.xslot, a8, w2.xt.view(H, N), w2.priming.on, op=fp8.GELU)
    fp8.mm8(out, a8, w2.xslot[:1], w2.w8t[0].t(), w2.scale[:1])


def mlp_backward(
    dx: torch.Tensor,
    dw1: torch.Tensor,
    dw2: torch.Tensor,
    dout: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    w1: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    a: torch.Tensor,
    dh: torch.Tensor,
    q: fp8.Scratch | None = None,
) -> None:
    C, H = w1.shape
    h2, a2, dh2 = h.view(-1, H), a.view(-1, H), dh.view(-1, H)
    dout2, x2 = dout.view(-1, C), x.view(-1, C)
    if isinstance(w1, Fp8Weight) and isinstance(w2, Fp8Weight):
        _mlp_backward_fp8(dx.view(-1, C), dw1, dw2, dout2, x2, h2, w1, w2, dh2, q)
        return

    def unfused() -> None:
        mm(dh2, dout2, w2.t())
        k_mlp_bwd[(triton.cdiv(h2.numel(), BLOCK),)](a2, dh2, h2, h2.numel(), BLOCK=BLOCK)

    _gemm_gelu(dh2, a2, h2, dout2, w2.t(), True, unfused)
    mm(dw2, a2.t(), dout2, accumulate=True)
    mm(dw1, x2.t(), dh2, accumulate=True)
    mm(dx.view(-1, C), dh2, w1.t())


def _mlp_backward_fp8(dx: torch.Tensor, dw1: torch.Tensor, dw2: torch.Tensor, dout: torch.Tensor, x: torch.Tensor,
                      h: torch.Tensor, w1: Fp8Weight, w2: Fp8Weight, da: torch.Tensor,
                      q: fp8.Scratch) -> None:  # fmt: skip
    """mlp_backward's six GEMMs on E4M3 operands (2D views: x, dout, dx (N,C); h, da (N,H)). The inputs' E4M3 copies
    (x, a = gelu(h)) are the forward's, saved transposed with their sites (w1.xt, w2.xt); dh = da * gelu'(h) only
    ever exists in E4M3 (its cast computes it), in the gradient scratch once dw2 is done with dout's."""
    (N, C), H = x.shape, h.shape[1]
    g8, g8t = q.view(q.g8, N, C), q.view(q.g8t, C, N)
    fp8.cast(dout, w2.gslot, g8, g8t, w2.priming.on)
    fp8.mm8(da, g8, w2.gslot[:1], w2.w8.t(), w2.scale[:1])  # the gradient reaching a
    fp8.mm8(dw2, w2.xt.view(H, N), w2.xslot[:1], g8t.t(), w2.gslot[:1], accumulate=True, wgrad=q.wgrad)
    dh8, dh8t = q.view(q.g8, N, H), q.view(q.g8t, H, N)
    fp8.cast(h, w1.gslot, dh8, dh8t, w1.priming.on, op=fp8.GELU_GRAD, x2=da)
    fp8.mm8(dw1, w1.xt.view(C, N), w1.xslot[:1], dh8t.t(), w1.gslot[:1], accumulate=True, wgrad=q.wgrad)
    fp8.mm8(dx, dh8, w1.gslot[:1], w1.w8.t(), w1.scale[:1])
