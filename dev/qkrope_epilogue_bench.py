"""The modern block's attention backward with qkrope's backward in its epilogues, against attention then qkrope's pass.

    python3 dev/qkrope_epilogue_bench.py [MB ...]      # ANDREA-120M modern: T 1024, 6 heads of 128; default 32 8

Per micro-batch, compute dtype (bf16, fp16) and mask (causal; a window of 256 with documents), at one layer's shape:
- the two ways of kernels/attention.py attention_backward(..., qkrope=...), each forced (MICROGPT_ATTENTION_QKROPE)
  and run once inside a tuning window of its own (a cache in a temporary folder, MICROGPT_TUNING_LOG on: stderr has
  every tile configuration's time and the one chosen, "...:qkrope" the fused kernel's), then timed in a CUDA graph
  (dev/timing.py): "pass", k_attention_bwd then k_qkrope_bwd; "fused", k_attention_bwd with QKROPE;
- the parts: attention's backward without qkrope ("plain", the GPT-2 block's call) and qkrope's pass alone;
- the fused way's dq, dk against the pass way's (max abs difference: rounding only; dv must be equal);
- the warm-up's own choice between the ways, as the engine makes it (table attention_qkrope).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("MICROGPT_CACHE", tempfile.mkdtemp(prefix="qkrope-epilogue-"))
os.environ.setdefault("MICROGPT_TUNING_LOG", "1")
from dev.timing import captured  # noqa: E402
from microgpt.kernels import attention, qkrope  # noqa: E402
from microgpt.kernels.tuning import Tuner  # noqa: E402
from microgpt.ops.qkrope import rope_tables  # noqa: E402

T, H, D = 1024, 6, 128
WAY = "MICROGPT_ATTENTION_QKROPE"


def layer(mb: int, dtype: torch.dtype, bounded: bool) -> tuple[list, dict]:
    """One layer's backward arguments: q, k through qkrope's forward (rstd saved), attention's forward for out, lse."""
    C, kw = H * D, dict(device="cuda", dtype=dtype)
    q, k, v, dout = (torch.randn(mb, T, C, **kw) for _ in range(4))
    rstd = torch.empty(2, mb * T, H, device="cuda")
    rope = torch.from_numpy(rope_tables(T, D)).cuda()
    qkrope.qkrope_forward(q, k, rstd, rope, n_head=H)
    mask = {}
    if bounded:
        tokens = torch.randint(1, 100, (mb, T), device="cuda", dtype=torch.int32)
        tokens[:, ::300] = 0  # a document every 300 tokens
        ds = torch.empty(mb, T, device="cuda", dtype=torch.int32)
        attention.doc_starts(ds, tokens, 0)
        mask = {"window": torch.tensor([256], device="cuda", dtype=torch.int32), "doc_start": ds}
    out, lse = torch.empty(mb, T, C, **kw), torch.empty(mb, H, T, device="cuda")
    tuner = Tuner()
    with tuner.window():
        attention.attention_forward(out, lse, q, k, v, H, tuner=tuner, **mask)
    args = [dout, q, k, v, out, lse, H]
    return args, {**mask, "delta": torch.empty(mb * H * T, device="cuda"), "qkrope": (rstd, rope)}


def one_case(mb: int, dtype: torch.dtype, bounded: bool) -> str:
    """The line of results for one micro-batch, dtype and mask."""
    args, kw = layer(mb, dtype, bounded)
    plain = {n: x for n, x in kw.items() if n != "qkrope"}
    tuner = Tuner()
    grads = {way: [torch.empty_like(args[0]) for _ in range(3)] for way in ("pass", "fused", "plain")}

    def backward(way: str) -> None:
        attention.attention_backward(*grads[way], *args, tuner=tuner, **(plain if way == "plain" else kw))

    us = {}
    for way in ("pass", "fused", "plain"):
        if way != "plain":
            os.environ[WAY] = way
        with tuner.window():
            backward(way)
        us[way] = captured(lambda w=way: backward(w))[1]
        os.environ.pop(WAY, None)
    dq, dk = grads["pass"][:2]
    q, k = args[1], args[2]
    us["qkrope pass alone"] = captured(lambda: qkrope.qkrope_backward(dq, dk, q, k, *kw["qkrope"], n_head=H))[1]
    os.environ[WAY] = "pass"
    backward("pass")  # the pass way's outputs again (the pass alone rewrote them)
    os.environ.pop(WAY)
    diff = [(a.float() - b.float()).abs().max().item() for a, b in zip(grads["fused"], grads["pass"])]
    assert np.isfinite(diff).all() and diff[2] == 0.0, diff
    with tuner.window():  # the warm-up's own choice, as the engine's
        backward("fused")
    times = ", ".join(f"{n} {t:.1f} us" for n, t in us.items())
    what = "window 256 + documents" if bounded else "causal"
    return (
        f"mb {mb} {dtype} {what}: {times}; fused vs pass max abs dq {diff[0]:.2e} dk {diff[1]:.2e}; "
        f"chosen {tuner.choices('attention_qkrope')}"
    )


def main() -> None:
    mbs = [int(x) for x in sys.argv[1:]] or [32, 8]
    torch.manual_seed(0)
    for mb in mbs:
        for dtype in (torch.bfloat16, torch.float16):
            for bounded in (False, True):
                print(one_case(mb, dtype, bounded), flush=True)


if __name__ == "__main__":
    main()
