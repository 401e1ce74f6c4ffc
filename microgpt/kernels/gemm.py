"""Every GEMM of the engine: the Triton tile they are built from, and the router that picks a way for each shape.

    Gemm.mm(out, a, b, acc)        out (M,N) (+)= a (M,K) @ b (K,N)
    Gemm.bmm(out, a, b, acc)       out (G,M,N) (+)= a (G,M,K) @ b (G,K,N), one strided-batched GEMM
    Gemm.mm_act(a, h, x, w, act)   h = x @ w and a = act(h) (the MLP's W_1; h None: a alone, ReLU^2's): GEMM +
                                   pass, one of our tiles with act in its epilogue, or (GELU) one cuBLASLt GEMM with
                                   its epilogue
    Gemm.mm_dact(dx, dy, w, v, act)    dx = (dy @ w) * act'(h) (the MLP's dh), act' read from v: h for GELU, a =
                                   act(h) for ReLU^2 (tile.act_grad): GEMM + pass, or one of our tiles with act' in
                                   its epilogue
    Gemm.mm_scaled(out, a, ia, b, ib, acc, wgrad)    out (+)= (a @ b) * ia * ib on E4M3 a, b (fp8), 2D or batched
    Gemm.addmm(out, c, a, b, beta, alpha, symmetric)  out = beta c + alpha (a @ b): Muon's Newton-Schulz products,
                                   the symmetric ones also by the half-tile kernel of kernels/symmetric.py

A GEMM runs our Triton tile kernel (k_gemm; on sm_90 and newer also the TMA tiles of gemm_tma.py), cuBLAS through
torch.mm/addmm(out=...), or cuBLASLt under one of the algorithms its heuristic offers (cublaslt.py), whichever measured
fastest for that shape, dtypes, layout and alignment (fp8's: torch._scaled_mm or cuBLASLt's algorithms); the choice is
made once, in the warm-up, and recorded on disk (tuning.py). torch's cuBLAS call takes its heuristic's first algorithm,
which at ANDREA-120M's shapes is often not the fastest (bench/RESULTS.md). A `Gemm` is the runtime's
(kernels/runtime.py): it holds the device's tuner and cuBLASLt handle and the ways this process has settled. Under
TRITON_INTERPRET=1 (CI) and off CUDA every GEMM runs the Triton tile (addmm: the symmetric tile where it applies, else
torch's addmm). Operands may be any strided view (w.T, x.T): every way takes transposes for free.

Our Triton kernels share one main loop (gemm_acc: a tile's fp32 sum, by kernels/tile.py's K loop) and differ in
their epilogues: k_gemm stores or adds it, k_mm_scaled scales it first (fp8), k_gemm_act stores h and act(h) (saving
the pass's read of h), or act(h) alone where h is not kept (ReLU^2's, whose backward reads a: saving the pass's read
and write of a), and k_gemm_dact multiplies it by act'(h) (saving the pass's read and write of dh). The MLP's
two fusions are candidates like any way: the warm-up times each against GEMM + pass, and a fusion runs only where it
measured faster. With pointer loads they lost on an H100 at ANDREA-120M's shape (mb 32, fp16: the tile's GEMM 0.313 ms
to cuBLAS's 0.234, ReLU^2's forward tile 0.360 ms to GEMM + pass's 0.338, its backward 0.430 to 0.405), which leaves
4.0 ms a step of ReLU^2 passes in the modern step. So on sm_90 and newer the same three kernels come again with their
operands copied by TMA through host descriptors and multiplied by wgmma (gemm_tma.py: k_gemm_tma, k_gemm_act_tma,
k_gemm_dact_tma), under three named configurations (gemm_tma.TILES: tma_128x256, tma_128x128, tma_persistent), each
a way of mm (beside "triton"), mm_act and mm_dact (beside "tile") where its operands are 16-bit and 16-byte aligned;
elsewhere (sm_80/86/89, fp32, an unaligned view) they are not offered. Under one configuration a fused TMA tile
equals its plain TMA GEMM + the pass, bit for bit, as the pointer tiles do.

Where a device or a library offers less, a GEMM falls back rather than fails, and the tuner's note says so once:
a Triton tile that does not fit the device's shared memory (OutOfResources: its bf16/fp16 tile needs 96 KiB, of
the 99 KiB a block of sm_86 and sm_89 has) leaves the GEMMs to cuBLAS, the warm-up's reference included; a
cuBLASLt heuristic that offers no algorithm leaves a GEMM to torch's cuBLAS, and the MLP's GELU to its pass or our
tile.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from microgpt.kernels import gelu, relu2
from microgpt.kernels.cublaslt import DEFAULT, GELU_AUX, CublasLt, alignment
from microgpt.kernels.gemm_tma import TILES, tma_fits, tma_mm, tma_mm_act, tma_mm_dact
from microgpt.kernels.symmetric import symmetric_addmm
from microgpt.kernels.tile import act_grad, act_of, dot_loop, tile_of
from microgpt.kernels.tuning import INTERPRET, Tuner
from microgpt.ops.linear import FROM_OUTPUT

PROBE_ROWS = 16  # rows of a GEMM's output compared between the candidates
# the MLP's activation by name (ops/linear.ACTIVATIONS): its pass a = act(h) (ReLU^2's in place too), and dh *=
# act'(h) in place, read from what the MLP keeps for it: h for GELU, a for ReLU^2 (ops/linear.FROM_OUTPUT; fp8's cast
# reads h by its own op, fp8_cast.py)
ACTIVATIONS = {"gelu": (gelu.gelu_forward, gelu.gelu_backward), "relu2": (relu2.relu2_forward, relu2.relu2_backward)}


@triton.jit
def gemm_acc(
    a_ptr,
    b_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    pid,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The fp32 sum acc (BM, BN) of program pid's tile of a @ b (kernels/tile.py's loop), tiles in tile_of's order
    (groups of GROUP_M block rows, for L2 reuse), with the tile's row and column offsets (offs_m, offs_n) for its
    epilogue."""
    pid_m, pid_n = tile_of(pid, M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = dot_loop(a_ptr, b_ptr, offs_m, offs_n, M, N, K, sam, sak, sbk, sbn, BM, BN, BK, IEEE)
    return acc, offs_m, offs_n


@triton.jit
def gemm_tile(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    scm,
    scn,
    pid,
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
    sa_ptr=None,
    sb_ptr=None,
    SCALED: tl.constexpr = False,
):
    """One (BM, BN) tile of c (+)= a @ b. SCALED (fp8): c (+)= (a @ b) * sa * sb, the inverse scales read from
    sa_ptr, sb_ptr."""
    acc, offs_m, offs_n = gemm_acc(a_ptr, b_ptr, M, N, K, sam, sak, sbk, sbn, pid, BM, BN, BK, GROUP_M, IEEE)
    if SCALED:
        acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * scm + offs_n[None, :].to(tl.int64) * scn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ACC:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def k_gemm(
    c_ptr,
    a_ptr,
    b_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    scm,
    scn,
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    # c (M,N) (+)= a (M,K) @ b (K,N); any strides
    gemm_tile(
        a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn, tl.program_id(0), ACC, BM, BN, BK, GROUP_M, IEEE
    )


@triton.jit
def k_mm_scaled(
    c_ptr,
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    scm,
    scn,
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # c (M,N) (+)= (a (M,K) @ b (K,N)) * sa * sb: the FP8 GEMM (E4M3 a, b; fp32 sums), any strides
    gemm_tile(
        a_ptr,
        b_ptr,
        c_ptr,
        M,
        N,
        K,
        sam,
        sak,
        sbk,
        sbn,
        scm,
        scn,
        tl.program_id(0),
        ACC,
        BM,
        BN,
        BK,
        GROUP_M,
        False,
        sa_ptr,
        sb_ptr,
        True,
    )


@triton.jit
def k_gemm_act(
    h_ptr,
    a_ptr,
    x_ptr,
    w_ptr,
    M,
    N,
    K,
    sxm,
    sxk,
    swk,
    swn,
    shm,
    shn,
    ACT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
    STORE_H: tl.constexpr,
):
    # h (M,N) = x (M,K) @ w (K,N) and a (M,N) = act(h), a with h's strides (STORE_H False: a alone, h_ptr unused).
    # act reads h as stored (the fp32 sum rounded to a's dtype), as the pass k_<act>_fwd would, after the GEMM into h
    # (or into a, in place): a is the pass's a, bit for bit, over the same sum
    acc, offs_m, offs_n = gemm_acc(
        x_ptr, w_ptr, M, N, K, sxm, sxk, swk, swn, tl.program_id(0), BM, BN, BK, GROUP_M, IEEE
    )
    offs = offs_m[:, None].to(tl.int64) * shm + offs_n[None, :].to(tl.int64) * shn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    h = acc.to(a_ptr.dtype.element_ty)
    if STORE_H:
        tl.store(h_ptr + offs, h, mask=mask)
    tl.store(a_ptr + offs, act_of(h.to(tl.float32), ACT).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_gemm_dact(
    dx_ptr,
    dy_ptr,
    w_ptr,
    v_ptr,
    M,
    N,
    K,
    sym,
    syk,
    swk,
    swn,
    sxm,
    sxn,
    ACT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    # dx (M,N) = (dy (M,K) @ w (K,N)) * act'(h), act' read from v (M,N) with dx's strides (h for GELU, a for ReLU^2:
    # tile.act_grad): the sum rounded to dx's dtype, then times act'(h) in fp32 and rounded again, as the GEMM and
    # the pass k_<act>_bwd would: bit for bit, over one sum
    acc, offs_m, offs_n = gemm_acc(
        dy_ptr, w_ptr, M, N, K, sym, syk, swk, swn, tl.program_id(0), BM, BN, BK, GROUP_M, IEEE
    )
    offs = offs_m[:, None].to(tl.int64) * sxm + offs_n[None, :].to(tl.int64) * sxn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    da = acc.to(dx_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dx_ptr + offs, (da * act_grad(v, ACT)).to(dx_ptr.dtype.element_ty), mask=mask)


def tile_config(dtype: torch.dtype) -> dict:
    """k_gemm's tile for an operand dtype (the interpreter: few programs, since it runs them one by one)."""
    if INTERPRET:
        return dict(BM=64, BN=64, BK=32, GROUP_M=4)
    if dtype == torch.float32:
        return dict(BM=128, BN=64, BK=32, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4)


def triton_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (M,N) (+)= a (M,K) @ b (K,N) by k_gemm."""
    (M, K), N = a.shape, b.shape[1]
    cfg = tile_config(a.dtype)
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    k_gemm[grid](
        out,
        a,
        b,
        M,
        N,
        K,
        *a.stride(),
        *b.stride(),
        *out.stride(),
        ACC=accumulate,
        IEEE=a.dtype == torch.float32,
        **cfg,
    )


def triton_mm_act(a: torch.Tensor, h: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor, act: str) -> None:
    """h (M,N) = x (M,K) @ w (K,N) and a = act(h) by k_gemm_act (h and a of one layout; h None: a alone)."""
    (M, K), N = x.shape, w.shape[1]
    assert h is None or a.stride() == h.stride(), "a and h share one layout"
    cfg = tile_config(x.dtype)
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    k_gemm_act[grid](
        a if h is None else h,
        a,
        x,
        w,
        M,
        N,
        K,
        *x.stride(),
        *w.stride(),
        *a.stride(),
        ACT=act,
        IEEE=x.dtype == torch.float32,
        STORE_H=h is not None,
        **cfg,
    )


def triton_mm_dact(dx: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, v: torch.Tensor, act: str) -> None:
    """dx (M,N) = (dy (M,K) @ w (K,N)) * act'(h) by k_gemm_dact, act' read from v (h, or ReLU^2's a; v and dx of
    one layout)."""
    (M, K), N = dy.shape, w.shape[1]
    assert v.stride() == dx.stride(), "v and dx share one layout"
    cfg = tile_config(dy.dtype)
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    k_gemm_dact[grid](
        dx, dy, w, v, M, N, K, *dy.stride(), *w.stride(), *dx.stride(), ACT=act, IEEE=dy.dtype == torch.float32, **cfg
    )


def triton_mm_scaled(
    out: torch.Tensor, a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor, accumulate: bool
) -> None:
    """out (+)= (a @ b) * ia * ib by k_mm_scaled (E4M3 a, b; fp32 sums), 2D or each matrix of a batch: the
    interpreter's FP8 GEMM."""
    if out.dim() == 3:
        for g in range(out.shape[0]):
            triton_mm_scaled(out[g], a[g], ia, b[g], ib, accumulate)
        return
    (M, K), N = a.shape, b.shape[1]
    cfg = dict(BM=32, BN=32, BK=32, GROUP_M=4)
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    k_mm_scaled[grid](out, a, b, ia, ib, M, N, K, *a.stride(), *b.stride(), *out.stride(), ACC=accumulate, **cfg)


def torch_scaled_mm(
    out: torch.Tensor,
    a: torch.Tensor,
    ia: torch.Tensor,
    b: torch.Tensor,
    ib: torch.Tensor,
    accumulate: bool,
    wgrad: torch.Tensor | None,
) -> None:
    """torch's FP8 GEMM (torch._scaled_mm: cuBLASLt under its heuristic's first algorithm, in torch's workspace),
    one call per matrix of a batch. It cannot add into out: an accumulating GEMM writes its fp32 product into
    `wgrad` (planned, at least one matrix of out) and one add folds it in."""
    if out.dim() == 3:
        for g in range(out.shape[0]):
            torch_scaled_mm(out[g], a[g], ia, b[g], ib, accumulate, wgrad)
        return
    if not accumulate:
        torch._scaled_mm(a, b, ia, ib, out_dtype=out.dtype, out=out)
        return
    tmp = wgrad[: out.numel()].view(out.shape)
    torch._scaled_mm(a, b, ia, ib, out_dtype=torch.float32, out=tmp)
    out.add_(tmp)


def torch_addmm(
    out: torch.Tensor, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float
) -> None:
    """torch's out = beta c + alpha (a @ b): addmm, or baddbmm for a batch (beta 0 reads nothing of c)."""
    (torch.baddbmm if out.dim() == 3 else torch.addmm)(c, a, b, beta=beta, alpha=alpha, out=out)


def cublas_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """torch's cuBLAS call: out (+)= a @ b, 2D (mm, addmm) or batched 3D (bmm, baddbmm)."""
    aten, batched = torch.ops.aten, out.dim() == 3
    if out.dtype == a.dtype:
        if accumulate:
            (out.baddbmm_ if batched else out.addmm_)(a, b)
        else:
            (torch.bmm if batched else torch.mm)(a, b, out=out)
    elif accumulate:  # bf16/fp16 operands into fp32 grads: cuBLAS's fp32-output path (torch >= 2.8)
        (aten.baddbmm if batched else aten.addmm).dtype_out(out, a, b, out.dtype, out=out)
    else:
        (aten.bmm if batched else aten.mm).dtype_out(a, b, out.dtype, out=out)


class Gemm:
    """The GEMM router of one device: its tuner, its cuBLASLt (None where there is none), whether it offers the TMA
    tiles (tma: None asks the operands' device), and per shape key the way chosen, with whether it is settled (timed
    or recorded, not a default taken outside the warm-up)."""

    def __init__(self, tuner: Tuner, lt: CublasLt | None, tma: bool | None = None) -> None:
        self.tuner, self.lt, self.tma = tuner, lt, tma
        self._chosen: dict[str, tuple[str, bool]] = {}
        self._act_ways: dict[str, dict[str, tuple[str, int | str]]] = {}
        self._tile_fits: dict[torch.dtype, bool] = {}  # per operand dtype: False once the device refused the tile

    def _tma_tiles(self, a: torch.Tensor, b: torch.Tensor, *outs: torch.Tensor) -> list[str]:
        """The TMA tiles' ways (gemm_tma.TILES) for a 2D GEMM a @ b writing (or reading) outs: where this router
        offers them (its `tma`, else a on a GPU of compute capability 9.0 or newer: TMA is Hopper's) and they apply
        (gemm_tma.tma_fits: 16-bit operands, 16-byte aligned)."""
        here = self.tma
        if here is None:
            here = a.is_cuda and not INTERPRET and torch.cuda.get_device_capability(a.device)[0] >= 9
        return list(TILES) if here and tma_fits(a, b, *outs) else []

    def _run(self, way: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
        """One GEMM (2D, or batched 3D) by the named way: "triton" (2D), a TMA tile's name (2D, gemm_tma.TILES),
        "cublas" (torch's call), or "lt<i>" (cuBLASLt under the i-th algorithm its heuristic offers for this shape).
        A pointer tile the device cannot run (OutOfResources, raised before it launches) gives the GEMM, and every
        later one of its dtype, to cuBLAS (operands of one dtype: mixed ones have no other way)."""
        if way in TILES:
            tma_mm(out, a, b, accumulate, way)
            return
        if way == "triton" and self._tile_fits.get(a.dtype, True):
            try:
                triton_mm(out, a, b, accumulate)
                return
            except OutOfResources as e:
                if a.dtype != b.dtype:
                    raise
                self._tile_fits[a.dtype] = False
                cfg = " ".join(f"{k}{v}" for k, v in tile_config(a.dtype).items())
                self.tuner.note(
                    f"tile {a.dtype}",
                    f"the Triton GEMM tile ({cfg}) does not fit {self.tuner.key} "
                    f"({e.name}: needs {e.required}, the device has {e.limit}); {a.dtype} GEMMs run on "
                    "cuBLAS",
                )
        if way in ("triton", "cublas"):
            cublas_mm(out, a, b, accumulate)
        else:
            self.lt.gemm(out, a, b, accumulate, int(way[2:]))

    def _ways(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> list[str]:
        """The ways this GEMM can run here, the reference first: the Triton tile (2D) or torch's batched GEMM; then
        the TMA tiles where they apply (2D), torch's cuBLAS call and cuBLASLt's algorithms."""
        if out.dim() == 3 or not self._tile_fits.get(a.dtype, True):
            ways = ["cublas"]
        else:
            ways = ["triton", "cublas"] if a.dtype == b.dtype else ["triton"]
        if out.dim() == 2:
            ways[1:1] = self._tma_tiles(a, b, out)
        if a.dtype == b.dtype:
            ways += self._lt_ways(out, a, b, "torch's cuBLAS")
        return ways

    def _lt_ways(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        other: str,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        c: torch.Tensor | None = None,
    ) -> list[str]:
        """cuBLASLt's ways for this GEMM ("lt<i>", one per algorithm its heuristic offers; c: addmm's), none where
        there is no cuBLASLt, where it cannot express the strides, or where its heuristic offers nothing (a note says
        that `other` runs such GEMMs)."""
        if self.lt is None:
            return []
        try:
            return [f"lt{i}" for i in range(self.lt.n_algos(out, a, b, None, DEFAULT, scales, c))]
        except ValueError:
            return []  # strides cuBLASLt cannot express
        except RuntimeError as e:  # its heuristic offers nothing here
            self.tuner.note(f"lt {a.dtype}->{out.dtype}", f"{e}: {other} runs such GEMMs")
            return []

    @staticmethod
    def _key(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> str:
        """A GEMM's key in the tuner's table: shapes, strides, dtypes, whether it adds, and the alignments
        cuBLASLt's algorithms depend on."""
        key = f"{tuple(a.shape)}x{b.shape[-1]}:{a.stride()}:{b.stride()}:{a.dtype}->{out.dtype}:{int(accumulate)}"
        return key + ":a{}.{}.{}".format(*alignment(a, b, out))

    def _pick(
        self,
        key: str,
        out: torch.Tensor,
        ways: list[str],
        run: Callable[[str, bool], None],
        dtype: torch.dtype,
        accumulate: bool,
    ) -> str:
        """Choose the way for this GEMM (operands of `dtype`) among `ways` (the reference first; run(way,
        accumulate) runs one). Inside the tuning window (the warm-up step, whose values are thrown away) every way
        runs into `out` itself, and a way other than the reference is a candidate only if the first rows of its
        output agree with the reference's (compared in the planned probe buffer): nothing beyond the plan is
        allocated."""
        if self.tuner.is_open and len(ways) > 1:
            flat = out[0] if out.dim() == 3 else out  # a batched GEMM's first matrix: each is contiguous rows
            rows, cols = min(PROBE_ROWS, flat.shape[0]), flat.shape[1]  # (out itself may be a slice of its buffer)
            ref, got = self.tuner.probe()[: 2 * rows * cols].view(2, rows, cols)
            run(ways[0], False)  # a tile that does not fit: cuBLAS runs the reference
            ref.copy_(flat[:rows])
            if ways[0] == "triton" and not self._tile_fits.get(dtype, True):
                ways = ways[1:]
            agree = ways[:1]
            for way in ways[1:]:
                try:
                    run(way, False)
                except OutOfResources as e:  # a Triton way this device cannot run (raised before it launched)
                    self.tuner.unfit("gemm", way, e)
                    continue
                except (RuntimeError, TypeError, ValueError):
                    continue  # this torch, library, dtype or layout combination has no such path
                got.copy_(flat[:rows])
                if got.sub_(ref).norm() <= (1e-4 if dtype == torch.float32 else 2e-2) * ref.norm():
                    agree.append(way)
            ways = agree
        candidates = {way: lambda way=way: run(way, accumulate) for way in ways}
        return self.tuner.choose("gemm", key, candidates)

    def _tuned(
        self,
        key: str,
        out: torch.Tensor,
        ways: Callable[[], list[str]],
        run: Callable[[str, bool], None],
        dtype: torch.dtype,
        accumulate: bool,
    ) -> None:
        """Run this GEMM (key: its shapes, strides, dtypes and alignments) by the way chosen for it, choosing first
        where none is settled: ways() lists the candidates, run(way, accumulate) runs one."""
        way, settled = self._chosen.get(key, (None, False))
        if way is None or (not settled and self.tuner.is_open):  # an untimed default is timed when the warm-up comes
            way = self._pick(key, out, ways(), run, dtype, accumulate)
            self._chosen[key] = (way, self.tuner.is_open or self.tuner.choices("gemm").get(key) == way)
        run(way, accumulate)

    def _plain(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
        """mm's and bmm's GEMM by the way chosen for its key."""
        self._tuned(
            self._key(out, a, b, accumulate),
            out,
            lambda: self._ways(out, a, b),
            lambda way, acc: self._run(way, out, a, b, acc),
            a.dtype,
            accumulate,
        )

    def mm(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
        """out (M,N) (+)= a (M,K) @ b (K,N). a, b any strides; out contiguous rows."""
        if INTERPRET or not out.is_cuda:
            triton_mm(out, a, b, accumulate)
            return
        self._plain(out, a, b, accumulate)

    def bmm(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
        """out (G,M,N) (+)= a (G,M,K) @ b (G,K,N) as one strided-batched GEMM (torch's or cuBLASLt's, chosen as mm's),
        allocating nothing. a may repeat one matrix by a zero batch stride (x.expand(G, ...): the QKV projection's
        input, read once per weight). One launch of three times the tiles fills the GPU better than three
        (bench/RESULTS.md). The interpreter loops over mm."""
        if INTERPRET or not out.is_cuda:
            for g in range(out.shape[0]):
                self.mm(out[g], a[g], b[g], accumulate)
            return
        self._plain(out, a, b, accumulate)

    def addmm(
        self,
        out: torch.Tensor,
        c: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        beta: float,
        alpha: float,
        symmetric: bool = False,
    ) -> None:
        """out = beta c + alpha (a @ b), 2D or batched (Muon's Newton-Schulz), c laid out as out; out never one of
        a, b's memory, nor c's where beta is not 0 (c is out itself in A = X X^T, whose beta is 0: nothing of c is
        read). symmetric: a @ b is symmetric (b = a^T, or a = b a symmetric matrix) and so is c where beta is not 0,
        which offers the tile of kernels/symmetric.py that computes the upper half and mirrors it.
        On a GPU the ways, none of which splits K or adds with atomics (the step repeats bit for bit under any of
        them): cuBLASLt under each algorithm its heuristic offers (the first, the reference, is the way outside the
        warm-up where nothing is recorded), and the symmetric tile; the warm-up times them and records the fastest,
        as mm's ways are. Without cuBLASLt (a build whose library is not found, a shape its heuristic refuses, with
        a note) torch's addmm / baddbmm is the reference, not promised to repeat bit for bit for bf16 batches. The
        interpreter (and tensors off CUDA): the symmetric tile where it applies, torch's addmm otherwise."""
        if INTERPRET or not out.is_cuda:
            (symmetric_addmm if symmetric else torch_addmm)(out, c, a, b, beta, alpha)
            return
        if beta != 0 and c.data_ptr() == out.data_ptr():
            raise ValueError("addmm: c is out itself with beta not 0 (a way timed twice would add c twice)")
        self._addmm_tuned(out, c, a, b, beta, alpha, symmetric)

    def _addmm_tuned(
        self,
        out: torch.Tensor,
        c: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        beta: float,
        alpha: float,
        symmetric: bool,
    ) -> None:
        """addmm by the way chosen for its key (the GEMM's, whether c is read, c's alignment, and whether the
        symmetric tile is offered)."""
        key = f"addmm{'_sym' if symmetric else ''}:{self._key(out, a, b, beta != 0)}.{alignment(c)[0]}"

        def ways() -> list[str]:
            lt = self._lt_ways(out, a, b, "torch's cuBLAS (not promised to repeat bit for bit)", c=c)
            return (lt or ["cublas"]) + (["sym"] if symmetric else [])

        self._tuned(key, out, ways, lambda way, _: self._addmm_run(way, out, c, a, b, beta, alpha), a.dtype, False)

    def _addmm_run(
        self, way: str, out: torch.Tensor, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float
    ) -> None:
        """One addmm by the named way: "cublas" (torch's), "sym" (kernels/symmetric.py), or "lt<i>"."""
        if way == "cublas":
            torch_addmm(out, c, a, b, beta, alpha)
        elif way == "sym":
            symmetric_addmm(out, c, a, b, beta, alpha)
        else:
            self.lt.addmm(out, c, a, b, beta, alpha, int(way[2:]))

    def mm_scaled(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        ia: torch.Tensor,
        b: torch.Tensor,
        ib: torch.Tensor,
        accumulate: bool = False,
        wgrad: torch.Tensor | None = None,
    ) -> None:
        """out (+)= (a @ b) * ia * ib: E4M3 a (M,K) row-major and b (K,N) column-major, fp32 sums, ia and ib the
        (1,) inverse scales; 2D, or batched (G,M,K) @ (G,K,N) where a's batch stride may be 0. The ways: torch's
        _scaled_mm (the reference; one call a matrix, an accumulation through `wgrad`, fp32 of one matrix of out),
        or cuBLASLt's FP8 GEMM under each algorithm its heuristic offers (one call a batch, adding in its
        epilogue). The interpreter runs the Triton scaled tile."""
        if INTERPRET or not out.is_cuda:
            triton_mm_scaled(out, a, ia, b, ib, accumulate)
            return

        def ways() -> list[str]:
            return ["scaled_mm", *self._lt_ways(out, a, b, "torch._scaled_mm", (ia, ib))]

        def run(way: str, acc: bool) -> None:
            if way == "scaled_mm":
                torch_scaled_mm(out, a, ia, b, ib, acc, wgrad)
            else:
                self.lt.gemm(out, a, b, acc, int(way[2:]), ia, ib)

        self._tuned("f8:" + self._key(out, a, b, accumulate), out, ways, run, a.dtype, accumulate)

    def mm_act(self, a: torch.Tensor, h: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor, act: str) -> None:
        """h = x @ w and a = act(h) (2D; act "gelu" or "relu2"; h None: a alone, for ReLU^2 whose backward reads a),
        by the way the warm-up timed fastest for this shape (outside it, untimed: the first): "pass", the GEMM (mm's
        way) then the activation's pass (h None: the GEMM into a, the pass over it in place); "tile", our Triton
        pointer tile with the activation in its epilogue (k_gemm_act); on sm_90 and newer, where the operands are
        16-bit and 16-byte aligned, each TMA tile of gemm_tma.TILES by its name (k_gemm_act_tma under that
        configuration); "lt<i>" (GELU in bf16 and fp16 on a GPU, h kept), one cuBLASLt GEMM with its GELU_AUX
        epilogue under the i-th algorithm its heuristic offers. The fusions save the pass's read of h (h None: its
        read and write of a), but win only with a GEMM near cuBLAS's: on an H100 at ANDREA-120M's shape (mb 32, fp16)
        the pointer tile's GEMM took 0.313 ms to cuBLAS's 0.234, and ReLU^2's tile 0.360 ms to the pass's 0.338 (h
        and a stored); the TMA tiles are the attempt at cuBLAS's speed (gemm_tma.py). The pass and our tiles apply act
        to h as stored (rounded to its dtype); cuBLASLt applies its GELU to the fp32 sum, so its a may differ by a
        unit in its last place. Each way's h is its own GEMM's (the sums' order differs between ways). With h None
        the choice is keyed apart (":a-only"): its ways store one output, not two."""
        outs = (a,) if h is None else (a, h)
        key = f"{act}:{tuple(x.shape)}x{w.shape[1]}:{x.dtype}:a" + ".".join(map(str, alignment(x, w, *outs)))
        key += ":a-only" if h is None else ""
        ways = self._act_ways.get(key)
        if ways is None:
            ways = {"pass": ("pass", -1), "tile": ("tile", -1)}
            ways |= {tile: ("tma", tile) for tile in self._tma_tiles(x, w, *outs)}
            lt = act == "gelu" and h is not None and self.lt is not None  # a GPU's lt, whose epilogue writes h too
            if lt and x.dtype in (torch.bfloat16, torch.float16):
                try:
                    ways |= {f"lt{i}": ("lt", i) for i in range(self.lt.n_algos(a, x, w, h, GELU_AUX))}
                except (RuntimeError, ValueError) as e:  # no such epilogue here: the pass or the tile it is
                    self.tuner.note(f"gelu_aux {x.dtype}", f"{e}: the MLP's GELU runs as its own pass or in our tile")
            self._act_ways[key] = ways

        def make(way: str, which: int | str) -> Callable[[], None]:
            if way == "lt":
                return lambda: self.lt.gelu_aux(a, h, x, w, which)
            if way == "tile":
                return lambda: triton_mm_act(a, h, x, w, act)
            if way == "tma":
                return lambda: tma_mm_act(a, h, x, w, act, which)
            pre = a if h is None else h  # where the GEMM writes h: a itself, where h is not kept

            def gemm_and_pass() -> None:
                self.mm(pre, x, w)
                ACTIVATIONS[act][0](a, pre)

            return gemm_and_pass

        self.tuner.launch("mlp_act", key, ways, make)

    def mm_dact(self, dx: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, v: torch.Tensor, act: str) -> None:
        """dx = (dy @ w) * act'(h) (2D; the MLP's dh, from W_2's input-gradient GEMM with w = w_2^T), act' read from v:
        h for GELU, a = act(h) for ReLU^2 (tile.act_grad; ops/linear.FROM_OUTPUT), by the way the warm-up timed
        fastest for this shape (outside it, untimed: the first): "pass", the GEMM (mm's way) then the pass dx *=
        act'(h) in place; "tile", our Triton pointer tile with act' in its epilogue (k_gemm_dact); on sm_90 and newer,
        where the operands are 16-bit and 16-byte aligned, each TMA tile of gemm_tma.TILES by its name
        (k_gemm_dact_tma, w^T read through the descriptor of w_2 itself). The fusions save the pass's read and write
        of dx, but the pointer tile lost on an H100 at ANDREA-120M's shape (mb 32, fp16: ReLU^2's 0.430 ms to the
        pass's 0.405, its GEMM alone 0.3745 to cuBLAS's 0.229 on this transposed w; act' then read from h). All round
        the sum to dx's dtype before multiplying by act'(h) in fp32, so they differ only as their sums' order does."""
        # v's alignment too (the TMA tiles read it); ReLU^2's keyed apart from the choices timed when it read h
        key = f"{act}/a:" if act in FROM_OUTPUT else f"{act}:"
        key += self._key(dx, dy, w, False) + f".{alignment(v)[0]}"

        def make(way: str, tile: str = "") -> Callable[[], None]:
            if way == "tile":
                return lambda: triton_mm_dact(dx, dy, w, v, act)
            if way == "tma":
                return lambda: tma_mm_dact(dx, dy, w, v, act, tile)

            def gemm_and_pass() -> None:
                self.mm(dx, dy, w)
                ACTIVATIONS[act][1](dx, v)

            return gemm_and_pass

        ways = {"pass": ("pass",), "tile": ("tile",)} | {t: ("tma", t) for t in self._tma_tiles(dy, w, dx, v)}
        self.tuner.launch("mlp_dact", key, ways, make)

    def choices(self) -> dict[str, str]:
        """Shape key -> way (triton, cublas, lt<i>) for every GEMM this process ran (printed with the memory plan)."""
        return {key: way for key, (way, _) in self._chosen.items()}
