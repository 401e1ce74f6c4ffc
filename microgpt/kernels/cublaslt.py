"""cuBLASLt GEMMs: plain ones under an algorithm the warm-up picks, and the MLP's GELU in their epilogues.

    gemm(out, a, b, acc, algo)   out (+)= a @ b, 2D or batched (3D, a batch stride may be 0)  (EPILOGUE_DEFAULT)
    addmm(out, c, a, b, beta, alpha, algo)   out = beta c + alpha a @ b, c laid out as out  (Muon's Newton-Schulz)
    gemm(out, a, b, acc, algo, sa, sb)   out (+)= (a @ b) * sa * sb on E4M3 a, b (fp8's GEMMs)  (A/B_SCALE_POINTER)
    gelu_aux(a, h, x, w)         h = x @ w and a = gelu(h) from one GEMM                      (EPILOGUE_GELU_AUX)
    dgelu(dh, dout, w, h)        dh = (dout @ w) * gelu'(h) from one GEMM                     (EPILOGUE_DGELU)

torch's GEMMs take whatever algorithm cuBLAS's heuristic puts first, and expose no GEMM with an auxiliary output,
so these call cuBLASLt itself, through ctypes, on the copy of the library torch has loaded (found in the process's
own mappings): no build step, no extra dependency. cuBLASLt's GELU is the tanh approximation, ANDREA's
(docs/ANDREA.md; dev/gelu_epilogue_bench.py measures how close, in bench/RESULTS.md); it is applied to the fp32 sum
before rounding, where the elementwise pass rounds h first (tests/kernels/test_gpu.py bounds the difference).
Each (shapes, strides, dtypes, alignments, epilogue) gets its descriptors and the heuristic's first MAX_ALGOS
algorithms once, with no workspace (so nothing to plan and no memset before the GEMM) and no split-K reduction
(whose in-place form adds with atomics: training must repeat bit for bit): the preference's reduction-scheme mask
allows none, and each algorithm offered is checked for a split all the same (`splits_k`: its configuration's
SPLITK_NUM and REDUCTION_SCHEME), so every candidate sums K in one fixed order. `n_algos` says how many there are,
and the callers time them in the warm-up (tuning.py). A call sets the pointers and queues the GEMM on the current
stream, which CUDA graph capture records like any kernel. Operands are torch tensors in row-major terms, any of them
a transposed view; cuBLASLt is column-major, so out (M,N) = a (M,K) @ b (K,N) runs as out^T = b^T @ a^T. bf16/fp16
operands may write (or add into) an fp32 out: the weight gradients' GEMMs.
E4M3 operands (precision fp8) take their two fp32 scales from device scalars (the slots' inverse scales), which the
library applies to the fp32 sum; Hopper's FP8 GEMM wants a row-major and b column-major (both with K contiguous),
and adds into out (an fp32 weight gradient) in its epilogue, as the bf16 ones do: no product buffer, no add pass.
The library's accumulation stays the precise one (CUBLASLT_MATMUL_DESC_FAST_ACCUM off, as torch._scaled_mm's).
`CublasLt.load()` gives the runtime its one handle where this process can use them (a CUDA build whose cuBLASLt is
found), None where not: the engine then keeps torch's GEMMs and the elementwise GELU pass (gemm.py times the ways
once per shape).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

# cublasLt.h / library_types.h / cublas_api.h constants (stable across CUDA 12 and 13)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF, _R_8F_E4M3 = 0, 2, 14, 28
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE = 3, 4, 7
_LAYOUT_BATCH_COUNT, _LAYOUT_BATCH_STRIDE = 5, 6
_DESC_AUX_POINTER, _DESC_AUX_LD, _DESC_AUX_DATA_TYPE = 11, 12, 22
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_PREF_MAX_WORKSPACE_BYTES, _PREF_REDUCTION_SCHEME_MASK, _PREF_MIN_ALIGNMENT_A = 1, 3, 5  # B, C, D: 6, 7, 8
_REDUCTION_SCHEME_NONE = 0  # no split-K reduction: the ones that add partial sums in place do it with atomics
_ALGO_SPLITK_NUM, _ALGO_REDUCTION_SCHEME = 2, 3  # cublasLtMatmulAlgoConfigAttributes_t: what an algorithm splits
DEFAULT, GELU_AUX, DGELU = 1, 32 | 128, 64 | 128  # CUBLASLT_EPILOGUE_DEFAULT, _GELU_AUX, _DGELU
_DATA_TYPES = {torch.float32: _R_32F, torch.float16: _R_16F, torch.bfloat16: _R_16BF, torch.float8_e4m3fn: _R_8F_E4M3}


class _HeuristicResult(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # fmt: skip


MAX_ALGOS = 8  # the heuristic's first candidates kept per GEMM: its first is not always the fastest
ONE, ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)  # alpha and beta (read by the library, never written)
# the library's functions this module calls: name -> argument types (all return a status, 0 for success)
_P, _I64, _U64, _SIZE = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t
SIGNATURES = {
    "cublasLtCreate": [ctypes.POINTER(_P)],
    "cublasLtMatmulDescCreate": [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_int],
    "cublasLtMatmulDescSetAttribute": [_P, ctypes.c_int, _P, _SIZE],
    "cublasLtMatrixLayoutCreate": [ctypes.POINTER(_P), ctypes.c_int, _U64, _U64, _I64],
    "cublasLtMatrixLayoutSetAttribute": [_P, ctypes.c_int, _P, _SIZE],
    "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(_P)],
    "cublasLtMatmulPreferenceSetAttribute": [_P, ctypes.c_int, _P, _SIZE],
    "cublasLtMatmulAlgoGetHeuristic": [_P, _P, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.POINTER(_HeuristicResult),
                                       ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmul": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _SIZE, _P],
    "cublasLtMatmulAlgoConfigGetAttribute": [_P, ctypes.c_int, _P, _SIZE, ctypes.POINTER(_SIZE)],
}  # fmt: skip


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


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@dataclass
class _Plan:
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # A, B, D in cuBLASLt's (column-major) terms
    algos: list[_HeuristicResult]  # in the heuristic's order


def _operand(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(op, rows, cols, ld) of cuBLASLt's view of x^T (the last two axes of x): a row-major x (r, c) is x^T
    column-major as it lies (op N); a transposed view is x column-major, so cuBLASLt transposes it (op T)."""
    r, c = x.shape[-2:]
    sr, sc = x.stride()[-2:]
    if sc == 1:
        return _OP_N, c, r, sr
    if sr == 1:
        return _OP_T, r, c, sc
    raise ValueError(f"cuBLASLt operand with strides {x.stride()}: one of the last two must be 1")


