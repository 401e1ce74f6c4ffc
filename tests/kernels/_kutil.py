"""Shared helpers for the kernel tests: device, dtypes, tolerances, torch <-> NumPy."""

import os

import numpy as np
import torch

from microgpt.kernels import linear
from microgpt.kernels.cublaslt import CublasLt
from microgpt.kernels.gemm import Gemm
from microgpt.kernels.tuning import Tuner
from microgpt.ops import linear as ref_linear
from tests.ops._util import check

ON_GPU = os.environ.get("MICROGPT_TEST_GPU") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"
# fp32 kernels against the float64 NumPy pair; fp16 inputs are rounded first, so the error is the kernel's
# fp16 intermediates (bf16 loads are broken in the interpreter: bf16 is checked on the GPU only).
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16]
# the kernel state a runtime owns, for launchers called directly: the device's tuner (its cache file under
# $MICROGPT_CACHE), its GEMM router and fp32/bf16/fp16's GEMM sites over it
TUNER = Tuner()
GEMM = Gemm(TUNER, CublasLt.load() if ON_GPU else None)
MM = linear.Matmul(GEMM)
REF_MM = ref_linear.Matmul()  # the NumPy reference's
SMS = torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else 4  # the runtime's INTERPRET_SMS


def t(x: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A device tensor copy of x (integer arrays keep their type)."""
    out = torch.from_numpy(np.ascontiguousarray(x))
    return out.to(device=DEVICE, dtype=dtype if x.dtype.kind == "f" and dtype is not None else out.dtype)


def rounded(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """x as float64 after a round trip through dtype: the inputs the kernel actually sees."""
    return torch.from_numpy(x).to(dtype).to(torch.float64).numpy()


def h(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()


def compare(name: str, got: torch.Tensor, expected: np.ndarray, dtype: torch.dtype) -> None:
    check(name, h(got), expected, TOL[dtype])


__all__ = [
    "DEVICE",
    "DTYPES",
    "GEMM",
    "MM",
    "ON_GPU",
    "REF_MM",
    "SMS",
    "TOL",
    "TUNER",
    "check",
    "compare",
    "h",
    "rounded",
    "t",
]
