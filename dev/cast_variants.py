"""Experiment: why k_cast moves ~400 G elements/s where a copy-like pass should move ~1,000. Variants of the cast
(COPY and GELU ops, rows + transposed E4M3 stores, ANDREA-120M shapes at micro-batch 32), each timed over tiles:
    base     kernels/fp8.k_cast as shipped
    norec    no amax reduction / atomic
    trans    the transposed store through tl.trans (a [BC, BR] tile, contiguous along r)
    flat     the amax reduced over the flattened tile
    norows   only the transposed store;  notrans: only the rows store
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt.kernels import fp8  # noqa: E402
from microgpt.kernels.fp8 import _e4m3_bits, _scale  # noqa: E402
from microgpt.kernels.gelu import gelu  # noqa: E402


@triton.jit
def k_var(
    x_ptr,
    rows_ptr,
    t_ptr,
    slot_ptr,
    R,
    Cc,
    OP: tl.constexpr,
    REC: tl.constexpr,
    TRANS_T: tl.constexpr,
    FLAT: tl.constexpr,
    ROWS: tl.constexpr,
    TRANS: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    PACK: tl.constexpr = False,
):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    r = pid_r * BR + tl.arange(0, BR)
    c = pid_c * BC + tl.arange(0, BC)
    mask = (r[:, None] < R) & (c[None, :] < Cc)
    r64, c64 = r.to(tl.int64), c.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * Cc + c64[None, :], mask=mask, other=0.0).to(tl.float32)
    if OP == 1:
        y = gelu(x)
    else:
        y = x
    amax = tl.maximum(tl.load(slot_ptr + 1), tl.max(tl.load(slot_ptr + 4 + tl.arange(0, 16)), axis=0))
    s, inv = _scale(amax)
    if REC:
        ay = tl.abs(y)
        fin = tl.where(mask & (ay <= 3.4028234663852886e38), ay, 0.0)
        if FLAT:
            m = tl.max(tl.reshape(fin, [BR * BC]), axis=0)
        else:
            m = tl.max(tl.max(fin, axis=1), axis=0)
        tl.atomic_max(slot_ptr + 2, m)
    q = _e4m3_bits(y * s)
    if ROWS:
        tl.store(rows_ptr + r64[:, None] * Cc + c64[None, :], q, mask=mask)
    if TRANS and PACK:  # 4 consecutive r of a column packed into one 32-bit word, stored as words
        q4 = tl.reshape(q.to(tl.uint32), [BR // 4, 4, BC])
        shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
        words = tl.sum(q4 << shifts[None, :, None], axis=1)
        i = pid_r * (BR // 4) + tl.arange(0, BR // 4)
        t32 = t_ptr.to(tl.pointer_type(tl.uint32))
        wmask = (i[:, None] < R // 4) & (c[None, :] < Cc)
        if TRANS_T:
            tl.store(t32 + c64[:, None] * (R // 4) + i.to(tl.int64)[None, :], tl.trans(words), mask=tl.trans(wmask))
        else:
            tl.store(t32 + c64[None, :] * (R // 4) + i.to(tl.int64)[:, None], words, mask=wmask)
    elif TRANS:
        if TRANS_T:
            tl.store(t_ptr + c64[:, None] * R + r64[None, :], tl.trans(q), mask=tl.trans(mask))
        else:
            tl.store(t_ptr + c64[None, :] * R + r64[:, None], q, mask=mask)


def main() -> None:
    N, C = 32 * 1024, 768
    variants = {"base": None, "norec": dict(REC=False), "trans": dict(TRANS_T=True), "flat": dict(FLAT=True),
                "trans+flat": dict(TRANS_T=True, FLAT=True), "norows": dict(ROWS=False),
                "notrans": dict(TRANS=False), "norec+trans": dict(REC=False, TRANS_T=True), "pack": dict(PACK=True),
                "pack+trans": dict(PACK=True, TRANS_T=True), "pack+flat": dict(PACK=True, FLAT=True)}  # fmt: skip
    tiles = [(64, 64, 4), (32, 128, 4), (128, 64, 8), (64, 128, 8), (128, 128, 8), (16, 256, 4)]
    for what, H, op in (("copy C", C, 0), ("gelu 4C", 4 * C, 1)):
        x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
        rows = torch.empty(N, H, device="cuda", dtype=torch.uint8)
        trans = torch.empty(H, N, device="cuda", dtype=torch.uint8)
        slot = torch.zeros(20, device="cuda")
        slot[4] = 3.0
        for name, kw in variants.items():
            best = (1e9, None)
            for br, bc, w in tiles:
                grid = (triton.cdiv(N, br), triton.cdiv(H, bc))
                if kw is None:
                    x3 = x.unsqueeze(0)

                    def run() -> None:
                        fp8.k_cast[grid + (1,)](x3, x3, rows, trans, slot, N, H, *x3.stride(), OP=op, AMAX_ONLY=False,
                                                HIST=16, ROWS=True, TRANS=True, BR=br, BC=bc, PACK=1, HW=False,
                                                num_warps=w)  # fmt: skip
                else:
                    args = {**dict(REC=True, TRANS_T=False, FLAT=False, ROWS=True, TRANS=True), **kw}

                    def run() -> None:
                        k_var[grid](x, rows, trans, slot, N, H, OP=op, BR=br, BC=bc, num_warps=w, **args)

                try:
                    ms = triton.testing.do_bench(run, warmup=5, rep=30)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} {br}x{bc}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                best = min(best, (ms, f"{br}x{bc}x{w}"))
            print(f"{what:8s} {name:12s} {best[0] * 1e3:7.1f} us  {x.numel() / best[0] / 1e6:6.0f} G elem/s  {best[1]}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
