"""The FP8 casts alone at ANDREA-120M's shapes (micro-batch B): each k_cast variant a step launches, timed for
every launch configuration (kernels/fp8_cast.py CAST_CONFIGS plus any given as BRxBCxWARPSxPACK), as ms and GB/s of
the bytes it must move (reads of x and x2, one E4M3 byte per layout written).

    python3 dev/cast_bench.py [B] [BRxBCxWxP ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt.fp8 import OSLOT  # noqa: E402
from microgpt.kernels import fp8_cast, tuning  # noqa: E402


def main() -> None:
    args = sys.argv[1:]
    B = int(args[0]) if args and "x" not in args[0] else 32
    extra = {a: tuple(int(v) for v in a.split("x")) for a in args if "x" in a}
    configs = {**fp8_cast.CAST_CONFIGS, **extra}
    N, C = B * 1024, 768
    dev = "cuda"
    cases = [  # (what, x shape, op, with x2, per layer a step)
        ("x of a site (C)", (N, C), fp8_cast.COPY, False, 3),
        ("gelu(h) (4C)", (N, 4 * C), fp8_cast.GELU, False, 1),
        ("dout of QKV (3 x C)", (3, N, C), fp8_cast.COPY, False, 1),
        ("dout (C)", (N, C), fp8_cast.COPY, False, 2),
        ("da * gelu'(h) (4C)", (N, 4 * C), fp8_cast.GELU_GRAD, True, 1),
    ]
    total_best = 0.0
    for what, shape, op, with2, per_layer in cases:
        x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        x2 = torch.randn(shape, device=dev, dtype=torch.bfloat16) if with2 else None
        G, R, Cc = (1, *shape) if len(shape) == 2 else shape
        rows = torch.empty(R, G * Cc, device=dev, dtype=torch.float8_e4m3fn)
        trans = torch.empty(G, Cc, R, device=dev, dtype=torch.float8_e4m3fn)
        slot = torch.zeros(OSLOT, device=dev)
        slot[4] = 3.0
        nbytes = x.numel() * (2 + (2 if with2 else 0) + 2)
        res = {}
        for name, cfg in configs.items():  # fp8_cast.cast itself, offered one configuration at a time
            fp8_cast.CAST_CONFIGS = {name: cfg}
            tuner = tuning.Tuner()  # its own: no launch choice remembered from another configuration
            res[name] = triton.testing.do_bench(
                lambda: fp8_cast.cast(tuner, x, slot, rows, trans, op=op, x2=x2), warmup=10, rep=50
            )
        best = min(res, key=res.get)
        total_best += res[best] * per_layer * 12
        cells = "  ".join(f"{k} {v * 1e3:6.1f}us" for k, v in sorted(res.items(), key=lambda kv: kv[1])[:5])
        print(f"{what:22s} best {best:9s} {res[best] * 1e3:7.1f} us  {nbytes / res[best] / 1e6:6.0f} GB/s | {cells}")
    print(f"all casts of a step at the best configurations: {total_best:.2f} ms (12 layers)")


if __name__ == "__main__":
    main()
