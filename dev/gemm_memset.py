"""The cuBLAS GEMMs that a 4-byte memset precedes in the step's graph, and what changes that (one H200).

    python3 dev/gemm_memset.py [MB]        # ANDREA-120M's shapes at micro-batch MB (default 8)

At micro-batch 8 a replay holds 40 memsets of 4 bytes, each before one of three GEMMs (the QKV forward's batched
GEMM, x @ W_1 and dout @ W_2^T), and each costs the step ~5-7 us of idle GPU beside its 1 us. For each GEMM and
each way of asking cuBLAS for it, a CUDA graph of 20 (LayerNorm-sized elementwise pass, GEMM) pairs is replayed;
printed: us per pair by CUDA events, memsets per pair and the GEMM kernel the profiler saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dev.timing import REPS, captured  # noqa: E402


def ways(mb: int) -> dict[str, tuple]:
    N, C, H = mb * 1024, 768, 3072
    bf = dict(dtype=torch.bfloat16, device="cuda")
    x, w1, w2t = torch.randn(N, C, **bf), torch.randn(C, H, **bf) / 30, torch.randn(H, C, **bf) / 30
    wq = torch.randn(3, C, C, **bf) / 30
    h, qkv = torch.empty(N, H, **bf), torch.empty(3, N, C, **bf)
    hT = torch.empty(H, N, **bf)  # h stored transposed: cuBLAS sees the other layout
    return {
        "x@W1": lambda: torch.mm(x, w1, out=h),
        "x@W1 as (W1^T x^T)^T": lambda: torch.mm(w1.t(), x.t(), out=hT),
        "dout@W2^T": lambda: torch.mm(x, w2t.t(), out=h),
        "qkv bmm": lambda: torch.bmm(x.expand(3, N, C), wq, out=qkv),
        "qkv 3 mm": lambda: [torch.mm(x, wq[g], out=qkv[g]) for g in range(3)],
    }


def measure(name: str, gemm, pad: torch.Tensor) -> None:
    def pair() -> None:
        pad.mul_(1.0001)  # ~12 MB read and written, as the LayerNorm before these GEMMs
        gemm()

    g, us = captured(pair)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    memsets = sum("Memset" in n for n in names) / REPS
    kernels = sorted({n[:60] for n in names if "nvjet" in n or "gemm" in n.lower() or "splitK" in n})
    print(f"{name:26s} {us:7.1f} us a pair, {memsets:.0f} memsets a pair, {kernels}", flush=True)


def main() -> None:
    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    pad = torch.randn(mb * 1024 * 768, device="cuda", dtype=torch.bfloat16)
    for rpr in (True, False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = rpr
        print(f"allow_bf16_reduced_precision_reduction={rpr}")
        for name, gemm in ways(mb).items():
            measure(name, gemm, pad)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    print("the pass alone:")
    measure("pad only", lambda: None, pad)


if __name__ == "__main__":
    main()
