"""The Triton GEMM tile every matmul kernel of the engine is built from (linear.py's, and fp8.py's scaled one)."""

import triton
import triton.language as tl


@triton.jit
def gemm_tile(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn, pid,
               ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GROUP_M: tl.constexpr, IEEE: tl.constexpr,
               sa_ptr=None, sb_ptr=None, SCALED: tl.constexpr = False):  # fmt: skip
    """One (BM, BN) tile of c (+)= a @ b, tiles ordered in groups of GROUP_M rows for L2 reuse. SCALED (fp8):
    c (+)= (a @ b) * sa * sb, the inverse scales read from sa_ptr, sb_ptr."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_n = (pid % group) // gsize
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * sam + offs_k[None, :].to(tl.int64) * sak
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * sbk + offs_n[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] + k < K), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] + k < K) & (offs_n[None, :] < N), other=0.0)
        b = b.to(a.dtype)  # mixed operands (fp32 logits with bf16 weights) meet at a's type
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")  # fp32 mode: no tf32 rounding
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK * sak
        b_ptrs += BK * sbk
    if SCALED:
        acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * scm + offs_n[None, :].to(tl.int64) * scn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ACC:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def k_mm_scaled(c_ptr, a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr):  # fmt: skip
    # c (M,N) (+)= (a (M,K) @ b (K,N)) * sa * sb: the FP8 GEMM (E4M3 a, b; fp32 sums), any strides
    gemm_tile(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn, tl.program_id(0),
               ACC, BM, BN, BK, GROUP_M, False, sa_ptr, sb_ptr, True)  # fmt: skip
