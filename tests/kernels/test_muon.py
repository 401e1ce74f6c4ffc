"""kernels/muon.py's step against ops/muon.py's on the same fp32 arrays: several steps in a row over groups of
wide, tall (the transposed writes and reads) and square matrices that straddle the kernels' tiles and blocks, among
parameters Muon does not own; the non-finite skip; the planned scratch. In the interpreter (CI) the Newton-Schulz
products A = X X^T and B = b A + c A A run on kernels/symmetric.py's tile, Y = a X + B X as a torch CPU GEMM; on the
GPU (MICROGPT_TEST_GPU=1) each runs the way the router's tuner gives it.

The GPU test at the modern ANDREA-120M shapes (bf16 Newton-Schulz against the NumPy step, bit-for-bit repeats,
the step captured in a CUDA graph, no allocation), once per way the tuner may settle on (cuBLASLt's first
algorithm, the symmetric tile, and whatever a warm-up times fastest), runs on the GPU machine:
    MICROGPT_TEST_GPU=1 python3 -m pytest -m gpu tests/kernels/test_muon.py
"""

import math

import numpy as np
import pytest
import torch

from microgpt.kernels import muon as km
from microgpt.kernels.gemm import PROBE_ROWS, Gemm
from microgpt.kernels.tuning import Tuner
from microgpt.ops import muon as ref
from microgpt.ops.muon import MuonGroup, muon_groups

from ._kutil import DEVICE, GEMM, ON_GPU, check, h, t

F32 = torch.float32
KIND = {"f32": torch.float32, "i32": torch.int32}
# (shape, owned by Muon): tiles of 64 x 64 and momentum blocks of 4096 elements cut every owned shape somewhere
LAYOUT = [((9, 5), False), ((70, 30), True), ((20, 130), True), ((11,), False), ((65, 65), True), ((70, 30), True),
          ((20, 130), True), ((65, 65), True), ((7, 9), False)]  # fmt: skip
LRS, MUS = [0.02, 0.05, 0.04], [0.85, 0.9, 0.95]
GRAD_SIZES = [0.05, 4.0, 0.3]  # the mean gradient's norm: unclipped, clipped, unclipped (max_norm 1)
WD, MAX_NORM, GSCALE = 0.1, 1.0, 0.25


def dev(x: np.ndarray, dtype: torch.dtype = F32) -> torch.Tensor:
    """A device copy of x in dtype that never shares x's memory (t() may, on the CPU)."""
    return t(x.copy(), dtype)


def layout() -> tuple[int, tuple[MuonGroup, ...], np.ndarray]:
    """(n, the groups, the owned mask) of LAYOUT."""
    sizes = [math.prod(s) for s, _ in LAYOUT]
    offs = np.cumsum([0] + sizes)[:-1]
    grps = muon_groups((int(o), *s) for o, (s, own) in zip(offs, LAYOUT) if own)
    own = np.concatenate([np.full(n, o) for n, (_, o) in zip(sizes, LAYOUT)])
    return sum(sizes), grps, own


def gpu_scratch(grps: tuple[MuonGroup, ...], compute: torch.dtype, rng: np.random.Generator) -> dict:
    """kernels/muon.py's planned buffers: noise where the step writes before it reads, the offsets filled."""
    out = {}
    for s in km.muon_scratch(grps):
        if s.fill is not None:
            out[s.keyword] = torch.tensor(s.fill, dtype=KIND[s.kind], device=DEVICE)
        else:
            out[s.keyword] = t(rng.standard_normal(s.numel), KIND.get(s.kind, compute))
    return out


def ref_scratch(grps: tuple[MuonGroup, ...]) -> dict:
    return {s.keyword: np.zeros(s.numel, np.float32) for s in ref.muon_scratch(grps)}


def hyper(lr: float, mu: float, gscale: float = GSCALE) -> np.ndarray:
    return np.array([lr, mu, gscale, WD], np.float32)


