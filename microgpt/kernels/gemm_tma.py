"""The GEMM tiles of Hopper and newer GPUs (sm_90+): operands copied by TMA through host tensor descriptors and
multiplied by wgmma, under a few named configurations (TILES) that the GEMM router (gemm.py) offers beside the
pointer tile where they apply.

    tma_mm(out, a, b, accumulate, tile)    out (M,N) (+)= a (M,K) @ b (K,N)      k_gemm_tma
    tma_mm_act(a, h, x, w, act, tile)      h = x @ w and a = act(h) (h None: a)   k_gemm_act_tma
    tma_mm_dact(dx, dy, w, v, act, tile)   dx = (dy @ w) * act'(h), from v        k_gemm_dact_tma
                                           (h for GELU, a = act(h) for ReLU^2)

Why. At ANDREA-120M's MLP shape, x (32768, 768) @ w (768, 3072) in fp16 on one H100, the pointer tile (gemm.py
k_gemm: BM128 BN128 BK64, 8 warps, 4 stages) took 0.313 ms against cuBLAS's 0.234 (the best cuBLASLt algorithm
0.209, ~740 TFLOP/s), so its fused epilogues lost the warm-up to cuBLAS + the activation's pass: ReLU^2's forward
0.360 ms against 0.338, its backward 0.430 against 0.405 (GELU's backward tile 0.547), and the modern step spends
4.0 ms a step in the ReLU^2 passes (GPT-2's GELU backward pass 2.4 ms). A fused tile as fast as cuBLAS's GEMM saves
most of that. Pointer loads go through the registers of every thread (cp.async, masks, address arithmetic); a TMA
copy moves a whole block into swizzled shared memory that wgmma reads as it is, and Triton pipelines the copies
num_stages deep behind barriers.

The K loop (tma_dot) reads (BM, BK) blocks of a and (BK, BN) blocks of b through their descriptors. A transposed
operand, an (R, C) view of strides (1, ld) (x.T in a weight gradient, w.T in an input gradient), is read through the
descriptor of its contiguous base (C, R) in transposed blocks, transposed back with `.T` (wgmma reads a transposed
block from shared memory as it lies: nothing moves). Out-of-range rows and columns need no masks: the descriptor
zero-fills reads past the matrix (so K not a multiple of BK adds zeros) and clips writes to it.

Host descriptors are kernel parameters (a tensor map the driver fills on the host at each launch): they allocate
nothing on the device, as the memory plan requires (device-side descriptors would need triton.set_allocator's
scratch). TMA needs every descriptor's base address and row stride 16-byte aligned, and the tiles take 16-bit
operands and outputs only (wgmma has no IEEE fp32 product: fp32 GEMMs keep the pointer tile's IEEE dot; an fp32
output, a weight gradient's, would not fit its TMA store's staging beside the pipeline); `tma_fits` says where they
apply, and elsewhere the router does not offer them.

TILES (at most a few: the warm-up times every candidate of a choice):
    tma_128x256     BM128 BN256 BK64, 8 warps (two warpgroups of 64 rows: wgmma's widest N), 3 stages of 48 KiB
    tma_128x128     BM128 BN128 BK64, 8 warps, 4 stages of 32 KiB (the pointer tile's shape)
    tma_persistent  tma_128x128's tile, one program per multiprocessor walking the tiles in tile_of's order, the loop
                    over tiles and K flattened into one that Triton pipelines, so a tile's epilogue overlaps the next
                    tile's first copies (the fused epilogues store two outputs or read one: the most to hide)
Shared memory a block on sm_90 (check/targets.py, at ANDREA's shapes; the limit is 227 KiB), with no register spilled
(at most 255 registers a thread, k_gemm_dact_tma's ReLU^2 under tma_128x256, whose slope 2 sqrt(a) takes the fast
root: the IEEE one spills it, kernels/relu2.py): tma_128x256 209 KiB in every kernel, tma_128x128 161 KiB,
tma_persistent 161 KiB and 193 KiB where the epilogue reads a block (dact's h or a, a GEMM adding into its output).
The persistent flattening of the 128x256 tile would need 273 KiB in the dact kernel.

Numerics: the three kernels share tma_dot, so under one configuration k_gemm_act_tma's h and a and k_gemm_dact_tma's
dx equal k_gemm_tma followed by the activation's pass, bit for bit: the epilogues round the sum to the output's dtype
before the activation, as the pass reads it. Different configurations sum a tile's K in the same order but in
different wgmma shapes, so they may differ in the last bits, as the router's other ways do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from microgpt.kernels.tile import act_grad, act_of, tile_of

TILES = {
    "tma_128x256": dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3, PERSISTENT=False),
    "tma_128x128": dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4, PERSISTENT=False),
    "tma_persistent": dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4, PERSISTENT=True),
}
OFF_CUDA_PROGRAMS = 2  # a persistent tile's programs off CUDA (the interpreter): each walks several tiles


@triton.jit
def tma_dot(
    a_desc,
    b_desc,
    off_m,
    off_n,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
):
    # the fp32 sum (BM, BN) at (off_m, off_n) of a (M,K) @ b (K,N), the K steps in turn; A_T: a_desc is a's base
    # (K,M), read in (BK, BM) blocks; B_T: b_desc is b's base (N,K), read in (BN, BK) blocks
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        if A_T:
            a = a_desc.load([k, off_m]).T
        else:
            a = a_desc.load([off_m, k])
        if B_T:
            b = b_desc.load([off_n, k]).T
        else:
            b = b_desc.load([k, off_n])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def k_gemm_tma(
    c_desc,
    a_desc,
    b_desc,
    M,
    N,
    K,
    ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # c (M,N) (+)= a (M,K) @ b (K,N); every program walks tiles pid, pid + programs, ... (one each unless PERSISTENT)
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=PERSISTENT):
        pid_m, pid_n = tile_of(tile, M, N, BM, BN, GROUP_M)
        off_m, off_n = pid_m * BM, pid_n * BN
        acc = tma_dot(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_T, B_T)
        if ACC:
            acc += c_desc.load([off_m, off_n]).to(tl.float32)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@triton.jit
def k_gemm_act_tma(
    h_desc,
    act_desc,
    x_desc,
    w_desc,
    M,
    N,
    K,
    ACT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    PERSISTENT: tl.constexpr,
    STORE_H: tl.constexpr,
):
    # h (M,N) = x (M,K) @ w (K,N) and act (M,N) = act(h), act of h as stored (the sum rounded to h's dtype), as the
    # pass reads it: k_gemm_tma + the pass, bit for bit; STORE_H False: act alone (h_desc unused), k_gemm_tma into
    # act + the pass in place; A_T, B_T: x's and w's reads, as k_gemm_tma's a's and b's
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=PERSISTENT):
        pid_m, pid_n = tile_of(tile, M, N, BM, BN, GROUP_M)
        off_m, off_n = pid_m * BM, pid_n * BN
        h = tma_dot(x_desc, w_desc, off_m, off_n, K, BM, BN, BK, A_T, B_T).to(act_desc.dtype)
        if STORE_H:
            h_desc.store([off_m, off_n], h)
        act_desc.store([off_m, off_n], act_of(h.to(tl.float32), ACT).to(act_desc.dtype))


@triton.jit
def k_gemm_dact_tma(
    dx_desc,
    v_desc,
    dy_desc,
    w_desc,
    M,
    N,
    K,
    ACT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # dx (M,N) = (dy (M,K) @ w (K,N)) * act'(h), act' read from v (M,N) (h for GELU, a for ReLU^2: tile.act_grad):
    # the sum rounded to dx's dtype, then times act'(h) in fp32 and rounded again, as the GEMM and the pass would:
    # k_gemm_tma + the pass, bit for bit; A_T, B_T: dy's and w's reads
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=PERSISTENT):
        pid_m, pid_n = tile_of(tile, M, N, BM, BN, GROUP_M)
        off_m, off_n = pid_m * BM, pid_n * BN
        acc = tma_dot(dy_desc, w_desc, off_m, off_n, K, BM, BN, BK, A_T, B_T)
        v = v_desc.load([off_m, off_n])
        da = acc.to(dx_desc.dtype).to(tl.float32)
        dx_desc.store([off_m, off_n], (da * act_grad(v, ACT)).to(dx_desc.dtype))


def tma_major(t: torch.Tensor) -> bool | None:
    """How a TMA descriptor reads 2D t: False where its rows are contiguous (strides (ld, 1)), True where its columns
    are (a transposed view, strides (1, ld), read through its base t.T), None where neither holds with a 16-byte
    aligned base and ld (ld at least the contiguous extent: no overlapping or repeated rows)."""
    if t.dim() != 2 or t.data_ptr() % 16:
        return None
    for transposed, (ld, unit), inner in ((False, t.stride(), t.shape[1]), (True, t.stride()[::-1], t.shape[0])):
        if unit == 1 and ld >= inner and ld * t.element_size() % 16 == 0:
            return transposed
    return None


def tma_fits(a: torch.Tensor, b: torch.Tensor, *outs: torch.Tensor) -> bool:
    """Whether the TMA tiles apply to a GEMM of a (M,K) @ b (K,N) writing (or reading, h) outs (M,N): a, b and the
    outs of one 16-bit dtype, a and b each readable through a descriptor (tma_major), the outs with contiguous rows.
    (An fp32 output, a weight gradient's, would stage its tile for the TMA store in twice the shared memory: the
    128x256 tile adding into one needs 273 KiB, beyond sm_90's 227.)"""
    ok = a.dtype in (torch.bfloat16, torch.float16) and all(t.dtype == a.dtype for t in (b, *outs))
    ok = ok and min(*a.shape, *b.shape) > 0 and tma_major(a) is not None and tma_major(b) is not None
    return ok and all(tma_major(o) is False for o in outs)


def _desc(t: torch.Tensor, block: tuple[int, int]) -> TensorDescriptor:
    """t's descriptor for (rows, cols) blocks of t: over t, or, for a transposed view, over its base in transposed
    blocks."""
    if tma_major(t):
        t, block = t.T, block[::-1]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def _grid(tile: str, M: int, N: int, t: torch.Tensor) -> tuple[int]:
    """One program per tile, or for a persistent configuration one per multiprocessor of t's GPU."""
    cfg = TILES[tile]
    tiles = triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"])
    if not cfg["PERSISTENT"]:
        return (tiles,)
    sms = torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else OFF_CUDA_PROGRAMS
    return (min(tiles, sms),)


def _launch(
    kernel: triton.JITFunction, tile: str, mn: tuple[torch.Tensor, ...], a: torch.Tensor, b: torch.Tensor, **consts
) -> None:
    """kernel under TILES[tile] for a (M,K) @ b (K,N): its arguments the descriptors of the (M,N) tensors mn, of a
    and of b, then M, N, K; A_T and B_T say how a and b are read (tma_major)."""
    (M, K), N, cfg = a.shape, b.shape[1], TILES[tile]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    descs = [_desc(t, (BM, BN)) for t in mn] + [_desc(a, (BM, BK)), _desc(b, (BK, BN))]
    kernel[_grid(tile, M, N, a)](*descs, M, N, K, A_T=tma_major(a), B_T=tma_major(b), **consts, **cfg)


def tma_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool, tile: str) -> None:
    """out (M,N) (+)= a (M,K) @ b (K,N) by k_gemm_tma under TILES[tile] (where tma_fits(a, b, out))."""
    _launch(k_gemm_tma, tile, (out,), a, b, ACC=accumulate)


def tma_mm_act(a: torch.Tensor, h: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor, act: str, tile: str) -> None:
    """h (M,N) = x (M,K) @ w (K,N) and a = act(h) by k_gemm_act_tma under TILES[tile] (where tma_fits(x, w, h, a));
    h None: a alone (where tma_fits(x, w, a))."""
    _launch(k_gemm_act_tma, tile, (a if h is None else h, a), x, w, ACT=act, STORE_H=h is not None)


def tma_mm_dact(dx: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, v: torch.Tensor, act: str, tile: str) -> None:
    """dx (M,N) = (dy (M,K) @ w (K,N)) * act'(h) by k_gemm_dact_tma under TILES[tile], act' read from v (h, or
    ReLU^2's a; where tma_fits(dy, w, dx, v))."""
    _launch(k_gemm_dact_tma, tile, (dx, v), dy, w, ACT=act)
