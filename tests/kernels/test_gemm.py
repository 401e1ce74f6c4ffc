"""The GEMM router's Triton tiles on their own: the pointer tile (k_gemm, way "triton") and the TMA tiles (k_gemm_tma
under each configuration of gemm_tma.TILES) against torch on shapes that are not multiples of any tile, in the
layouts a step's GEMMs take; where the TMA tiles apply (gemm_tma.tma_fits); and which ways the router offers."""

import numpy as np
import pytest
import torch

from microgpt.kernels import gemm as kgemm
from microgpt.kernels import gemm_tma, tuning
from microgpt.kernels.gemm import Gemm

from ._kutil import DEVICE, DTYPES, compare, rounded, t

M, K, N = 296, 40, 136  # none a multiple of a tile's BM, BK or BN (64, 128, 256); all of 8: aligned 16-bit rows
# name: (out's dtype (None: the operands'), a transposed (a (M,K) view of a (K,M) base), b transposed, accumulate)
LAYOUTS = {
    "x @ w": (None, False, False, False),
    "dy @ w^T": (None, False, True, False),
    "dy @ w^T added into": (None, False, True, True),
    "x^T @ dy": (None, True, False, False),
    "dw += x^T @ dy (fp32)": (torch.float32, True, False, True),
}


def run_way(way: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    if way == "triton":
        kgemm.triton_mm(out, a, b, accumulate)
    else:
        gemm_tma.tma_mm(out, a, b, accumulate, way)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("way", ["triton", *gemm_tma.TILES])
def test_gemm_tiles(way: str, dtype: torch.dtype, layout: str) -> None:
    """out (+)= a @ b by each tile against float64 from the rounded operands (fp32: the pointer tile's IEEE dot, to
    2e-5), run twice for the same bits; where it adds, what it added is compared. The TMA tiles run where they apply
    (16-bit operands and outputs) and are checked not to apply elsewhere."""
    out_dtype, a_t, b_t, accumulate = LAYOUTS[layout]
    out_dtype = out_dtype or dtype
    rng = np.random.default_rng(len(layout))
    xa = rounded(rng.standard_normal((K, M) if a_t else (M, K)), dtype)
    wb = rounded(rng.standard_normal((N, K) if b_t else (K, N)) * 0.2, dtype)
    xa, wb = (xa.T if a_t else xa), (wb.T if b_t else wb)  # a (M,K), b (K,N) as views
    a, b = (t(xa.T, dtype).T if a_t else t(xa, dtype)), (t(wb.T, dtype).T if b_t else t(wb, dtype))
    out = t(rng.standard_normal((M, N)), out_dtype)
    if way != "triton" and not gemm_tma.tma_fits(a, b, out):
        assert torch.float32 in (dtype, out_dtype), f"{layout} by {way}: the TMA tiles should apply"
        return
    begin = out.clone()
    run_way(way, out, a, b, accumulate)
    first = out.clone()
    out.copy_(begin)
    run_way(way, out, a, b, accumulate)
    assert torch.equal(out, first), f"{layout} by {way}: a second run differs"
    got = out.double() - begin.double() if accumulate else out
    compare(f"{layout} by {way}", got, xa @ wb, out_dtype)


def test_where_the_tma_tiles_apply() -> None:
    """TMA reads 2D operands whose base and row stride are 16-byte aligned, rows or (a transposed view) columns
    contiguous; the tiles take 16-bit operands and outputs of one dtype, the outputs with contiguous rows."""
    f16 = dict(dtype=torch.float16, device=DEVICE)
    x, w, out = torch.zeros(M, K, **f16), torch.zeros(K, N, **f16), torch.zeros(M, N, **f16)
    assert gemm_tma.tma_major(x) is False and gemm_tma.tma_major(x.T) is True
    assert gemm_tma.tma_fits(x, w, out) and gemm_tma.tma_fits(x, torch.zeros(N, K, **f16).T, out)
    assert gemm_tma.tma_fits(torch.zeros(K, M, **f16).T, w, out)  # a transposed: x^T in a weight gradient
    assert gemm_tma.tma_fits(x.bfloat16(), w.bfloat16(), out.bfloat16())
    assert not gemm_tma.tma_fits(x.float(), w.float(), out.float())  # fp32: the pointer tile's IEEE dot
    assert not gemm_tma.tma_fits(x, w, out.float())  # an fp32 output (a weight gradient's)
    assert not gemm_tma.tma_fits(x, w.bfloat16(), out)  # operands of two dtypes
    assert not gemm_tma.tma_fits(torch.zeros(M, 5, **f16), torch.zeros(5, N, **f16), out)  # rows of 10 bytes
    shifted = torch.zeros(M * K + 4, **f16)[4:].view(M, K)  # 8 bytes past a 16-byte boundary
    assert gemm_tma.tma_major(shifted) is None and not gemm_tma.tma_fits(shifted, w, out)
    assert gemm_tma.tma_major(torch.zeros(K, **f16).expand(M, K)) is None  # every row the same memory
    assert gemm_tma.tma_major(torch.zeros(2, M, K, **f16)) is None  # 2D only
    assert not gemm_tma.tma_fits(x, w, torch.zeros(N, M, **f16).T)  # an output's columns contiguous


@pytest.mark.parametrize("tma", [True, False, None])
def test_the_router_offers_the_tma_tiles(tmp_path, monkeypatch, tma: bool | None) -> None:
    """mm's ways: the pointer tile (the reference), then the TMA tiles where the router offers them (tma, or where
    None, a GPU of compute capability 9.0 or newer: never off CUDA) and they apply, then torch's cuBLAS; a batched
    GEMM has none of ours. Each TMA way runs through the router's _run."""
    monkeypatch.setenv("MICROGPT_CACHE", str(tmp_path))
    router = Gemm(tuning.Tuner("test-device"), None, tma=tma)
    here = tma if tma is not None else DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    rng = np.random.default_rng(3)
    x, w = rounded(rng.standard_normal((M, K)), torch.float16), rounded(rng.standard_normal((K, N)), torch.float16)
    a, b = t(x, torch.float16), t(w, torch.float16)
    out = torch.empty(M, N, dtype=torch.float16, device=DEVICE)
    tiles = list(gemm_tma.TILES) if here else []
    assert router._ways(out, a, b) == ["triton", *tiles, "cublas"]
    assert router._ways(out.float(), a.float(), b.float()) == ["triton", "cublas"]
    batched = torch.empty(2, M, N, dtype=torch.float16, device=DEVICE)
    assert router._ways(batched, a.expand(2, M, K), b.expand(2, K, N)) == ["cublas"]
    for way in tiles:
        out.fill_(float("nan"))
        router._run(way, out, a, b, False)
        compare(f"x @ w by {way}", out, x @ w, torch.float16)
