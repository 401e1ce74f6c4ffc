"""Linear without bias, weights stored [in, out]: out(N,OC) = x(N,C) @ w(C,OC).

Backward: dx = dout @ w.T (written: its one writer) ; dw += x.T @ dout (accumulated over micro-batches). Nothing
is saved beyond x (the caller keeps it). The attention's input projection is one linear of G = 3 weights
(G,C,OC): its forward and its weight gradients are one batched GEMM each (`bmm`), its input gradient three GEMMs
adding into dx (the weights' layout, fixed by the checkpoint, makes no single matrix of them for cuBLAS; one Triton
GEMM looping K over the three lost to the three: bench/RESULTS.md); an Fp8Weight (precision "fp8") runs the GEMMs
on E4M3 operands (fp8.py).

Every GEMM of the engine (here, the MLP and the LM head) goes through `mm` (or `bmm`), which runs our Triton
tile kernel, cuBLAS through torch.mm/addmm(out=...), or cuBLASLt under one of the algorithms its heuristic offers
(cublaslt.py), whichever measured fastest for that shape, dtypes and layout; the choice is made once, in the
warm-up, and recorded on disk (tuning.py). torch's cuBLAS call takes its heuristic's first algorithm, which at
ANDREA-120M's shapes is often not the fastest: the step's GEMMs took 8.41 ms at micro-batch 8 under torch's calls and
7.84 under the fastest algorithm of each (an H200, `python3 dev/gemm_algos.py 8 32`; 33.59 against 31.00 at 32).
Under TRITON_INTERPRET=1 (CI) `mm` always runs the Triton kernels. Operands may be any strided view (w.T, x.T):
every way takes transposes for free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.fp8 import Fp8Weight
from microgpt.kernels import cublaslt, fp8, tuning
from microgpt.kernels.gemm import gemm_tile


@triton.jit
def k_linear_fwd(c_ptr, a_ptr, b_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                 ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    # c (M,N) (+)= a (M,K) @ b (K,N); any strides
    gemm_tile(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn, tl.program_id(0),
               ACC, BM, BN, BK, GROUP_M, IEEE)  # fmt: skip


@triton.jit
def k_linear_bwd(dx_ptr, dw_ptr, dout_ptr, x_ptr, w_ptr, NR, C, OC, n_dx_tiles, DX_ACC: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    # dx (NR,C) (+)= dout (NR,OC) @ w.T ; dw (C,OC) += x.T @ dout ; x (NR,C), w (C,OC), all row-major.
    # One launch: the first n_dx_tiles programs own dx tiles, the rest own dw tiles (no atomics).
    pid = tl.program_id(0)
    if pid < n_dx_tiles:
        gemm_tile(dout_ptr, w_ptr, dx_ptr, NR, C, OC, OC, 1, 1, OC, C, 1, pid,
                  DX_ACC, BM, BN, BK, GROUP_M, IEEE)  # fmt: skip
    else:
        gemm_tile(x_ptr, dout_ptr, dw_ptr, C, OC, NR, 1, C, OC, 1, OC, 1, pid - n_dx_tiles,
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
    """torch's cuBLAS call: out (+)= a @ b, 2D (mm, addmm) or batched 3D (bmm, baddbmm)."""
    aten, batched = torch.ops.aten, out.dim() == 3
    if out.dtype == a.dtype:
        if accumulate:
            (out.baddbmm_ if batched else out.addmm_)(a, b)
        else:
            (torch.bmm if batched else torch.mm)(a, b, out=out)
    elif accumulate:  # bf16/fp16 operands into fp32 grads: cuBLAS's fp32-output path (torch >= 2.8)
        (aten.baddbmm if batched else aten.addmm).dtype_out(out, a, b, out.dtype, out=out)
    else:
        (aten.bmm if batched else aten.mm).dtype_out(a, b, out.dtype, out=out)


_chosen: dict[str, tuple[str, bool]] = {}  # key -> (way, settled: timed or recorded, not a default outside the warm-up)
PROBE_ROWS = 16  # rows of a GEMM's output compared between the candidates