def alignment(*xs: torch.Tensor) -> tuple[int, ...]:
    """Each tensor's address alignment in bytes, up to 256: the heuristic offers only algorithms that run at the
    alignments it is told, so a plan (and a timed choice among its algorithms) holds for one such tuple."""
    return tuple(min(256, (x.data_ptr() & -x.data_ptr()) or 256) for x in xs)


def _chained(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, aux: torch.Tensor | None) -> None:
    """ValueError unless out = a @ b (2D, or batched 3D) with contiguous rows of out and aux, before any library
    call."""
    chained = out.dim() == a.dim() == b.dim() and out.dim() in (2, 3) and a.shape[-1] == b.shape[-2]
    chained = chained and out.shape[:-2] == a.shape[:-2] == b.shape[:-2]
    if not chained or out.shape[-2:] != (a.shape[-2], b.shape[-1]) or (aux is not None and aux.shape != out.shape):
        raise ValueError(
            f"cuBLASLt GEMM shapes {tuple(out.shape)} = {tuple(a.shape)} @ {tuple(b.shape)}"
            + (f", aux {tuple(aux.shape)}" if aux is not None else "")
        )
    if out.stride(-1) != 1 or (aux is not None and aux.stride(-1) != 1):
        raise ValueError("cuBLASLt GEMM: out and aux need contiguous rows")


