"""microgpt's attention kernels against PyTorch's SDPA backends (flash, cuDNN) at one layer's shape, on the GPU.

    python3 dev/attention_bench.py [B]      # T 1024, 12 heads of 64, bf16, causal; B defaults to 96

Prints milliseconds and TFLOP/s (causal FLOPs: forward 2 * 2*B*H*T*T*hs / 2, backward 2.5x that) for the
forward and the backward of each, and the tile configs the tuner chose (a tuning.Tuner of this GPU, reading and
writing the engine's cache: kernels/tuning.py). The backward of SDPA is timed as (forward + backward) - forward,
since autograd runs the forward first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt.kernels import attention, tuning  # noqa: E402


def main() -> None:
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    T, H, hs = 1024, 12, 64
    C = H * hs
    fwd_flops = 2 * 2 * B * H * T * T * hs / 2
    dev = dict(device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, T, C, **dev) for _ in range(4))
    out, dq, dk, dv = (torch.zeros(B, T, C, **dev) for _ in range(4))
    lse = torch.empty(B, H, T, device="cuda", dtype=torch.float32)
    delta = torch.empty_like(lse)
    tuner = tuning.Tuner()

    def ours_fwd() -> None:
        attention.attention_forward(out, lse, q, k, v, H, tuner=tuner)

    def ours_bwd() -> None:
        attention.attention_backward(dq, dk, dv, dout, q, k, v, out, lse, H, delta=delta, tuner=tuner)

    with tuner.window():  # the tile choices, timed here as in the engine's warm-up (or taken from the cache)
        ours_fwd()
        ours_bwd()
    rows = [("microgpt", do_bench(ours_fwd, rep=200), do_bench(ours_bwd, rep=200))]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(B, T, H, hs).transpose(1, 2)

    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        qh, kh, vh = (heads(x).detach().requires_grad_() for x in (q, k, v))
        doh = heads(dout)
        try:
            with sdpa_kernel(backend):

                def fwd() -> torch.Tensor:
                    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

                def fwd_bwd() -> None:
                    fwd().backward(doh)

                with torch.no_grad():
                    t_f = do_bench(fwd, rep=200)
                t_fb = do_bench(fwd_bwd, rep=200)
            rows.append((name, t_f, t_fb - t_f))
        except RuntimeError as e:
            rows.append((name, float("nan"), float("nan")))
            print(f"{name}: {str(e).splitlines()[0]}")
    print(f"B {B}, T {T}, {H} heads of {hs}, bf16, causal")
    print(f"{'impl':<12}{'fwd ms':>9}{'TFLOP/s':>9}{'bwd ms':>9}{'TFLOP/s':>9}")
    for name, tf, tb in rows:
        print(f"{name:<12}{tf:>9.3f}{fwd_flops / tf / 1e9:>9.0f}{tb:>9.3f}{2.5 * fwd_flops / tb / 1e9:>9.0f}")
    for half in ("fwd", "bwd"):
        print(f"attention_{half} choices (config index):", tuner.choices(f"attention_{half}"))
    # each candidate of the tuner's, forced through the launcher (MICROGPT_<TABLE>: no timing, no record), so the
    # kernels run with the arguments the engine passes
    for half, run, flops in (("bwd", ours_bwd, 2.5 * fwd_flops), ("fwd", ours_fwd, fwd_flops)):
        print(f"attention_{half} by config (the tuner's candidates{', without the delta kernel' * (half == 'bwd')}):")
        for i, cfg in enumerate(attention.configs(half, hs)[0]):
            os.environ[f"MICROGPT_ATTENTION_{half.upper()}"] = str(i)
            t = do_bench(run, rep=100)
            print(f"  {i} {cfg}: {t:.3f} ms, {flops / t / 1e9:.0f} TFLOP/s")
        del os.environ[f"MICROGPT_ATTENTION_{half.upper()}"]


if __name__ == "__main__":
    main()