def _run(way: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """One GEMM (2D, or batched 3D) by the named way: "triton" (2D), "cublas" (torch's call), or "lt<i>" (cuBLASLt
    under the i-th algorithm its heuristic offers for this shape)."""
    if way == "triton":
        _triton_mm(out, a, b, accumulate)
    elif way == "cublas":
        cublas_mm(out, a, b, accumulate)
    else:
        cublaslt.gemm(out, a, b, accumulate, int(way[2:]))


def _ways(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """The ways this GEMM can run here, the reference first: our Triton kernel (2D) or torch's batched GEMM (3D)."""
    if out.dim() == 3:
        ways = ["cublas"]
    else:
        ways = ["triton", "cublas"] if a.dtype == b.dtype else ["triton"]
    if a.dtype == b.dtype and cublaslt.available():
        try:
            ways += [f"lt{i}" for i in range(cublaslt.n_algos(out, a, b))]
        except (RuntimeError, ValueError):
            pass  # no cuBLASLt algorithm for these dtypes or strides
    return ways


def _pick(key: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> str:
    """Choose the way for this GEMM. Inside the tuning window (the warm-up step, whose values are thrown away) every
    way runs into `out` itself, and a way other than the reference is a candidate only if the first rows of its
    output agree with the reference's (compared in the planned probe buffer): nothing beyond the plan is allocated."""
    ways = _ways(out, a, b)
    if tuning.is_open() and len(ways) > 1:
        flat = out.view(-1, out.shape[-1])
        rows, cols = min(PROBE_ROWS, flat.shape[0]), flat.shape[1]
        ref, got = tuning.probe()[: 2 * rows * cols].view(2, rows, cols)
        _run(ways[0], out, a, b, False)
        ref.copy_(flat[:rows])
        agree = ways[:1]
        for way in ways[1:]:
            try:
                _run(way, out, a, b, False)
            except (RuntimeError, TypeError, ValueError):
                continue  # this torch, library, dtype or layout combination has no such path
            got.copy_(flat[:rows])
            if got.sub_(ref).norm() <= (1e-4 if a.dtype == torch.float32 else 2e-2) * ref.norm():
                agree.append(way)
        ways = agree
    return tuning.choose("gemm", key, {way: lambda way=way: _run(way, out, a, b, accumulate) for way in ways})


def _tuned(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    key = f"{tuple(a.shape)}x{b.shape[-1]}:{a.stride()}:{b.stride()}:{a.dtype}->{out.dtype}:{int(accumulate)}"
    key += ":a{}.{}.{}".format(*cublaslt.alignment(a, b, out))  # cuBLASLt's algorithms depend on them
    way, settled = _chosen.get(key, (None, False))
    if way is None or (not settled and tuning.is_open()):  # an untimed default is timed once the warm-up comes
        way = _pick(key, out, a, b, accumulate)
        _chosen[key] = (way, tuning.is_open() or tuning.choices("gemm").get(key) == way)
    _run(way, out, a, b, accumulate)


def mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """out (M,N) (+)= a (M,K) @ b (K,N). a, b any strides; out contiguous rows."""
    if tuning.INTERPRET or not out.is_cuda:
        _triton_mm(out, a, b, accumulate)
        return
    _tuned(out, a, b, accumulate)


def bmm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """out (G,M,N) (+)= a (G,M,K) @ b (G,K,N) as one strided-batched GEMM (torch's or cuBLASLt's, chosen as mm's),
    allocating nothing. a may repeat one matrix by a zero batch stride (x.expand(G, ...): the QKV projection's input,
    read once per weight). One launch of three times the tiles fills the GPU better than three: at micro-batch 8 the
    step's GEMMs went from 8.93 to 8.54 ms with the QKV forward and weight gradients batched (an H200,
    bench/RESULTS.md). The interpreter loops over mm."""
    if tuning.INTERPRET or not out.is_cuda:
        for g in range(out.shape[0]):
            mm(out[g], a[g], b[g], accumulate)
        return
    _tuned(out, a, b, accumulate)


def gemm_choices() -> dict[str, str]:
    """Shape key -> way (triton, cublas, lt<i>) for every GEMM this process ran (printed with the memory plan)."""
    return {key: way for key, (way, _) in _chosen.items()}


def linear_forward(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor | Fp8Weight,
                   q: fp8.Scratch | None = None) -> None:  # fmt: skip
    """out (N,OC) = x (N,C) @ w (C,OC); out (G,N,OC) = x @ w[g] for w (G,C,OC). An Fp8Weight: E4M3 (fp8.py)."""
    if isinstance(w, Fp8Weight):
        fp8.linear_forward(out, x, w, q)
        return
    if w.dim() == 2:
        mm(out.view(-1, w.shape[1]), x.view(-1, w.shape[0]), w)
        return
    G, C, OC = w.shape
    x2 = x.view(-1, C)
    bmm(out.view(G, -1, OC), x2.expand(G, *x2.shape), w)


def linear_backward(dx: torch.Tensor, dw: torch.Tensor, dout: torch.Tensor, x: torch.Tensor,
                    w: torch.Tensor | Fp8Weight, q: fp8.Scratch | None = None) -> None:  # fmt: skip
    """dx = dout @ w.T (written) ; dw += x.T @ dout. G weights: dx = sum_g dout[g] @ w[g].T ; dw[g] +=."""
    if isinstance(w, Fp8Weight):
        fp8.linear_backward(dx, dw, dout, x, w, q)
        return
    w3, dw3 = (w, dw) if w.dim() == 3 else (w.unsqueeze(0), dw.unsqueeze(0))
    G, C, OC = w3.shape
    dout3, x2, dx2 = dout.view(G, -1, OC), x.view(-1, C), dx.view(-1, C)
    if tuning.INTERPRET or not dx.is_cuda:  # one Triton launch per weight: its dx tiles and its dw tiles
        cfg = _config(x.dtype)
        NR = x2.shape[0]
        n_dx = triton.cdiv(NR, cfg["BM"]) * triton.cdiv(C, cfg["BN"])
        n_dw = triton.cdiv(C, cfg["BM"]) * triton.cdiv(OC, cfg["BN"])
        for g in range(G):
            k_linear_bwd[(n_dx + n_dw,)](dx2, dw3[g], dout3[g], x2, w3[g], NR, C, OC, n_dx, DX_ACC=g > 0,
                                         IEEE=x.dtype == torch.float32, **cfg)  # fmt: skip
        return
    for g in range(G):
        mm(dx2, dout3[g], w3[g].t(), accumulate=g > 0)
    if G == 1:
        mm(dw3[0], x2.t(), dout3[0], accumulate=True)
    else:
        bmm(dw3, x2.t().expand(G, C, x2.shape[0]), dout3, accumulate=True)
