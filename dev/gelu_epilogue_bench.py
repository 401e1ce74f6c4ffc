"""The MLP's GELU inside cuBLASLt's epilogues against the GEMM + elementwise pass the MLP runs today (one H200).

    python3 dev/gelu_epilogue_bench.py [MB ...]      # ANDREA-120M's MLP shapes; default micro-batches 8 32

Per micro-batch: which GELU cuBLASLt computes (its fp32 outputs against tanh-GELU and erf-GELU in float64), how far
its bf16 outputs are from the pass's, and the time of each way, us per call from a CUDA graph of 20 calls:
- forward:  mm(h = x @ W_1) + k_gelu_fwd (a = gelu(h))      vs  gelu_aux (h and a from one GEMM)
- backward: k_gelu_fwd (a) + mm(dh = dout @ W_2^T) + k_gelu_bwd (dh *= gelu'(h))  vs  dgelu (dh from one GEMM) +
  k_gelu_fwd (a)
Both backward ways write dh and a, as the MLP's backward does under train.recompute_gelu (kernels/mlp.py: a =
gelu(h) first, by k_gelu_fwd, for dW_2's GEMM; the default keeps the forward's a and runs the GEMM and k_gelu_bwd
alone, a pairing this script does not time). mm is torch's cuBLAS call (gemm.cublas_mm), the epilogues cuBLASLt's
(cublaslt.CublasLt); k_gelu_fwd and k_gelu_bwd run through their launchers (gelu.gelu_forward, gelu.gelu_backward).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dev.timing import captured  # noqa: E402
from microgpt.kernels import cublaslt  # noqa: E402
from microgpt.kernels.gelu import gelu_backward, gelu_forward  # noqa: E402
from microgpt.kernels.gemm import cublas_mm  # noqa: E402


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))


def gelu_tanh_grad(h: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3))
    return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * h * h)


def gelu_erf(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))


def graph_us(fn) -> float:
    return captured(fn)[1]


def main() -> None:
    mbs = [int(x) for x in sys.argv[1:]] or [8, 32]
    torch.manual_seed(0)
    lt = cublaslt.CublasLt.load()
    if lt is None:
        sys.exit("error: no CUDA GPU with cuBLASLt in this process (dev/gelu_epilogue_bench.py times its epilogues)")
    for mb in mbs:
        N, C, H = mb * 1024, 768, 3072
        bf = dict(device="cuda", dtype=torch.bfloat16)
        x, dout = torch.randn(N, C, **bf), torch.randn(N, C, **bf) * 0.01
        w1, w2 = torch.randn(C, H, **bf) * 0.04, torch.randn(H, C, **bf) * 0.04
        f32 = dict(device="cuda", dtype=torch.float32)
        # which GELU: fp32 outputs, against float64 math on cuBLASLt's own pre-activation
        a32, h32, dh32 = torch.empty(N, H, **f32), torch.empty(N, H, **f32), torch.empty(N, H, **f32)
        lt.gelu_aux(a32, h32, x, w1)
        hd = h32.double()
        print(
            f"mb {mb}: |h| max {hd.abs().max():.2f}; fp32 a against tanh-GELU: max abs "
            f"{(a32.double() - gelu_tanh(hd)).abs().max():.2e}, against erf-GELU: "
            f"{(a32.double() - gelu_erf(hd)).abs().max():.2e}"
        )
        lt.dgelu(dh32, dout, w2.t(), h32)
        want = (dout.double() @ w2.t().double()) * gelu_tanh_grad(hd)
        print(
            f"  fp32 dh against (dout @ W2^T) * tanh-GELU'(h): max abs {(dh32.double() - want).abs().max():.2e} "
            f"(|dh| max {want.abs().max():.2e})"
        )
        # bf16: the epilogue's outputs against the pass's
        h, a, dh = torch.empty(N, H, **bf), torch.empty(N, H, **bf), torch.empty(N, H, **bf)
        h2, a2, dh2 = torch.empty_like(h), torch.empty_like(a), torch.empty_like(dh)

        def fwd_pass() -> None:
            cublas_mm(h, x, w1, False)
            gelu_forward(a, h)

        def fwd_lt() -> None:
            lt.gelu_aux(a2, h2, x, w1)

        def bwd_pass() -> None:
            gelu_forward(a, h)
            cublas_mm(dh, dout, w2.t(), False)
            gelu_backward(dh, h)

        def bwd_lt() -> None:
            lt.dgelu(dh2, dout, w2.t(), h)
            gelu_forward(a2, h)

        fwd_pass()
        fwd_lt()
        torch.cuda.synchronize()
        for name, p, q in (("h", h, h2), ("a", a, a2)):
            d = (p.float() - q.float()).abs()
            print(f"  bf16 {name}: {(p != q).float().mean() * 100:.3f}% of elements differ, max abs {d.max():.2e}")
        bwd_pass()
        bwd_lt()
        torch.cuda.synchronize()
        d = (dh.float() - dh2.float()).abs()
        print(
            f"  bf16 dh: {(dh != dh2).float().mean() * 100:.3f}% differ, max abs {d.max():.2e} "
            f"(|dh| max {dh.float().abs().max():.2e})"
        )
        for name, fn in (
            ("fwd pass", fwd_pass),
            ("fwd gelu_aux", fwd_lt),
            ("bwd pass", bwd_pass),
            ("bwd dgelu + a", bwd_lt),
        ):
            print(f"  {name:14s} {graph_us(fn):7.1f} us", flush=True)
        print("  each of the heuristic's algorithms, the GEMM alone (us):")
        w2t = w2.t()
        for name, ep, call in (
            ("gelu_aux", cublaslt.GELU_AUX, lambda i: lt.gelu_aux(a2, h2, x, w1, i)),
            ("dgelu", cublaslt.DGELU, lambda i: lt.dgelu(dh2, dout, w2t, h, i)),
        ):
            out, ina, inb, aux = (a2, x, w1, h2) if ep == cublaslt.GELU_AUX else (dh2, dout, w2.t(), h)
            n_alg = lt.n_algos(out, ina, inb, aux, ep)
            print(f"    {name}: " + " ".join(f"{graph_us(lambda i=i: call(i)):.1f}" for i in range(n_alg)), flush=True)
        print(
            f"    plain mm dout @ W2^T: {graph_us(lambda: cublas_mm(dh, dout, w2.t(), False)):.1f}, "
            f"x @ W1: {graph_us(lambda: cublas_mm(h, x, w1, False)):.1f}"
        )


if __name__ == "__main__":
    main()