class CublasLt:
    """The library torch has loaded, one handle on it, and the plans made so far (descriptors, layouts and the
    heuristic's algorithms per GEMM shape): the runtime's, made once per process and device."""

    def __init__(self) -> None:
        """RuntimeError where cuBLASLt cannot be found in this process (`load` says None instead)."""
        torch.cuda.current_blas_handle()  # cuBLAS (and with it cuBLASLt) is loaded and initialised
        path = _library_path()
        try:
            self.lib = ctypes.CDLL(path or "libcublasLt.so")
        except OSError as e:
            raise RuntimeError(f"cuBLASLt not found ({e})") from e
        for name, args in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.plans: dict[tuple, _Plan] = {}

    @classmethod
    def load(cls) -> CublasLt | None:
        """The library on this process's GPU, or None (no CUDA GPU, or no cuBLASLt found): the engine then keeps
        torch's GEMMs and the elementwise GELU pass."""
        if not torch.cuda.is_available():
            return None
        try:
            return cls()
        except RuntimeError:
            return None

    def _layout(self, x: torch.Tensor, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        """x's layout; for a 3D x a strided batch of x.shape[0] matrices, x.stride(0) apart (0: one matrix,
        repeated)."""
        layout = ctypes.c_void_p()
        _check(
            self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _DATA_TYPES[x.dtype], rows, cols, ld), "layout"
        )
        if x.dim() == 3:
            for attr, value in (
                (_LAYOUT_BATCH_COUNT, ctypes.c_int32(x.shape[0])),
                (_LAYOUT_BATCH_STRIDE, ctypes.c_int64(x.stride(0))),
            ):
                status = self.lib.cublasLtMatrixLayoutSetAttribute(
                    layout, attr, ctypes.byref(value), ctypes.sizeof(value)
                )
                _check(status, "layout attribute")
        return layout

    def _set(self, desc: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData) -> None:
        _check(
            self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)), "attribute"
        )

    def _preference(self, aligned: tuple[int, ...]) -> ctypes.c_void_p:
        """No workspace (nothing outside the memory plan), no split-K reduction (a run repeats another bit for
        bit), and the minimum alignments of A, B, C, D (`aligned`, in that order)."""
        pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        settings = [
            (_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(0)),
            (_PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(_REDUCTION_SCHEME_NONE)),
        ]
        settings += [(_PREF_MIN_ALIGNMENT_A + i, ctypes.c_uint32(n)) for i, n in enumerate(aligned)]
        for attr, value in settings:
            size = ctypes.sizeof(value)
            _check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), size), "preference")
        return pref

    def _plan(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        aux: torch.Tensor | None,
        epilogue: int,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        c: torch.Tensor | None = None,
    ) -> _Plan:
        aligned = alignment(b, a, out if c is None else c, out)  # cuBLASLt's A, B, C and D
        key = (
            out.shape,
            out.stride(),
            a.shape,
            a.stride(),
            b.shape,
            b.stride(),
            out.dtype,
            a.dtype,
            b.dtype,
            epilogue,
            aligned,
            aux is not None and (aux.stride(), alignment(aux)),
            scales is not None,
        )
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        M, N = out.shape[-2:]
        op_b, rb, cb, ldb = _operand(b)  # cuBLASLt's A: b^T (N, K)
        op_a, ra, ca, lda = _operand(a)  # cuBLASLt's B: a^T (K, M)
        desc = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "descriptor")
        for attr, value in (
            (_DESC_TRANSA, ctypes.c_int32(op_b)),
            (_DESC_TRANSB, ctypes.c_int32(op_a)),
            (_DESC_EPILOGUE, ctypes.c_uint32(epilogue)),
        ):
            self._set(desc, attr, value)
        if aux is not None:
            self._set(desc, _DESC_AUX_LD, ctypes.c_int64(aux.stride(0)))
            self._set(desc, _DESC_AUX_DATA_TYPE, ctypes.c_int32(_DATA_TYPES[aux.dtype]))
            self._set(desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))  # the heuristic reads its alignment
        if scales is not None:  # the heuristic is asked for a scaled GEMM; each call sets its own scales (_matmul)
            self._scales(desc, *scales)
        layouts = (self._layout(b, rb, cb, ldb), self._layout(a, ra, ca, lda), self._layout(out, N, M, out.stride(-2)))
        results, found = (_HeuristicResult * MAX_ALGOS)(), ctypes.c_int(0)
        _check(
            self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                layouts[0],
                layouts[1],
                layouts[2],
                layouts[2],
                self._preference(aligned),
                MAX_ALGOS,
                results,
                ctypes.byref(found),
            ),
            "heuristic",
        )
        algos = [r for r in results[: found.value] if not self.splits_k(r)]
        if not algos:
            raise RuntimeError(f"cuBLASLt has no algorithm for epilogue {epilogue} at {M}x{N} {a.dtype}->{out.dtype}")
        plan = self.plans[key] = _Plan(desc, layouts, algos)
        return plan

    def splits_k(self, result: _HeuristicResult) -> bool:
        """Whether an algorithm the heuristic offers splits K (more than one split, or a reduction scheme): the
        preference asks for none, and this checks each one it gives, so that no GEMM of a plan sums in an order
        that depends on timing."""
        values, written = [], _SIZE(0)
        for attr in (_ALGO_SPLITK_NUM, _ALGO_REDUCTION_SCHEME):  # uint32 each
            value = ctypes.c_uint32(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(result.algo), attr, ctypes.byref(value), ctypes.sizeof(value), ctypes.byref(written)
            )
            _check(status, "algorithm attribute")
            values.append(value.value)
        return values[0] > 1 or values[1] != _REDUCTION_SCHEME_NONE

    def _scales(self, desc: ctypes.c_void_p, sa: torch.Tensor, sb: torch.Tensor) -> None:
        """The scales of a and b: cuBLASLt's B and A (out^T = b^T @ a^T)."""
        self._set(desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(sb.data_ptr()))
        self._set(desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(sa.data_ptr()))

    def n_algos(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        aux: torch.Tensor | None = None,
        epilogue: int = DEFAULT,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        c: torch.Tensor | None = None,
    ) -> int:
        """How many algorithms the heuristic offers for this GEMM (at most MAX_ALGOS): `algo` takes 0 .. n - 1.
        scales: (sa, sb) for a scaled GEMM (E4M3 operands), as `gemm` takes them; c: addmm's c (its alignment is
        the heuristic's C)."""
        _chained(out, a, b, aux)
        return len(self._plan(out, a, b, aux, epilogue, scales, c).algos)

    def _matmul(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        aux: torch.Tensor | None,
        epilogue: int,
        algo: int = 0,
        accumulate: bool = False,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        c: torch.Tensor | None = None,
        alpha: float = 1.0,
        beta: float | None = None,
    ) -> None:
        """out = alpha (a @ b) + beta c under the plan's algorithm `algo`; c: out where None, beta: 1 where
        accumulating, else 0."""
        _chained(out, a, b, aux)
        plan = self._plan(out, a, b, aux, epilogue, scales, c)
        if aux is not None:
            self._set(plan.desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))
        if scales is not None:  # a plan serves every GEMM of its shapes: each brings its own scales
            self._scales(plan.desc, *scales)
        A, B, D = plan.layouts
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        ptr, d = ctypes.c_void_p, ctypes.c_void_p(out.data_ptr())
        scale = ONE if alpha == 1.0 else ctypes.c_float(alpha)
        add = (ONE if accumulate else ZERO) if beta is None else ctypes.c_float(beta)
        _check(
            self.lib.cublasLtMatmul(
                self.handle,
                plan.desc,
                ctypes.byref(scale),
                ptr(b.data_ptr()),
                A,
                ptr(a.data_ptr()),
                B,
                ctypes.byref(add),
                d if c is None else ptr(c.data_ptr()),
                D,
                d,
                D,
                ctypes.byref(plan.algos[algo].algo),
                None,
                0,
                stream,
            ),
            "matmul",
        )

    def gemm(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        accumulate: bool = False,
        algo: int = 0,
        sa: torch.Tensor | None = None,
        sb: torch.Tensor | None = None,
    ) -> None:
        """out (M,N) (+)= a (M,K) @ b (K,N); or batched, out (G,M,N) (+)= a (G,M,K) @ b (G,K,N), where a batch
        stride may be 0 (one matrix for every batch). Rows of out contiguous; out may be fp32 with bf16/fp16 a and
        b. algo: the heuristic's candidate (n_algos). sa, sb: E4M3 a and b's fp32 scales, (1,) device tensors:
        out (+)= (a @ b) * sa * sb."""
        self._matmul(out, a, b, None, DEFAULT, algo, accumulate, None if sa is None else (sa, sb))

    def addmm(
        self,
        out: torch.Tensor,
        c: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        beta: float,
        alpha: float,
        algo: int = 0,
    ) -> None:
        """out = beta c + alpha (a @ b), 2D or batched, under the heuristic's candidate `algo` (n_algos with c).
        c has out's shape, strides and dtype (cuBLASLt's C and D share a layout) and may be out itself; alpha and
        beta are read when the GEMM is queued (a graph keeps the values it captured)."""
        if c.shape != out.shape or c.stride() != out.stride() or c.dtype != out.dtype:
            raise ValueError(f"cuBLASLt addmm: c {tuple(c.shape)} {c.dtype} is not laid out as out {tuple(out.shape)}")
        self._matmul(out, a, b, None, DEFAULT, algo, c=None if c is out else c, alpha=alpha, beta=beta)

    def gelu_aux(self, a: torch.Tensor, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, algo: int = 0) -> None:
        """h = x @ w (the pre-GELU activation, cuBLASLt's aux output) and a = gelu(h), from one GEMM. 2D, rows
        contiguous for a and h; algo: the heuristic's candidate."""
        self._matmul(a, x, w, h, GELU_AUX, algo)

    def dgelu(self, dh: torch.Tensor, dout: torch.Tensor, w: torch.Tensor, h: torch.Tensor, algo: int = 0) -> None:
        """dh = (dout @ w) * gelu'(h), from one GEMM reading h (cuBLASLt's aux input). 2D; w may be a transposed
        view."""
        self._matmul(dh, dout, w, h, DGELU, algo)