def run_both(
    compute: torch.dtype, steps: int = len(LRS), ns_steps: int = ref.NS_STEPS, kernels: bool = True
) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    """The same steps on both sides from the same fp32 state, ns_steps Newton-Schulz steps each (train.muon_ns_steps);
    returns each side's (p, m, g, pc) and p0, own (kernels False: the NumPy side alone, the kernels' dict empty)."""
    rng = np.random.default_rng(46)
    n, grps, own = layout()
    p0 = (rng.standard_normal(n) * 0.05).astype(np.float32)
    rp, rm, rpc = p0.copy(), np.zeros(n, np.float32), np.full(n, 7.0, np.float32)
    gp, gm, gpc = dev(p0), torch.zeros(n, dtype=F32, device=DEVICE), torch.full((n,), 7.0, dtype=compute, device=DEVICE)
    scratch, rscratch = gpu_scratch(grps, compute, rng), ref_scratch(grps)
    for lr, mu, size in list(zip(LRS, MUS, GRAD_SIZES))[:steps]:
        raw = (rng.standard_normal(n) * size / math.sqrt(n) / GSCALE).astype(np.float32)
        norm = np.array([np.linalg.norm(raw.astype(np.float64))], np.float32)
        rg, gg = raw.copy(), dev(raw)
        hy = hyper(lr, mu)
        ref.muon_step(rp, rg, rm, rpc, hy, norm, groups=grps, max_norm=MAX_NORM, ns_steps=ns_steps, **rscratch)
        if kernels:
            km.muon_step(
                gp,
                gg,
                gm,
                gpc,
                dev(hy),
                dev(norm),
                groups=grps,
                max_norm=MAX_NORM,
                gemm=GEMM,
                ns_steps=ns_steps,
                **scratch,
            )
    got = {"p": h(gp), "m": h(gm), "g": h(gg), "pc": h(gpc)} if kernels else {}
    want = {"p": rp.astype(np.float64), "m": rm.astype(np.float64), "g": rg.astype(np.float64), "pc": rpc}
    return got, want, p0.astype(np.float64), own


def test_muon_step_matches_numpy_fp32() -> None:
    """fp32 compute: the elementwise passes compute what the reference does in its order (m within fp32 rounding);
    the Newton-Schulz products differ from NumPy's only in their fp32 summation order, about 1e-6 relative after
    five steps (the quintic neither damps nor grows errors much: |p'(s)| is about 1 on its band), so the update
    p - p0 is held to 2e-5 relative (as the other fp32 kernels) and the owned gradients must be zero."""
    got, want, p0, own = run_both(F32)
    check("m", got["m"], want["m"], 1e-6)
    check("update p - p0 (owned)", got["p"][own] - p0[own], want["p"][own] - p0[own], 2e-5)
    np.testing.assert_array_equal(got["p"][~own], p0[~own])  # AdamW's parameters untouched
    assert not got["m"][~own].any()
    assert not got["g"][own].any()
    np.testing.assert_array_equal(got["g"][~own], want["g"][~own])  # AdamW's gradients left for it
    np.testing.assert_array_equal(got["pc"][own], got["p"][own])  # the compute copy: p, in the same pass
    assert (got["pc"][~own] == 7.0).all()


def test_muon_step_matches_numpy_at_three_ns_steps() -> None:
    """train.muon_ns_steps 3 reaches both sides: one step's update against the NumPy step's at 3 (fp32, as above),
    which lies far from NumPy's at the default 5 (the singular values not yet in their band)."""
    got, want, p0, own = run_both(F32, steps=1, ns_steps=3)
    _, five, _, _ = run_both(F32, steps=1, kernels=False)
    check("update p - p0 (owned)", got["p"][own] - p0[own], want["p"][own] - p0[own], 2e-5)
    np.testing.assert_array_equal(got["pc"][own], got["p"][own])
    off = np.abs((five["p"] - want["p"])[own]).max() / np.abs((want["p"] - p0)[own]).max()
    assert off > 1e-2, f"3 and 5 Newton-Schulz steps should differ, max relative {off:.2e}"


def test_muon_step_fp16_compute() -> None:
    """fp16 compute (the interpreter's stand-in for bf16): X rounded to fp16 before each product, whose output
    is rounded again; bf16's 1e-2 relative error measured on the CPU becomes about 1.5e-3 with fp16's three more
    bits, held to 1e-2. The compute copy is the fp32 master rounded once."""
    got, want, p0, own = run_both(torch.float16)
    check("update p - p0 (owned)", got["p"][own] - p0[own], want["p"][own] - p0[own], 1e-2)
    check("m", got["m"], want["m"], 1e-6)
    rounded = torch.tensor(got["p"][own], dtype=F32).to(torch.float16).double().numpy()
    np.testing.assert_array_equal(got["pc"][own], rounded)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's inf * 0 in the skipped lanes
