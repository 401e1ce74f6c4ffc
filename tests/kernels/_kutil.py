"""Shared helpers for the kernel tests: device, dtypes, tolerances, torch <-> NumPy."""

import os

import numpy as np
import torch

from tests.ops._util import check

ON_GPU = os.environ.get("MICROGPT_TEST_GPU") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"
# fp32 kernels against the float64 NumPy pair; fp16 inputs are rounded first, so the error is the kernel's
# fp16 intermediates (bf16 loads are broken in the interpreter: bf16 is checked on the GPU only).
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16]


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


__all__ = ["DEVICE", "DTYPES", "ON_GPU", "TOL", "check", "compare", "h", "rounded", "t"]
