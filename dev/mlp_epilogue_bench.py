"""The MLP's activation in our Triton GEMM tiles' epilogues against GEMM + pass, as the warm-up times them (one GPU).

    python3 dev/mlp_epilogue_bench.py [MB ...]      # ANDREA-120M's MLP shapes (C 768, 4C 3072, T 1024); default 32 8

Per micro-batch, activation (gelu, relu2) and compute dtype (bf16, fp16): the GEMM router's two MLP choices, timed by
the tuner exactly as in the warm-up (tuning.Tuner.window, a cache of their own in a temporary folder, so every
candidate is timed), with MICROGPT_TUNING_LOG on, so stderr has each candidate's ms per call and the choice:
- mlp_act  (W_1's forward, h = x @ W_1 and a = act(h); ReLU^2's a alone, as the modern MLP stores it): pass (the
  GEMM by its own choice, then k_<act>_fwd), tile (k_gemm_act), on sm_90 each TMA tile by its name (k_gemm_act_tma
  under gemm_tma.TILES: tma_128x256, tma_128x128, tma_persistent), lt<i> (GELU in bf16/fp16: cuBLASLt's GELU_AUX
  epilogue under its i-th algorithm)
- mlp_dact (W_2's input gradient, dh = (dout @ W_2^T) * act'(h), ReLU^2's act' read from a): pass (the GEMM, then
  k_<act>_bwd), tile (k_gemm_dact), on sm_90 each TMA tile (k_gemm_dact_tma)
- gemm     (the passes' GEMMs, timed inside the first run of each pass way): triton (k_gemm, the pointer tile's main
  loop alone), on sm_90 each TMA tile (k_gemm_tma), cublas, lt<i>: how close our GEMMs are to cuBLAS's decides
  whether a fusion can win
Before timing, each fused tile's outputs are compared with cuBLAS's GEMM + the pass (max abs difference: the sums'
order only; dh from the same h, or ReLU^2's from the same a).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("MICROGPT_CACHE", tempfile.mkdtemp(prefix="mlp-epilogue-"))
os.environ.setdefault("MICROGPT_TUNING_LOG", "1")
from microgpt.kernels import cublaslt, gemm, gemm_tma  # noqa: E402
from microgpt.kernels.tuning import Tuner  # noqa: E402
from microgpt.ops.linear import FROM_OUTPUT  # noqa: E402


def fused_tiles() -> dict[str, tuple]:
    """Each fused tile this GPU runs in 16 bits, by its way's name: (act launcher, dact launcher)."""
    tiles = {"tile": (gemm.triton_mm_act, gemm.triton_mm_dact)}
    if torch.cuda.get_device_capability()[0] >= 9:
        for name in gemm_tma.TILES:
            tiles[name] = (
                lambda a, h, x, w, act, n=name: gemm_tma.tma_mm_act(a, h, x, w, act, n),
                lambda dx, dy, w, h, act, n=name: gemm_tma.tma_mm_dact(dx, dy, w, h, act, n),
            )
    return tiles


def main() -> None:
    mbs = [int(x) for x in sys.argv[1:]] or [32, 8]
    torch.manual_seed(0)
    tuner = Tuner()
    router = gemm.Gemm(tuner, cublaslt.CublasLt.load())
    tuner.set_probe(torch.empty(2 * gemm.PROBE_ROWS * 3072, device="cuda"))
    for mb in mbs:
        N, C, H = mb * 1024, 768, 3072
        for dtype in (torch.bfloat16, torch.float16):
            kw = dict(device="cuda", dtype=dtype)
            x, dout = torch.randn(N, C, **kw), torch.randn(N, C, **kw) * 0.01
            w1, w2 = torch.randn(C, H, **kw) * 0.04, torch.randn(H, C, **kw) * 0.04
            h, a, dh, h2, a2, dh2 = (torch.empty(N, H, **kw) for _ in range(6))
            for act in ("gelu", "relu2"):
                gemm.cublas_mm(h2, x, w1, False)
                gemm.ACTIVATIONS[act][0](a2, h2)
                gemm.cublas_mm(dh2, dout, w2.t(), False)
                read = a2 if act in FROM_OUTPUT else h2  # what act' reads: ReLU^2's from a
                gemm.ACTIVATIONS[act][1](dh2, read)
                for name, (mm_act, mm_dact) in fused_tiles().items():
                    mm_act(a, h, x, w1, act)
                    mm_dact(dh, dout, w2.t(), read, act)
                    diff = [(u.float() - v.float()).abs().max().item() for u, v in ((h, h2), (a, a2), (dh, dh2))]
                    print(f"mb {mb} {dtype} {act} {name}: vs cuBLAS + pass, max abs h {diff[0]:.2e} a {diff[1]:.2e} "
                          f"dh {diff[2]:.2e}", flush=True)  # fmt: skip
                with tuner.window():
                    router.mm_act(a, None if act in FROM_OUTPUT else h, x, w1, act)  # ReLU^2's stores a alone
                    router.mm_dact(dh, dout, w2.t(), a if act in FROM_OUTPUT else h, act)
                torch.cuda.synchronize()


if __name__ == "__main__":
    main()
