"""Does the GPU Muon step repeat to the bit, under each way the GEMM router may run Newton-Schulz's products (run on
the GPU machine):

    python3 dev/muon_repeat.py            # ANDREA-120M's modern groups, bf16 Newton-Schulz, one step, 4 runs a way

The ways (Gemm.addmm's, forced through MICROGPT_GEMM on a fresh router each): `torch`, torch's baddbmm, as a router
without cuBLASLt runs them; `lt0`, cuBLASLt under its heuristic's first algorithm (the default where nothing is
recorded); `sym`, kernels/symmetric.py's tile for A = X X^T and B = b A + c A A (Y = a X + B X as recorded, else
lt0); `tuned`, what the warm-up picks: one step inside the tuning window first (the device's tuning cache: choices
recorded there before are kept), its choices printed. Per way each run starts from the same p, m, g and the same
scratch contents (reset to one noise), then runs kernels/muon.py's muon_step once, recording each group's
Newton-Schulz input (the normalised X) and output. A line per run says how many elements differ from the first run:
the normalise kernels' X, the GEMMs' output, the final p. Then the three GEMMs of one Newton-Schulz step alone, four
times on one input, each way. A JSON line each.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt.kernels import muon as km  # noqa: E402
from microgpt.kernels.cublaslt import CublasLt  # noqa: E402
from microgpt.kernels.gemm import PROBE_ROWS, Gemm  # noqa: E402
from microgpt.kernels.tuning import Tuner  # noqa: E402
from microgpt.ops.muon import NS_COEFFS, muon_groups  # noqa: E402

C, L, BF16 = 768, 12, torch.bfloat16
WAYS = {"torch": "cublas", "lt0": "lt0", "sym": "sym", "tuned": None}  # way -> MICROGPT_GEMM (None: the warm-up's)


def layout() -> tuple[int, tuple]:
    shapes = [(C, C)] * 4 + [(C, 4 * C), (4 * C, C)]
    mats, off = [], 5000
    for _ in range(L):
        for s in shapes:
            mats.append((off, *s))
            off += math.prod(s)
    return off + 3001, muon_groups(mats)


def differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    return [int((x != y).sum()) for x, y in zip(a, b)]


def steps(way: str, gemm: Gemm, n: int, groups: tuple, noise: dict) -> None:
    torch.manual_seed(1)
    p0 = torch.randn(n, device="cuda") / C**0.5
    g0 = torch.randn(n, device="cuda") / n**0.5
    hyper = torch.tensor([0.02, 0.95, 1.0, 0.0], device="cuda")
    norm = g0.norm().reshape(1)
    if way == "tuned":  # the warm-up: every product's ways timed on this step's X, the fastest that agrees recorded
        gemm.tuner.set_probe(torch.zeros(2 * PROBE_ROWS * 4 * C, device="cuda"))
        scratch = {k: v.clone() for k, v in noise.items()}
        m, pc = torch.zeros(n, device="cuda"), torch.zeros(n, dtype=BF16, device="cuda")
        with gemm.tuner.window():
            km.muon_step(p0.clone(), g0.clone(), m, pc, hyper, norm, groups=groups, max_norm=1.0, gemm=gemm, **scratch)
    ns = km.newton_schulz
    runs = []
    for _ in range(4):
        scratch = {k: v.clone() for k, v in noise.items()}
        p, g, m = p0.clone(), g0.clone(), torch.zeros(n, device="cuda")
        pc = torch.zeros(n, dtype=BF16, device="cuda")
        seen: list[torch.Tensor] = []

        def recorded(x, y, gram, poly, n_steps, gemm):
            seen.append(x.clone())
            out = ns(x, y, gram, poly, n_steps, gemm)
            seen.append(out.clone())
            return out

        km.newton_schulz = recorded
        km.muon_step(p, g, m, pc, hyper, norm, groups=groups, max_norm=1.0, gemm=gemm, **scratch)
        torch.cuda.synchronize()
        km.newton_schulz = ns
        runs.append((seen, p.clone()))
    first_seen, first_p = runs[0]
    for i, (seen, p) in enumerate(runs[1:], 1):
        d = differ(first_seen, seen)
        print(json.dumps({"way": way, "run": i, "X_in": d[0::2], "ns_out": d[1::2], "p": int((p != first_p).sum())}))


def gemms_alone(way: str, gemm: Gemm) -> None:
    a, b, c = NS_COEFFS
    for shape in [(48, C, C), (24, C, 4 * C)]:
        x = (torch.randn(*shape, device="cuda") / 30).to(BF16)
        gram = torch.empty(shape[0], shape[1], shape[1], device="cuda", dtype=BF16)
        poly, y = torch.empty_like(gram), torch.empty_like(x)
        outs = []
        for _ in range(4):
            gemm.addmm(gram, gram, x, x.mT, 0.0, 1.0, symmetric=True)
            gemm.addmm(poly, gram, gram, gram, b, c, symmetric=True)
            gemm.addmm(y, x, poly, x, a, 1.0)
            torch.cuda.synchronize()
            outs.append([gram.clone(), poly.clone(), y.clone()])
        print(
            json.dumps(
                {"way": way, "gemms": list(shape), "differ (gram, poly, y)": [differ(outs[0], o) for o in outs[1:]]}
            )
        )


def main() -> None:
    torch.manual_seed(0)
    n, groups = layout()
    kinds = {"compute": BF16, "f32": torch.float32, "i32": torch.int32}
    noise = {}
    for s in km.muon_scratch(groups):
        if s.fill is not None:
            noise[s.keyword] = torch.tensor(s.fill, dtype=kinds[s.kind], device="cuda")
        else:
            noise[s.keyword] = torch.randn(s.numel, device="cuda").to(kinds.get(s.kind, BF16))
    lt = CublasLt.load()
    for way, forced in WAYS.items():
        gemm = Gemm(Tuner(), None if way == "torch" else lt)
        if forced:
            os.environ["MICROGPT_GEMM"] = forced
        steps(way, gemm, n, groups, noise)
        gemms_alone(way, gemm)
        os.environ.pop("MICROGPT_GEMM", None)
        print(json.dumps({"way": way, "chosen": {k: w for k, w in gemm.choices().items() if k.startswith("addmm")}}))


if __name__ == "__main__":
    main()
