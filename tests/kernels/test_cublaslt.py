"""cuBLASLt's GEMMs (microgpt/kernels/cublaslt.py) where CI can check them: the row-major to column-major mapping of
operands, the refusals, and the MLP keeping its GEMM + pass where cuBLASLt cannot run. The GEMMs themselves run on
the GPU only (tests/kernels/test_gpu.py: test_gemm_every_way_gpu, test_mlp_gelu_epilogue_gpu)."""

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
    """No CUDA: there is no cuBLASLt to load, and the router's GELU epilogue offers the GEMM + pass only, and runs
    it."""
    assert cublaslt.CublasLt.load() is None
    gemm = Gemm(Tuner("test-device"), None)
    x, w1 = torch.randn(8, 4), torch.randn(4, 16)
    h, a = torch.empty(8, 16), torch.empty(8, 16)
    gemm.mm_gelu(a, h, x, w1)
    assert [list(ways) for ways in gemm._gelu_ways.values()] == [["pass"]]
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
