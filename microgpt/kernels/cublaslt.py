"""cuBLASLt's GELU epilogues: the MLP's GELU (and its derivative) inside the GEMMs around it.

    gelu_aux(a, h, x, w)    h = x @ w and a = gelu(h) from one GEMM       (CUBLASLT_EPILOGUE_GELU_AUX)
    dgelu(dh, dout, w, h)   dh = (dout @ w) * gelu'(h) from one GEMM      (CUBLASLT_EPILOGUE_DGELU)

torch exposes no GEMM with an auxiliary output, so these call cuBLASLt itself, through ctypes, on the copy of the
library torch has loaded (found in the process's own mappings): no build step, no extra dependency. cuBLASLt's GELU
is the tanh approximation, ANDREA's (docs/ANDREA.md), to within 6e-6 absolute in fp32 (dev/gelu_epilogue_bench.py);
it is applied to the fp32 sum before rounding, where the elementwise pass rounds h first (tests/kernels/test_gpu.py
bounds the difference).
Each (shape, strides, dtype, epilogue) gets its descriptors and heuristic algorithms once, with no workspace (so
nothing to plan and no memset before the GEMM) and no split-K reduction (whose in-place form adds with atomics:
training must repeat bit for bit); a call sets the pointers and queues the GEMM on the current stream,
which CUDA graph capture records like any kernel. Operands are torch tensors in row-major terms, any of them a
transposed view; cuBLASLt is column-major, so out (M,N) = a (M,K) @ b (K,N) runs as out^T = b^T @ a^T.
`available()` says whether this process can use them (a CUDA build whose cuBLASLt is found); where not, the MLP
keeps the GEMM and the elementwise pass (mlp.py, which also times the two ways once per shape).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

# cublasLt.h / library_types.h / cublas_api.h constants (stable across CUDA 12 and 13)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE = 3, 4, 7
_DESC_AUX_POINTER, _DESC_AUX_LD, _DESC_AUX_DATA_TYPE = 11, 12, 22
_PREF_MAX_WORKSPACE_BYTES, _PREF_REDUCTION_SCHEME_MASK = 1, 3
_REDUCTION_SCHEME_NONE = 0  # no split-K reduction: the ones that add partial sums in place do it with atomics
GELU_AUX, DGELU = 32 | 128, 64 | 128  # CUBLASLT_EPILOGUE_GELU_AUX, CUBLASLT_EPILOGUE_DGELU
_DATA_TYPES = {torch.float32: _R_32F, torch.float16: _R_16F, torch.bfloat16: _R_16BF}


class _HeuristicResult(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # fmt: skip


_lib: ctypes.CDLL | None = None
_handle = ctypes.c_void_p()
_load_error: str | None = None


def _library_path() -> str | None:
    """The libcublasLt torch loaded (its own wheel's or the system's), from /proc/self/maps."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if "libcublasLt.so" in Path(path).name:
                return path
    except OSError:
        pass
    return None


def _load() -> ctypes.CDLL:
    global _lib, _load_error
    if _lib is not None:
        return _lib
    if _load_error is not None:
        raise RuntimeError(_load_error)
    torch.cuda.current_blas_handle()  # cuBLAS (and with it cuBLASLt) is loaded and initialised
    path = _library_path()
    try:
        lib = ctypes.CDLL(path or "libcublasLt.so")
    except OSError as e:
        _load_error = f"cuBLASLt not found ({e})"
        raise RuntimeError(_load_error) from e
    p, i64, u64, size = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t
    results = ctypes.POINTER(_HeuristicResult)
    for name, args in {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [p, ctypes.c_int, p, size],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), ctypes.c_int, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, ctypes.c_int, p, size],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, ctypes.c_int, results, ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, size, p],
    }.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    _check(lib.cublasLtCreate(ctypes.byref(_handle)), "cublasLtCreate")
    _lib = lib
    return lib


def available() -> bool:
    """Whether the GELU epilogues can run here (a CUDA GPU and cuBLASLt found in this process)."""
    if not torch.cuda.is_available():
        return False
    try:
        _load()
    except RuntimeError:
        return False
    return True


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


MAX_ALGOS = 8  # the heuristic's first candidates kept per GEMM: its first is not always the fastest


@dataclass
class _Plan:
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # A, B, D in cuBLASLt's (column-major) terms
    algos: list[_HeuristicResult]  # in the heuristic's order


_plans: dict[tuple, _Plan] = {}


