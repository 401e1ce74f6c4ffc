"""What every Triton GEMM tile of the engine shares (kernels/gemm.py's and gemm_tma.py's tiles, kernels/symmetric.py's):
the order of the tiles over the output, the K loop over pointers, and the MLP's activation for the epilogues.

dot_loop: one (BM, BN) tile's fp32 sum of a @ b over K in steps of BK: a's rows and b's columns at the given offsets
(each masked at M and N), their K columns and rows masked at K. b meets a's dtype (fp32 logits with bf16 weights);
fp32 operands multiply in IEEE fp32 (no tf32 rounding). The sums run in one fixed order, the K steps in turn.
"""

import triton
import triton.language as tl

from microgpt.kernels import gelu, relu2


@triton.jit
def tile_of(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row, column) block of tile number `tile` of an (M, N) output: tiles ordered in groups of GROUP_M block
    rows, column by column within a group, so that the programs running at once share their rows of a and columns
    of b in L2."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % group) % gsize, (tile % group) // gsize


@triton.jit
def dot_loop(
    a_ptr,
    b_ptr,
    offs_m,
    offs_n,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
):
    # a: rows offs_m of an (M, K) matrix at a_ptr, b: columns offs_n of a (K, N) one at b_ptr, any strides -> acc
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * sam + offs_k[None, :].to(tl.int64) * sak
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * sbk + offs_n[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] + k < K), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] + k < K) & (offs_n[None, :] < N), other=0.0)
        b = b.to(a.dtype)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK * sak
        b_ptrs += BK * sbk
    return acc


@triton.jit
def act_of(h, ACT: tl.constexpr):
    # the MLP's activation of fp32 h, by name (gemm.ACTIVATIONS)
    if ACT == "gelu":
        y = gelu.gelu(h)
    else:
        y = relu2.relu2(h)
    return y


@triton.jit
def act_grad(v, ACT: tl.constexpr):
    # its derivative in fp32, from v as stored (its dtype): GELU's from h, ReLU^2's from its output a (2 sqrt(a):
    # ops/linear.FROM_OUTPUT), what the MLP keeps for it
    if ACT == "gelu":
        y = gelu.gelu_grad(v.to(tl.float32))
    else:
        y = relu2.relu2_grad(v)
    return y
