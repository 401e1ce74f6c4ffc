"""Linear without bias, weights stored [in, out]: out(N,OC) = x(N,C) @ w(C,OC).

Backward accumulates: dx += dout @ w.T ; dw += x.T @ dout. Nothing is saved beyond x (the caller keeps it).

Every GEMM of the engine (here, the MLP and the LM head) goes through `mm`, which runs either our Triton
tile kernel or cuBLAS through torch.mm/addmm(out=...), whichever measured faster for that shape, dtypes and
layout; the choice is made once and recorded on disk (tuning.py). Under TRITON_INTERPRET=1 (CI) `mm` always
runs the Triton kernels. Operands may be any strided view (w.T, x.T): both backends take transposes for free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels import tuning


@triton.jit
def _gemm_tile(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn, pid,
               ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GROUP_M: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """One (BM, BN) tile of c (+)= a @ b, tiles ordered in groups of GROUP_M rows for L2 reuse."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_n = (pid % group) // gsize
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * sam + offs_k[None, :].to(tl.int64) * sak
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * sbk + offs_n[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] + k < K), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] + k < K) & (offs_n[None, :] < N), other=0.0)
        b = b.to(a.dtype)  # mixed operands (fp32 logits with bf16 weights) meet at a's type
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")  # fp32 mode: no tf32 rounding
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK * sak
        b_ptrs += BK * sbk
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * scm + offs_n[None, :].to(tl.int64) * scn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ACC:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def k_linear_fwd(c_ptr, a_ptr, b_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                 ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    # c (M,N) (+)= a (M,K) @ b (K,N); any strides
    _gemm_tile(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn, tl.program_id(0),
               ACC, BM, BN, BK, GROUP_M, IEEE)  # fmt: skip


@triton.jit
def k_linear_bwd(dx_ptr, dw_ptr, dout_ptr, x_ptr, w_ptr, NR, C, OC, n_dx_tiles,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    # dx (NR,C) += dout (NR,OC) @ w.T ; dw (C,OC) += x.T @ dout ; x (NR,C), w (C,OC), all row-major.
    # One launch: the first n_dx_tiles programs own dx tiles, the rest own dw tiles (no atomics).
    pid = tl.program_id(0)
    if pid < n_dx_tiles:
        _gemm_tile(dout_ptr, w_ptr, dx_ptr, NR, C, OC, OC, 1, 1, OC, C, 1, pid,
                   True, BM, BN, BK, GROUP_M, IEEE)  # fmt: skip
    else:
        _gemm_tile(x_ptr, dout_ptr, dw_ptr, C, OC, NR, 1, C, OC, 1, OC, 1, pid - n_dx_tiles,
                   True, BM, BN, BK, GROUP_M, IEEE)  # fmt: skip


def _config(dtype: torch.dtype) -> dict:
    if tuning.INTERPRET:
        return dict(BM=64, BN=64, BK=32, GROUP_M=4)  # few programs: the interpreter runs them one by one
    if dtype == torch.float32:
        return dict(BM=128, BN=64, BK=32, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4)


def _triton_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    (M, K), N = a.shape, b.shape[1]
    cfg = _config(a.dtype)
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    k_linear_fwd[grid](out, a, b, M, N, K, *a.stride(), *b.stride(), *out.stride(),
                       ACC=accumulate, IEEE=a.dtype == torch.float32, **cfg)  # fmt: skip


def cublas_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif accumulate:  # bf16/fp16 operands into fp32 grads: cuBLAS's fp32-output path (torch >= 2.8)
        torch.ops.aten.addmm.dtype_out(out, a, b, out.dtype, out=out)
    else:
        torch.ops.aten.mm.dtype_out(a, b, out.dtype, out=out)


_IMPLS = {"triton": _triton_mm, "cublas": cublas_mm}
_chosen: dict[str, str] = {}
PROBE_ROWS = 16  # rows of a GEMM's output compared between the candidates


def _pick(key: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> str:
    """Choose the implementation for this shape. Inside the tuning window (the warm-up step, whose values are
    thrown away) both candidates run into `out` itself, and cuBLAS is a candidate only if its first rows agree
    with the Triton kernel's (compared in the planned probe buffer): nothing beyond the plan is allocated."""
    live = {"triton": lambda: _triton_mm(out, a, b, accumulate)}
    if a.dtype == b.dtype and tuning.is_open():
        rows, cols = min(PROBE_ROWS, out.shape[0]), out.shape[1]
        ref, got = tuning.probe()[: 2 * rows * cols].view(2, rows, cols)
        _triton_mm(out, a, b, False)
        ref.copy_(out[:rows])
        try:
            cublas_mm(out, a, b, False)
            got.copy_(out[:rows])
            if got.sub_(ref).norm() <= (1e-4 if a.dtype == torch.float32 else 2e-2) * ref.norm():
                live["cublas"] = lambda: cublas_mm(out, a, b, accumulate)
        except (RuntimeError, TypeError):
            pass  # this torch or dtype combination has no cuBLAS path
    elif a.dtype == b.dtype:
        live["cublas"] = lambda: cublas_mm(out, a, b, accumulate)
    return tuning.choose("gemm", key, live)


def mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """out (M,N) (+)= a (M,K) @ b (K,N). a, b any strides; out contiguous rows."""
    if tuning.INTERPRET or not out.is_cuda:
        _triton_mm(out, a, b, accumulate)
        return
    key = f"{tuple(a.shape)}x{b.shape[1]}:{a.stride()}:{b.stride()}:{a.dtype}->{out.dtype}:{int(accumulate)}"
    impl = _chosen.get(key)
    if impl is None:
        impl = _chosen[key] = _pick(key, out, a, b, accumulate)
    _IMPLS[impl](out, a, b, accumulate)


def gemm_choices() -> dict[str, str]:
    """Shape key -> backend for every GEMM this process ran (printed with the memory plan)."""
    return dict(_chosen)


def linear_forward(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out (N,OC) = x (N,C) @ w (C,OC)."""
    mm(out.view(-1, w.shape[1]), x.view(-1, w.shape[0]), w)


def linear_backward(dx: torch.Tensor, dw: torch.Tensor, dout: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """dx += dout @ w.T ; dw += x.T @ dout."""
    C, OC = w.shape
    dout2, x2 = dout.view(-1, OC), x.view(-1, C)
    if tuning.INTERPRET or not dx.is_cuda:
        cfg = _config(x.dtype)
        NR = x2.shape[0]
        n_dx = triton.cdiv(NR, cfg["BM"]) * triton.cdiv(C, cfg["BN"])
        n_dw = triton.cdiv(C, cfg["BM"]) * triton.cdiv(OC, cfg["BN"])
        k_linear_bwd[(n_dx + n_dw,)](dx, dw, dout2, x2, w, NR, C, OC, n_dx, IEEE=x.dtype == torch.float32, **cfg)
        return
    mm(dx.view(-1, C), dout2, w.t(), accumulate=True)
    mm(dw, x2.t(), dout2, accumulate=True)
