"""cuBLASLt's GEMMs (microgpt/kernels/cublaslt.py) where CI can check them: the row-major to column-major mapping of
operands, the refusals, and the MLP keeping its GEMM + pass where cuBLASLt cannot run. The GEMMs themselves run on
the GPU only (tests/kernels/test_gpu.py: test_gemm_every_way_gpu, test_mlp_act_epilogues_gpu)."""

import pytest
import torch

from microgpt.kernels import cublaslt
from microgpt.kernels.gemm import Gemm
from microgpt.kernels.tuning import Tuner


def test_operand_views_map_to_column_major():
    """A row-major x (r, c) is x^T column-major as it lies; its transposed view is column-major x, transposed by
    cuBLASLt; a view with no unit stride is refused, not copied."""
    x = torch.empty(6, 10)
    assert cublaslt._operand(x) == (cublaslt._OP_N, 10, 6, 10)
    assert cublaslt._operand(x.t()) == (cublaslt._OP_T, 10, 6, 10)  # (10, 6) column-major, ld 10
    wide = torch.empty(6, 16)[:, :10]  # rows padded: the leading dimension is the row stride
    assert cublaslt._operand(wide) == (cublaslt._OP_N, 10, 6, 16)
    with pytest.raises(ValueError, match="strides"):
        cublaslt._operand(torch.empty(6, 20)[:, ::2])
    # batched: the last two axes map as above; a batch stride of 0 (one matrix repeated) is the layout's business
    assert cublaslt._operand(x.expand(3, 6, 10)) == (cublaslt._OP_N, 10, 6, 10)
    assert cublaslt._operand(x.t().expand(3, 10, 6)) == (cublaslt._OP_T, 10, 6, 10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without cuBLASLt")
def test_mlp_keeps_the_pass_without_cublaslt():
    """No CUDA: there is no cuBLASLt to load, and the router's GELU offers the GEMM + pass and our tile's epilogue
    only, and runs the first."""
    assert cublaslt.CublasLt.load() is None
    gemm = Gemm(Tuner("test-device"), None)
    x, w1 = torch.randn(8, 4), torch.randn(4, 16)
    h, a = torch.empty(8, 16), torch.empty(8, 16)
    gemm.mm_act(a, h, x, w1, "gelu")
    assert [list(ways) for ways in gemm._act_ways.values()] == [["pass", "tile"]]
    torch.testing.assert_close(h, x @ w1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, torch.nn.functional.gelu(h, approximate="tanh"), rtol=1e-5, atol=1e-5)


def test_mismatched_shapes_and_strided_outputs_are_refused():
    """A GEMM whose shapes do not chain, or whose output or aux rows are not contiguous, stops with a message
    before cuBLASLt is asked for anything."""
    x, w = torch.empty(8, 4), torch.empty(4, 16)
    out, aux = torch.empty(8, 16), torch.empty(8, 16)
    with pytest.raises(ValueError, match=r"\(8, 16\) = \(8, 4\) @ \(5, 16\)"):
        cublaslt._chained(out, x, torch.empty(5, 16), aux)
    with pytest.raises(ValueError, match="aux"):
        cublaslt._chained(out, x, w, torch.empty(8, 12))
    with pytest.raises(ValueError, match="contiguous rows"):
        cublaslt._chained(torch.empty(16, 8).t(), x, w, aux)
    with pytest.raises(ValueError, match=r"\(3, 8, 16\) = \(2, 8, 4\) @ \(3, 4, 16\)"):  # batch counts differ
        cublaslt._chained(torch.empty(3, 8, 16), torch.empty(2, 8, 4), torch.empty(3, 4, 16), None)
    with pytest.raises(ValueError, match="shapes"):  # a batched output from 2D operands
        cublaslt._chained(torch.empty(3, 8, 16), x, w, None)


def _addmm_cases(device: str, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """(out, c, a, b) for Muon's three Newton-Schulz products: A = X X^T (c: out itself, filled with NaN, beta 0),
    B = b A + c A A (A symmetric), Y = a X + B X; random operands, batched and 2D. The first two are symmetric."""
    g = torch.Generator(device).manual_seed(7)
    x = (torch.randn(6, 48, 80, device=device, generator=g) / 8).to(dtype)
    gram = torch.full((6, 48, 48), float("nan"), device=device, dtype=dtype)
    sym = torch.randn(6, 48, 48, device=device, generator=g) / 8
    sym = (sym + sym.mT).to(dtype)
    return [
        (gram, gram, x, x.mT),
        (torch.empty_like(sym), sym, sym, sym),
        (torch.empty_like(x), x, sym, x),
        (torch.empty_like(x[0]), x[0], sym[0], x[0]),
    ]


COEFFS = [(0.0, 1.0), (-4.775, 2.0315), (3.4445, 1.0), (0.5, -1.5)]  # (beta, alpha) per case


def _addmm_want(out: torch.Tensor, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float):
    prod = alpha * (a.double() @ b.double())
    return prod if beta == 0.0 else prod + beta * c.double()  # beta 0: c is not read (it may hold NaN)


def test_addmm_without_cublaslt_is_torchs():
    """No cuBLASLt (CI): Gemm.addmm runs torch's addmm / baddbmm, beta 0 reading nothing of c."""
    gemm = Gemm(Tuner("test-device"), None)
    for (out, c, a, b), (beta, alpha) in zip(_addmm_cases("cpu", torch.float32), COEFFS):
        want = _addmm_want(out, c, a, b, beta, alpha)
        gemm.addmm(out, c, a, b, beta, alpha)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_addmm_gpu_repeats_bit_for_bit():
    """On the GPU, every way Gemm.addmm may choose (cuBLASLt under each algorithm its heuristic offers, with C
    apart from D, alpha and beta; the symmetric tile for the two symmetric products): within bf16's rounding of the
    fp64 product, beta 0 ignoring c's NaN, the same bits on every call (no way splits K), nothing allocated; the
    symmetric tile's output exactly symmetric. And the router's own call (no record: cuBLASLt's first algorithm) is
    not torch's fallback (no note)."""
    lt = cublaslt.CublasLt.load()
    assert lt is not None
    tuner = Tuner("test-device")
    gemm, seen = Gemm(tuner, lt), set()
    for i, ((out, c, a, b), (beta, alpha)) in enumerate(zip(_addmm_cases("cuda", torch.bfloat16), COEFFS)):
        want = _addmm_want(out, c, a, b, beta, alpha)
        ways = gemm._lt_ways(out, a, b, "torch's", c=c) + (["sym"] if i < 2 else [])
        assert len(ways) > 1 + (i < 2), (i, ways)
        outs = {}
        for way in ways:
            gemm._addmm_run(way, out, c, a, b, beta, alpha)
            first = out.clone()
            before = torch.cuda.memory_allocated()
            for _ in range(3):
                gemm._addmm_run(way, out, c, a, b, beta, alpha)
                assert torch.equal(out, first), (way, tuple(out.shape), beta, alpha)
            assert torch.cuda.memory_allocated() == before
            err = (first.double() - want).norm() / want.norm()
            assert err < 1e-2, (way, tuple(out.shape), beta, alpha, float(err))
            assert way != "sym" or torch.equal(first, first.mT), "the symmetric tile's output is not symmetric"
            outs[way] = first
        out.fill_(float("nan"))
        gemm.addmm(out, c, a, b, beta, alpha, symmetric=i < 2)  # the way recorded for this key, else lt0
        (key,) = set(gemm.choices()) - seen
        seen.add(key)
        assert torch.equal(out, outs[gemm.choices()[key]]), (key, gemm.choices()[key])
    assert not tuner._said, "a GEMM fell back to torch's"