def _operand(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(op, rows, cols, ld) of cuBLASLt's view of x^T: a row-major x (r, c) is x^T column-major as it lies (op N);
    a transposed view is x column-major, so cuBLASLt transposes it (op T)."""
    r, c = x.shape
    if x.stride(1) == 1:
        return _OP_N, c, r, x.stride(0)
    if x.stride(0) == 1:
        return _OP_T, r, c, x.stride(1)
    raise ValueError(f"cuBLASLt operand with strides {x.stride()}: one of them must be 1")


def _layout(dtype: torch.dtype, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    layout = ctypes.c_void_p()
    _check(_lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _DATA_TYPES[dtype], rows, cols, ld), "layout")
    return layout


def _set(desc: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData) -> None:
    _check(_lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)), "attribute")


def _plan(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, aux: torch.Tensor, epilogue: int) -> _Plan:
    key = (out.shape, out.stride(), a.shape, a.stride(), b.shape, b.stride(), aux.stride(), out.dtype, a.dtype,
           epilogue)  # fmt: skip
    plan = _plans.get(key)
    if plan is not None:
        return plan
    _load()
    (M, K), N = a.shape, b.shape[1]
    op_b, rb, cb, ldb = _operand(b)  # cuBLASLt's A: b^T (N, K)
    op_a, ra, ca, lda = _operand(a)  # cuBLASLt's B: a^T (K, M)
    desc = ctypes.c_void_p()
    _check(_lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "descriptor")
    _set(desc, _DESC_TRANSA, ctypes.c_int32(op_b))
    _set(desc, _DESC_TRANSB, ctypes.c_int32(op_a))
    _set(desc, _DESC_EPILOGUE, ctypes.c_uint32(epilogue))
    _set(desc, _DESC_AUX_LD, ctypes.c_int64(aux.stride(0)))
    _set(desc, _DESC_AUX_DATA_TYPE, ctypes.c_int32(_DATA_TYPES[aux.dtype]))
    _set(desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))  # the heuristic reads its alignment
    layouts = (_layout(b.dtype, rb, cb, ldb), _layout(a.dtype, ra, ca, lda), _layout(out.dtype, N, M, out.stride(0)))
    pref = ctypes.c_void_p()
    _check(_lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    zero = ctypes.c_uint64(0)  # no workspace: nothing outside the memory plan
    _check(_lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(zero), 8), "pref")
    none = ctypes.c_uint32(_REDUCTION_SCHEME_NONE)  # deterministic: a run repeats another bit for bit
    _check(_lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_REDUCTION_SCHEME_MASK, ctypes.byref(none), 4), "pref")
    results, found = (_HeuristicResult * MAX_ALGOS)(), ctypes.c_int(0)
    _check(_lib.cublasLtMatmulAlgoGetHeuristic(_handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref,
                                               MAX_ALGOS, results, ctypes.byref(found)), "heuristic")  # fmt: skip
    if found.value < 1:
        raise RuntimeError(f"cuBLASLt has no algorithm for epilogue {epilogue} at {M}x{N}x{K} {out.dtype}")
    plan = _plans[key] = _Plan(desc, layouts, list(results[: found.value]))
    return plan


_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


def n_algos(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, aux: torch.Tensor, epilogue: int) -> int:
    """How many algorithms the heuristic offers for this GEMM (at most MAX_ALGOS): `algo` takes 0 .. n - 1."""
    return len(_plan(out, a, b, aux, epilogue).algos)


def _matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, aux: torch.Tensor, epilogue: int,
            algo: int = 0) -> None:  # fmt: skip
    if a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]) or aux.shape != out.shape:
        raise ValueError(f"cuBLASLt GEMM shapes {tuple(out.shape)} = {tuple(a.shape)} @ {tuple(b.shape)}, "
                         f"aux {tuple(aux.shape)}")  # fmt: skip
    if out.stride(1) != 1 or aux.stride(1) != 1:
        raise ValueError("cuBLASLt GEMM: out and aux need contiguous rows")
    plan = _plan(out, a, b, aux, epilogue)
    _set(plan.desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))
    A, B, D = plan.layouts
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    ptr = ctypes.c_void_p
    _check(_lib.cublasLtMatmul(_handle, plan.desc, ctypes.byref(_ONE), ptr(b.data_ptr()), A, ptr(a.data_ptr()), B,
                               ctypes.byref(_ZERO), ptr(out.data_ptr()), D, ptr(out.data_ptr()), D,
                               ctypes.byref(plan.algos[algo].algo), None, 0, stream), "matmul")  # fmt: skip


def gelu_aux(a: torch.Tensor, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, algo: int = 0) -> None:
    """h = x @ w (the pre-GELU activation, cuBLASLt's aux output) and a = gelu(h), from one GEMM. 2D, rows
    contiguous for a and h; algo: the heuristic's candidate."""
    _matmul(a, x, w, h, GELU_AUX, algo)


def dgelu(dh: torch.Tensor, dout: torch.Tensor, w: torch.Tensor, h: torch.Tensor, algo: int = 0) -> None:
    """dh = (dout @ w) * gelu'(h), from one GEMM reading h (cuBLASLt's aux input). 2D; w may be a transposed view."""
    _matmul(dh, dout, w, h, DGELU, algo)
