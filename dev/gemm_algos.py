"""Every GEMM of an ANDREA-120M bf16 step: torch's cuBLAS call against cuBLASLt under each algorithm its heuristic
offers (one H200).

    python3 dev/gemm_algos.py [MB ...]        # default micro-batches 8 32
    GEMM_ALGOS=16 python3 dev/gemm_algos.py 8     # the heuristic's first 16 algorithms instead of its first 8

Per micro-batch and GEMM (the step's own shapes, strides and dtypes, as the GEMM sites of kernels/linear.Matmul call
them for the linears, the MLP and the head): us per call of torch's GEMM (gemm.cublas_mm, what the engine ran
before the cuBLASLt ways) and of cuBLASLt's GEMM (cublaslt.CublasLt.gemm) under each algorithm (no workspace, no
split-K reduction), from a CUDA graph of 20 calls; the fastest, its relative difference from torch's output, and
per step (times the GEMM's count a step) the time torch's calls take and what the fastest algorithms would take
instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dev.timing import captured  # noqa: E402
from microgpt.engine import memory  # noqa: E402
from microgpt.kernels import cublaslt  # noqa: E402
from microgpt.kernels.gemm import cublas_mm  # noqa: E402


def gemms(mb: int) -> list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """(name, calls a step, out, a, b, accumulate) for the step's GEMMs at micro-batch mb, ANDREA-120M."""
    from bench.bench import SHAPE

    L, C, V = SHAPE.n_layer, SHAPE.d_model, SHAPE.vocab_size
    H, N = 4 * C, mb * SHAPE.seq_len
    R = memory.gpu_logits_rows(SHAPE, mb, 2)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    f32 = dict(device="cuda", dtype=torch.float32)

    def rn(*shape, scale=1.0, **kw):
        return torch.randn(*shape, **(kw or bf)) * scale

    x, y, a, dh = rn(N, C), rn(N, C), rn(N, H), rn(N, H)
    wqkv, wo, wte = rn(3, C, C, scale=0.02), rn(C, C, scale=0.02), rn(V, C, scale=0.02)
    w1, w2 = rn(C, H, scale=0.02), rn(H, C, scale=0.02)
    qkv, dqkv = rn(3, N, C), rn(3, N, C)
    lg, dlg = rn(R, V), rn(R, V, scale=1e-4)
    g_qkv, g_cc, g_vc = rn(3, C, C, **f32), rn(C, C, **f32), rn(V, C, **f32)
    g_ch, g_hc = rn(C, H, **f32), rn(H, C, **f32)
    ch = N // R
    return [
        ("qkv fwd bmm", L, qkv, x.expand(3, N, C), wqkv, False),
        ("proj fwd", L, y, x, wo, False),
        ("mlp2 fwd", L, y, a, w2, False),
        ("logits fwd", ch, lg, x[:R], wte.t(), False),
        ("head dx +=", ch, y[:R], dlg, wte, True),
        ("head dwte +=", ch, g_vc, dlg.t(), x[:R], True),
        ("mlp dh", L, dh, y, w2.t(), False),
        ("mlp dw2 +=", L, g_hc, a.t(), y, True),
        ("mlp dw1 +=", L, g_ch, x.t(), dh, True),
        ("mlp dx", L, y, dh, w1.t(), False),
        ("proj dx", L, y, x, wo.t(), False),
        ("proj dw +=", L, g_cc, x.t(), y, True),
        ("qkv dx g0", L, y, dqkv[0], wqkv[0].t(), False),
        ("qkv dx g>0 +=", 2 * L, y, dqkv[1], wqkv[1].t(), True),
        ("qkv dw bmm +=", L, g_qkv, x.t().expand(3, C, N), dqkv, True),
    ]


def main() -> None:
    mbs = [int(x) for x in sys.argv[1:]] or [8, 32]
    torch.manual_seed(0)
    cublaslt.MAX_ALGOS = int(os.environ.get("GEMM_ALGOS", cublaslt.MAX_ALGOS))  # read by each plan CublasLt makes
    lt = cublaslt.CublasLt.load()
    if lt is None:
        sys.exit("error: no CUDA GPU with cuBLASLt in this process (dev/gemm_algos.py times cuBLASLt's algorithms)")
    for mb in mbs:
        total_torch = total_best = 0.0
        print(f"--- micro-batch {mb}")
        for name, count, out, a, b, acc in gemms(mb):
            keep = out.clone()
            cublas_mm(out, a, b, False)
            ref = out.float().clone()
            us = {"torch": captured(lambda: cublas_mm(out, a, b, acc))[1]}
            n = lt.n_algos(out, a, b)
            err = {}
            for i in range(n):
                try:
                    lt.gemm(out, a, b, False, i)
                    err[f"lt{i}"] = ((out.float() - ref).norm() / ref.norm()).item()
                    us[f"lt{i}"] = captured(lambda i=i: lt.gemm(out, a, b, acc, i))[1]
                except RuntimeError as e:
                    print(f"  {name}: lt{i} failed: {e}")
            out.copy_(keep)
            best = min((k for k in us if k != "torch"), key=us.__getitem__, default="torch")
            flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (out.shape[0] if out.dim() == 3 else 1)
            total_torch += count * us["torch"]
            total_best += count * min(us["torch"], us[best])
            print(
                f"{name:15s} x{count:2d} {tuple(out.shape)!s:17s} torch {us['torch']:7.1f} us "
                f"({flops / us['torch'] / 1e6:5.0f} TFLOP/s)  best {best} {us[best]:7.1f} "
                f"({us['torch'] / us[best] - 1:+.1%}, rel diff {err.get(best, 0):.1e})  all: "
                + " ".join(f"{k}={v:.1f}" for k, v in us.items() if k != "torch"),
                flush=True,
            )
        print(
            f"micro-batch {mb}: torch's GEMMs {total_torch / 1e3:.3f} ms a step, with the fastest of each "
            f"{total_best / 1e3:.3f} ms ({total_best / total_torch - 1:+.2%})",
            flush=True,
        )


if __name__ == "__main__":
    main()
