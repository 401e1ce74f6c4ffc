"""The memory passes of an ANDREA-120M bf16 step against their byte floors (one H200): the cross-entropy row kernel
under each launch configuration, and GELU's backward pass with and without recomputing a = gelu(h).

    python3 dev/pass_bench.py [MB ...]        # default micro-batches 8 32
    python3 dev/pass_bench.py --ncu MB        # each kernel once, eagerly: for `ncu -k regex:k_` (DRAM bytes)

Cross-entropy, per configuration of crossentropy.ROW_CONFIGS, on one (R, 50,304) bf16 logits chunk (R as the plan
makes it for MB): us per call of the row kernel with the gradient, alone and after the logits GEMM that writes the
chunk in a step (`after gemm`: GEMM + kernel minus the GEMM alone), and TB/s counting one read and one write of the
chunk (the floor: a row read twice costs a second read unless it is still in L2).
GELU's backward passes at (MB x 1024, 3072), as the MLP's backward runs them (kernels/mlp.py, kernels/gelu.py): the
default keeps the forward's a, so k_gelu_bwd alone (reads h and dh, writes dh: three arrays); train.recompute_gelu
first writes a = gelu(h) for dW_2's GEMM by a k_gelu_fwd pass (reads h, writes a), then the same k_gelu_bwd: five
arrays over two passes. us per call of the pair or the pass, and TB/s over the arrays they move. (Before 2c08f39 the
recompute plan ran one pass, k_mlp_bwd with RECOMPUTE, writing a and dh from one read of h: four arrays.)
Times are medians of CUDA-graph replays (dev/timing.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dev.timing import captured  # noqa: E402
from microgpt.engine import memory  # noqa: E402
from microgpt.kernels import crossentropy, gelu  # noqa: E402
from microgpt.kernels.gemm import cublas_mm  # noqa: E402


def crossentropy_rows(mb: int, ncu: bool) -> None:
    from bench.bench import SHAPE

    C, V = SHAPE.d_model, SHAPE.vocab_size
    R = memory.gpu_logits_rows(SHAPE, mb, 2)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, wte = torch.randn(R, C, **bf), torch.randn(V, C, **bf) * 0.05
    logits = torch.empty(R, V, **bf)
    targets = torch.randint(0, V, (R,), device="cuda", dtype=torch.int32)
    loss, lse, dloss = (torch.empty(R, device="cuda") for _ in range(3))
    dloss.fill_(1.0 / R)

    def gemm() -> None:
        cublas_mm(logits, x, wte.t(), False)

    gemm()
    chunk = 2 * R * V * 2  # one read and one write of the chunk, bytes
    if not ncu:
        _, t_gemm = captured(gemm)
        print(f"cross-entropy mb {mb}: chunk ({R}, {V}) bf16, logits GEMM {t_gemm:.1f} us")
    for name, config in crossentropy.ROW_CONFIGS.items():
        run = crossentropy.row_launch(loss, lse, logits, targets, dloss, V, *config)
        if ncu:
            gemm()
            run()
            continue
        _, alone = captured(run)

        def both(run=run) -> None:
            gemm()
            run()

        _, pair = captured(both)
        after = pair - t_gemm
        print(
            f"  {name:18s} alone {alone:7.1f} us ({chunk / alone / 1e6:.2f} TB/s)   after gemm {after:7.1f} us "
            f"({chunk / after / 1e6:.2f} TB/s)"
        )


def gelu_backward(mb: int, ncu: bool) -> None:
    n = mb * 1024 * 3072
    bf = dict(device="cuda", dtype=torch.bfloat16)
    h, dh, a = torch.randn(n, **bf), torch.randn(n, **bf), torch.empty(n, **bf)
    ways = {"a recomputed (written)": (True, 5), "a kept (not written)": (False, 3)}  # (recompute, arrays moved)
    for name, (recompute, arrays) in ways.items():

        def fn(recompute=recompute) -> None:
            if recompute:
                gelu.gelu_forward(a, h)
            gelu.gelu_backward(dh, h)

        if ncu:
            fn()
            continue
        _, t = captured(fn)
        tbs = arrays * n * 2 / t / 1e6
        print(f"gelu backward mb {mb} ({n // 3072}, 3072): {name:22s} {t:7.1f} us ({tbs:.2f} TB/s)")


def main() -> None:
    ncu = "--ncu" in sys.argv
    mbs = [int(a) for a in sys.argv[1:] if a != "--ncu"] or [8, 32]
    for mb in mbs:
        crossentropy_rows(mb, ncu)
        gelu_backward(mb, ncu)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