@pytest.mark.parametrize("norm,gscale", [(math.inf, GSCALE), (math.nan, GSCALE), (2.0, math.inf)])
def test_non_finite_norm_skips(norm: float, gscale: float) -> None:
    """p, m and the compute copy untouched, the owned gradients zeroed, AdamW's left."""
    rng = np.random.default_rng(47)
    n, grps, own = layout()
    p, m, g = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    gp, gm, gpc, gg = dev(p), dev(m), dev(p), dev(g)
    km.muon_step(
        gp,
        gg,
        gm,
        gpc,
        dev(hyper(0.02, 0.95, gscale)),
        dev(np.array([norm])),
        groups=grps,
        max_norm=MAX_NORM,
        gemm=GEMM,
        **gpu_scratch(grps, F32, rng),
    )
    for name, a, b in (("p", gp, p), ("m", gm, m), ("p_compute", gpc, p)):
        np.testing.assert_array_equal(h(a), b, err_msg=name)
    assert not h(gg)[own].any()
    np.testing.assert_array_equal(h(gg)[~own], g[~own])


def test_scratch_is_the_reference_s_plus_partials_and_offsets() -> None:
    _, grps, _ = layout()
    bufs = {s.keyword: s for s in km.muon_scratch(grps)}
    assert [s.keyword for s in ref.muon_scratch(grps)] == ["x", "y", "gram", "poly"]
    assert all(bufs[s.keyword] == s for s in ref.muon_scratch(grps))
    assert [(g.rows, g.cols) for g in grps] == [(70, 30), (20, 130), (65, 65)]
    assert bufs["partials"].numel == 2 * 2 and bufs["partials"].kind == "f32"  # 65 * 65 = 4225: two blocks
    assert bufs["offsets"].fill == sum((g.offsets for g in grps), ()) and bufs["offsets"].kind == "i32"


# --- on the GPU: the modern ANDREA-120M's matrices ------------------------------------------------------------
C, L = 768, 12


def modern_layout() -> tuple[int, tuple[MuonGroup, ...], np.ndarray]:
    """A flat array as the modern block lays it out: a stand-in for wte, per layer w_q, w_k, w_v, w_o (C, C),
    w_1 (C, 4C), w_2 (4C, C), a stand-in for lm_head. Groups: 48 of (768, 768), 12 of (768, 3072) and 12 of
    (3072, 768) (24 of working shape (768, 3072))."""
    head, tail = 5000, 3001
    shapes = [(C, C)] * 4 + [(C, 4 * C), (4 * C, C)]
    mats, off = [], head
    for _ in range(L):
        for s in shapes:
            mats.append((off, *s))
            off += math.prod(s)
    n = off + tail
    own = np.zeros(n, bool)
    own[head:off] = True
    return n, muon_groups(mats), own


@pytest.fixture(scope="module")
def modern_reference() -> dict:
    """The NumPy step twice at the modern shapes (computed once for every way the GPU test runs)."""
    rng = np.random.default_rng(120)
    n, grps, own = modern_layout()
    p0 = (rng.standard_normal(n) / math.sqrt(C)).astype(np.float32)
    raws = [(rng.standard_normal(n) * s / math.sqrt(n) / GSCALE).astype(np.float32) for s in (4.0, 0.3)]
    hypers = [hyper(0.02, 0.9), hyper(0.03, 0.95)]
    norms = [np.array([np.linalg.norm(r.astype(np.float64))], np.float32) for r in raws]
    rp, rm = p0.copy(), np.zeros(n, np.float32)
    rscratch = ref_scratch(grps)
    for raw, hy, norm in zip(raws, hypers, norms):
        ref.muon_step(rp, raw.copy(), rm, None, hy, norm, groups=grps, max_norm=MAX_NORM, **rscratch)
    return dict(n=n, grps=grps, own=own, p0=p0, raws=raws, hypers=hypers, norms=norms, rp=rp, rm=rm)


