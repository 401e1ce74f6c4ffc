"""The most issue 36's two untried FP8 levers could take off an fp8 step, timed on the GPU without regard to loss:
attention in E4M3 and the LM head's two gradient GEMMs in 8 bits.

    python3 dev/levers_ceiling.py [MB ...]      # ANDREA-120M's shape; micro-batches default to 32 8

What it times (each call captured in a CUDA graph, dev/timing.py; every tile config of the engine's lists, the best):

- attention forward: the engine's kernel on bf16 q, k, v against this script's E4M3 twin (q, k in rows, V
  transposed, as a cast writes them; P rounded to E4M3 at 448 times its value, undone at the end; q, k, v cast
  without scaling: a scaled cast would fold its scales into the exponent's multiplier, the same instructions),
  plus the casts of q, k (rows) and v (transposed) it would need;
- attention backward: the engine's kernel on bf16 inputs against the same kernel on E4M3 q, k, v and dout (P and
  dS rounded to E4M3 on the way into their products); where Triton cannot build it, the reason;
- the head's gradient GEMMs for one logits chunk (the plan's 4,096 rows): dx += dz @ wte and dwte += dz.T @ x in
  bf16 against torch._scaled_mm on an E5M2 dz and E4M3 wte and x, plus the cast of dz (bf16) to both E4M3 layouts
  that k_cast would make (the engine's E4M3 cast: the same bytes as E5M2).

It prints the per-step totals (12 layers, N/4,096 chunks) of each and what each lever would save, against the gap
to issue 36's 1.3x at micro-batch 32 and 1.15x at 8 (from the bench of record's step times: bench/RESULTS.md). The
savings are ceilings in one sense only: the E4M3 forward's output is compared with bf16's (a relative error, as a
sanity check of the twin), not trained with; the E4M3 backward is the bf16 kernel's layouts in 8 bits, so Triton
stages the operands that are not K-major through shared memory, and a backward designed for E4M3 (transposed
copies written by the casts) could be faster than it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import captured  # noqa: E402

from microgpt.fp8 import OSLOT  # noqa: E402
from microgpt.kernels import attention, fp8_cast, tuning  # noqa: E402

T, NH, HS, V, CHUNK, LAYERS = 1024, 12, 64, 50304, 4096, 12
C = NH * HS
E4M3 = torch.float8_e4m3fn
# the bench of record's step times (bench/RESULTS.md, sixteenth session), ms: (bf16, fp8)
STEP_MS = {32: (54.9, 47.4), 8: (15.5, 14.0)}
TARGET = {32: 1.3, 8: 1.15}  # issue 36: fp8 tokens/s over bf16's


@triton.jit
def _fwd8_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_ptr,
    vt_ptr,
    kbase,
    vbase,
    N,
    offs_m,
    lo,
    hi,
    C,
    qk_scale,
    MASK: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    offs_d = tl.arange(0, BD)
    for start_n in range(lo, hi, BN):
        cols = start_n + tl.arange(0, BN)
        kt = tl.load(k_ptr + kbase + cols[None, :] * C + offs_d[:, None])  # (BD, BN): d contiguous, K-major
        s = tl.dot(q, kt)
        if MASK:
            s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vt_ptr + vbase + offs_d[None, :].to(tl.int64) * N + cols[:, None])  # (BN, BD) from V^T: K-major
        acc = acc * alpha[:, None] + tl.dot((p * 448.0).to(tl.float8e4nv), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def k_attention_fwd8(
    out_ptr, lse_ptr, q_ptr, k_ptr, vt_ptr, T, C, NH, N, qk_scale, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr
):
    # q, k: (B, T, C) E4M3 rows; vt: (C, N = B*T) E4M3, V transposed; out (B, T, C) bf16; lse (B, NH, T) fp32.
    # T a multiple of BM and BN, HS = BD: a timing twin of k_attention_fwd, no edge masks.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // NH, bh % NH
    base = b.to(tl.int64) * T * C + h * BD
    vbase = (h * BD).to(tl.int64) * N + b * T
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    q = tl.load(q_ptr + base + offs_m[:, None] * C + offs_d[None, :])
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    diag = pid_m * BM
    acc, l_i, m_i = _fwd8_tiles(
        acc, l_i, m_i, q, k_ptr, vt_ptr, base, vbase, N, offs_m, 0, diag, C, qk_scale, False, BN, BD
    )
    acc, l_i, m_i = _fwd8_tiles(
        acc, l_i, m_i, q, k_ptr, vt_ptr, base, vbase, N, offs_m, diag, diag + BM, C, qk_scale, True, BN, BD
    )
    out = acc / (448.0 * l_i[:, None])
    tl.store(out_ptr + base + offs_m[:, None] * C + offs_d[None, :], out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + bh.to(tl.int64) * T + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)


def _attempt(fn) -> tuple[float, str | None]:
    """(captured(fn)'s us, None), or (NaN, why) where Triton or torch cannot build or run it here."""
    try:
        return captured(fn)[1], None
    except Exception as e:  # noqa: BLE001 - a config, dtype or layout this GPU or library refuses
        return math.nan, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def best(name: str, configs: list[dict], make) -> tuple[float, str]:
    """The fastest of make(config)'s calls in us, and its config; a config that cannot run is skipped (the first
    such reason is printed)."""
    times, why = {}, None
    for i, cfg in enumerate(configs):
        us, failed = _attempt(make(cfg))
        if failed is None:
            times[i] = us
        why = why or failed
    if not times:
        print(f"  {name}: no config ran ({why})")
        return math.nan, "-"
    i = min(times, key=times.get)
    if why:
        print(f"  {name}: {len(configs) - len(times)} of {len(configs)} configs failed ({why})")
    return times[i], str(i)


def timed(name: str, fn) -> float:
    """captured(fn)'s us, or NaN where it cannot run here (and why, printed)."""
    us, why = _attempt(fn)
    if why:
        print(f"  {name}: {why}")
    return us


def attention_rows(B: int) -> dict[str, float]:
    """us a layer: bf16 and E4M3 forward and backward, and the casts the E4M3 forward needs."""
    dev = dict(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, T, C, generator=g, **dev).to(torch.bfloat16) for _ in range(4))
    out, dq, dk, dv = (torch.empty(B, T, C, dtype=torch.bfloat16, **dev) for _ in range(4))
    lse, delta = (torch.empty(B, NH, T, dtype=torch.float32, **dev) for _ in range(2))
    q8, k8, do8 = (x.to(E4M3) for x in (q, k, dout))
    N = B * T
    vt8 = v.view(N, C).t().contiguous().to(E4M3)
    v8 = v.to(E4M3)
    qk_scale = attention.LOG2E / math.sqrt(HS)
    grid = lambda cfg: (T // cfg["BM"], B * NH)  # noqa: E731

    def fwd16(cfg: dict):
        return lambda: attention.k_attention_fwd[grid(cfg)](
            out, lse, q, k, v, T, C, NH, HS, qk_scale, BD=HS, IEEE=False, **cfg
        )

    def fwd8(cfg: dict):
        return lambda: k_attention_fwd8[grid(cfg)](out, lse, q8, k8, vt8, T, C, NH, N, qk_scale, BD=HS, **cfg)

    r = {}
    r["fwd bf16"], c1 = best("fwd bf16", attention.FWD_CONFIGS, fwd16)
    r["fwd e4m3"], c2 = best("fwd e4m3", attention.FWD_CONFIGS, fwd8)
    fwd16(attention.FWD_CONFIGS[0])()  # the twin's sanity: the E4M3 forward's output against bf16's
    ref = out.float()
    fwd8(attention.FWD_CONFIGS[0])()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"  E4M3 forward against bf16's output: relative error {err:.4f} (q, k, v cast without scaling)")

    # the casts an E4M3 forward adds where bf16 has none: q, k (rows; the QKV GEMM's bf16 output) and v (transposed)
    tuner = tuning.Tuner()
    slot = torch.zeros(2, OSLOT, dtype=torch.float32, **dev)
    qk = torch.stack([q.view(N, C), k.view(N, C)])  # (2, N, C) as the QKV site's output holds them
    qk8 = torch.empty(N, 2 * C, dtype=E4M3, **dev)

    def casts() -> None:  # v into the layout the twin reads (vt8: the same bytes, unscaled)
        fp8_cast.cast(tuner, qk, slot[0], qk8, None)
        fp8_cast.cast(tuner, v.view(N, C), slot[1], None, vt8.view(1, C, N))

    with tuner.window():  # the casts' launch configs, timed as in the engine's warm-up
        casts()
    r["fwd casts"] = timed("fwd casts", casts)

    bgrid = lambda cfg: (T // cfg["BN1"] + T // cfg["BM2"], B * NH)  # noqa: E731
    attention.k_attention_bwd_delta[(T // 64, B * NH)](delta, out, dout, T, C, NH, HS, BM=64, BD=HS)

    def bwd(ins: tuple[torch.Tensor, ...]):
        scales = (T, C, NH, HS, qk_scale, 1 / math.sqrt(HS))
        return lambda cfg: (
            lambda: attention.k_attention_bwd[bgrid(cfg)](
                dq, dk, dv, *ins, lse, delta, *scales, BD=HS, IEEE=False, **cfg
            )
        )

    r["bwd bf16"], c3 = best("bwd bf16", attention.BWD_CONFIGS, bwd((q, k, v, dout)))
    r["bwd e4m3"], c4 = best("bwd e4m3", attention.BWD_CONFIGS, bwd((q8, k8, v8, do8)))
    print(f"  configs: fwd bf16 {c1}, fwd e4m3 {c2}, bwd bf16 {c3}, bwd e4m3 {c4}")
    return r


def head_rows() -> dict[str, float]:
    """us for one logits chunk: the two gradient GEMMs in bf16 and in 8 bits, and the cast of dz to both layouts."""
    dev = dict(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    dz = (torch.randn(CHUNK, V, generator=g, **dev) * 1e-3).to(torch.bfloat16)
    wte = (torch.randn(V, C, generator=g, **dev) * 0.02).to(torch.bfloat16)
    x = torch.randn(CHUNK, C, generator=g, **dev).to(torch.bfloat16)
    dx = torch.zeros(CHUNK, C, dtype=torch.bfloat16, **dev)
    dwte16 = torch.zeros(V, C, dtype=torch.bfloat16, **dev)
    r = {}

    def bf16() -> None:
        dx.addmm_(dz, wte)
        torch.mm(dz.t(), x, out=dwte16)  # the engine adds into fp32 in cuBLASLt's epilogue; the product's time

    r["head bf16"] = timed("head bf16", bf16)
    dz8 = dz.to(torch.float8_e5m2)  # rows (CHUNK, V)
    dzt8 = dz.t().contiguous().to(torch.float8_e5m2)  # (V, CHUNK)
    w8c = wte.t().contiguous().to(E4M3)  # (C, V): wte column-major
    xt8 = x.t().contiguous().to(E4M3)  # (C, CHUNK): x column-major
    one = torch.ones((), device="cuda")

    def e8() -> None:
        torch._scaled_mm(dz8, w8c.t(), one, one, out_dtype=torch.bfloat16)
        torch._scaled_mm(dzt8, xt8.t(), one, one, out_dtype=torch.float32)

    r["head 8-bit"] = timed("head 8-bit", e8)
    tuner = tuning.Tuner()
    slot = torch.zeros(OSLOT, dtype=torch.float32, **dev)
    rows8 = torch.empty(CHUNK, V, dtype=E4M3, **dev)
    trans8 = torch.empty(1, V, CHUNK, dtype=E4M3, **dev)

    def cast() -> None:
        fp8_cast.cast(tuner, dz, slot, rows8, trans8)

    with tuner.window():
        cast()
    r["head cast"] = timed("head cast", cast)
    return r


def main() -> None:
    mbs = [int(a) for a in sys.argv[1:]] or [32, 8]
    print(f"{torch.cuda.get_device_name()}, T {T}, {NH} heads of {HS}, vocabulary {V}, logits chunk {CHUNK} rows")
    head = head_rows()
    print("head, one chunk (us): " + ", ".join(f"{k} {v:.1f}" for k, v in head.items()))
    for B in mbs:
        att = attention_rows(B)
        print(f"attention, one layer at micro-batch {B} (us): " + ", ".join(f"{k} {v:.1f}" for k, v in att.items()))
        chunks = B * T // CHUNK
        head_free = chunks * (head["head bf16"] - head["head 8-bit"])
        save = {
            "attention forward in E4M3 (with its q, k, v casts)": LAYERS
            * (att["fwd bf16"] - att["fwd e4m3"] - att["fwd casts"]),
            "attention backward in E4M3": LAYERS * (att["bwd bf16"] - att["bwd e4m3"]),
            "head gradients in 8 bits (dz cast by k_cast)": head_free - chunks * head["head cast"],
            "head gradients in 8 bits (dz written in 8 bits, free)": head_free,
        }
        bf16_ms, fp8_ms = STEP_MS[B]
        need = fp8_ms - bf16_ms / TARGET[B]
        print(f"micro-batch {B}: fp8 step {fp8_ms} ms, bf16 {bf16_ms}; {TARGET[B]}x needs {need:.2f} ms off fp8's step")
        for name, us in save.items():
            print(f"  {name}: {us / 1e3:+.2f} ms a step saved")
        fwd, bwd, _, head_free = (0.0 if math.isnan(us) else max(0.0, us) for us in save.values())
        total = fwd + bwd + head_free  # a lever that loses is not taken
        ratio = bf16_ms / (fp8_ms - total / 1e3)
        print(f"  all of them, the head's cast free: {total / 1e3:.2f} ms -> fp8 at {ratio:.3f}x bf16")


if __name__ == "__main__":
    main()
