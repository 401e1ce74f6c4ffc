"""The attention's input projection as three cuBLAS GEMMs (what `linear` runs today) against one batched GEMM (the
input broadcast over the three weights by a zero batch stride) and against one GEMM of the concatenated weights
(the bound: a layout the checkpoint's separate w_q, w_k, w_v do not give). Forward, weight gradient (fp32 out,
accumulated) and input gradient, at ANDREA-120M's width; the memory each variant allocates beside its operands.
Each call is timed alone between two events, so a variant of three launches carries the host's latency between
them, which a graph replay does not pay: the warm-up's timing (tuning.py, kernels queued behind a spin) is the
measure of what a step gets.

python3 dev/qkv_gemm_bench.py [N ...]       # rows (micro-batch x 1,024); default 8192 32768
"""

from __future__ import annotations

import statistics
import sys

import torch

C = 768
F32 = torch.float32


def timed(fn, reps: int = 50) -> tuple[float, int]:
    """(median ms, bytes allocated beyond what was live before the first call)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def main() -> None:
    rows = [int(a) for a in sys.argv[1:]] or [8192, 32768]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for N in rows:
        x, dout3 = torch.randn(N, C, **bf), torch.randn(3, N, C, **bf)
        w3 = torch.randn(3, C, C, **bf) * 0.03
        wcat = torch.cat(list(w3), dim=1).contiguous()  # (C, 3C)
        dcat = torch.cat(list(dout3), dim=1).contiguous()  # (N, 3C)
        out3, outcat = torch.empty(3, N, C, **bf), torch.empty(N, 3 * C, **bf)
        dw3, dwcat = torch.zeros(3, C, C, device="cuda", dtype=F32), torch.zeros(C, 3 * C, device="cuda", dtype=F32)
        dx = torch.empty(N, C, **bf)
        xt = x.t()

        def fwd_loop():
            for g in range(3):
                torch.mm(x, w3[g], out=out3[g])

        def dw_loop():
            for g in range(3):
                torch.ops.aten.addmm.dtype_out(dw3[g], xt, dout3[g], F32, out=dw3[g])

        def dw_batched():
            torch.ops.aten.baddbmm.dtype_out(dw3, xt.expand(3, C, N), dout3, F32, out=dw3)

        def dx_loop():
            torch.mm(dout3[0], w3[0].t(), out=dx)
            for g in (1, 2):
                dx.addmm_(dout3[g], w3[g].t())

        cases = {
            "fwd 3 GEMMs": fwd_loop,
            "fwd batched (x stride 0)": lambda: torch.bmm(x.expand(3, N, C), w3, out=out3),
            "fwd one GEMM (concatenated w)": lambda: torch.mm(x, wcat, out=outcat),
            "dw 3 GEMMs": dw_loop,
            "dw batched (x.T stride 0)": dw_batched,
            "dw one GEMM (concatenated)": lambda: torch.ops.aten.addmm.dtype_out(dwcat, xt, dcat, F32, out=dwcat),
            "dx 3 GEMMs": dx_loop,
            "dx one GEMM (concatenated)": lambda: torch.mm(dcat, wcat.t(), out=dx),
        }
        flop = 2 * N * C * 3 * C
        for name, fn in cases.items():
            try:
                ms, extra = timed(fn)
            except RuntimeError as e:
                print(f"N {N:6d}  {name:32s} failed: {str(e).splitlines()[0][:150]}")
                continue
            print(f"N {N:6d}  {name:32s} {ms * 1e3:8.1f} us  {flop / ms / 1e9:6.0f} TFLOP/s  allocates {extra:,} B")
        fwd_loop()
        ref = out3.clone()
        torch.bmm(x.expand(3, N, C), w3, out=out3)
        print(f"N {N:6d}  batched forward equals the loop bit for bit: {torch.equal(ref, out3)}")
        dw3.zero_()
        dw_loop()
        ref = dw3.clone()
        dw3.zero_()
        dw_batched()
        print(f"N {N:6d}  batched dw: max |diff| / max |dw| = {(dw3 - ref).abs().max() / ref.abs().max():.2e}")


if __name__ == "__main__":
    main()