WAYS = {"default": None, "cublaslt": "lt0", "symmetric": "sym", "tuned": None}  # way -> MICROGPT_GEMM


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs CUDA")
@pytest.mark.parametrize("way", list(WAYS))
def test_muon_step_gpu_modern_120m(way: str, modern_reference: dict, tmp_path, monkeypatch) -> None:
    """bf16 Newton-Schulz on the GPU against the fp32 NumPy step, two steps: the update p - p0 within 3e-2
    relative (bf16 rounds X and every product's output: 7.5e-3 measured with CPU bf16 GEMMs at these shapes and
    one layer, 4x room for the GEMMs' own accumulation order), m within 1e-5 (fp32 elementwise; the GPU may fuse
    multiply-adds), the compute copy the fp32 master rounded to bf16, AdamW's parameters untouched. Then the same two
    steps again, eagerly and as a replayed CUDA graph, from the same state: bit for bit the same, with nothing
    allocated. Per way of the Newton-Schulz products: "default" the machine's router (its recorded choices, else
    cuBLASLt's first algorithm), "cublaslt" and "symmetric" forced (MICROGPT_GEMM: the symmetric tile for A and B,
    Y on cuBLASLt's first), "tuned" a fresh tuner's warm-up, timed over one step first."""
    R = modern_reference
    n, grps, own, p0 = R["n"], R["grps"], R["own"], R["p0"]
    gemm = GEMM
    if way != "default":
        monkeypatch.setenv("MICROGPT_CACHE", str(tmp_path))
        if WAYS[way]:
            monkeypatch.setenv("MICROGPT_GEMM", WAYS[way])
        gemm = Gemm(Tuner("test-muon"), GEMM.lt)
        gemm.tuner.set_probe(torch.zeros(2 * PROBE_ROWS * 4 * C, device="cuda"))
    scratch = gpu_scratch(grps, torch.bfloat16, np.random.default_rng(121))
    inputs = [[dev(x) for x in xs] for xs in (R["raws"], R["hypers"], R["norms"])]
    start = dev(p0)
    p, m, g = start.clone(), torch.zeros(n, dtype=F32, device="cuda"), torch.zeros(n, dtype=F32, device="cuda")
    pc = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    hy, nm = torch.empty(4, dtype=F32, device="cuda"), torch.empty(1, dtype=F32, device="cuda")
    mine = torch.from_numpy(own).cuda()

    def two_steps() -> None:
        for raw, hyp, norm in zip(*inputs):
            g.copy_(raw)
            hy.copy_(hyp)
            nm.copy_(norm)
            km.muon_step(p, g, m, pc, hy, nm, groups=grps, max_norm=MAX_NORM, gemm=gemm, **scratch)

    def from_start(run) -> list[torch.Tensor]:
        p.copy_(start)
        m.zero_()
        pc.zero_()
        run()
        torch.cuda.synchronize()
        return [x.clone() for x in (p, m, pc)]

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        if way == "tuned":
            with gemm.tuner.window():
                from_start(two_steps)  # every product's ways timed on real X, the fastest that agrees recorded
        first = from_start(two_steps)  # the first run on this stream: cuBLASLt's plans are made here
        got = h(first[0])
        check("update p - p0 (owned)", got[own] - p0[own], R["rp"][own].astype(np.float64) - p0[own], 3e-2)
        check("m", h(first[1]), R["rm"].astype(np.float64), 1e-5)
        np.testing.assert_array_equal(got[~own], p0[~own])
        assert torch.equal(first[2][mine], first[0][mine].bfloat16()), "the compute copy is the master, rounded"
        assert not h(g)[own].any()
        before = torch.cuda.memory_allocated()
        two_steps()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before, "the step allocated"
        again = from_start(two_steps)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            two_steps()
        replayed = from_start(graph.replay)
    chosen = {k: w for k, w in gemm.choices().items() if k.startswith("addmm")}
    print(way, chosen)
    if way != "default":  # per working shape (the wide and the tall groups share theirs): A and B symmetric, Y not
        assert sorted(k.split(":")[0] for k in chosen) == ["addmm"] * 2 + ["addmm_sym"] * 4, chosen
    if WAYS[way]:
        assert {w for k, w in chosen.items() if k.startswith("addmm_sym:")} == {WAYS[way]}
    for name, a, b, c in zip(("p", "m", "p_compute"), first, again, replayed):
        differ = {k: int((x != y).sum()) for k, x, y in (("first/again", a, b), ("again/replay", b, c))}
        assert torch.equal(a, b), f"{name}: a second eager run differs: elements differing {differ} of {a.numel()}"
        assert torch.equal(a, c), f"{name}: the CUDA graph's replay differs: elements differing {differ}"
