"""Every Triton kernel and tuning candidate compiled for sm_80, sm_86, sm_89 and sm_90 on the CPU (kernels/targets.py),
read against each target's limits.

The sweep runs in its own process without TRITON_INTERPRET (this folder's conftest sets it, and the interpreter replaces
every kernel by a function it runs on the CPU, which nothing can compile). CI compiles what has no alternative on a
device (targets.select): every fixed launch and every choice's default, on all four targets, and the TMA tiles
(gemm_tma.py) on sm_90, the one target that has them. The other candidates are left to the full sweep,
MICROGPT_SWEEP=full (about 8 minutes on a 2-core machine; its table is in bench/RESULTS.md), which also checks that
every candidate fits sm_90, so the H200's candidate lists are what they were. Where a candidate does not fit a device,
the tuner drops it there (tests/kernels/test_tuning.py). The table is printed (pytest -s shows it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from microgpt import config
from microgpt.kernels import attention
from tests.conftest import REPO

FULL = os.environ.get("MICROGPT_SWEEP") == "full"
LIMITS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # shared memory a block (opt-in maximum)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sweep") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "microgpt.kernels.check.targets", "--json", str(out), *([] if FULL else ["--ci"])]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    print(r.stdout)
    return json.loads(out.read_text())


def fits(usage: dict, cc: int) -> bool:
    return usage["shared"] <= LIMITS[cc] and usage["regs"] <= 255 and usage["regs"] * usage["threads"] <= 65536


def test_the_limits_are_the_architectures() -> None:
    from microgpt.kernels.check.targets import TARGETS

    assert {cc: t.shared for cc, t in TARGETS.items()} == LIMITS
    assert [cc for cc, t in TARGETS.items() if t.fp8] == [89, 90]


def test_the_shapes_are_the_recipes() -> None:
    from microgpt.kernels.check.catalogue import ANDREA, MODERN

    for shape in (*ANDREA, *MODERN):
        exp = config.load(REPO / "experiments" / f"{shape.name}-TRAIN.json")
        m, t = exp.model, exp.train
        assert (shape.B, shape.T, shape.C, shape.NH, shape.V, shape.L, shape.block) == (
            t.micro_batch,
            m.seq_len,
            m.d_model,
            m.n_head,
            m.vocab_size,
            m.n_layer,
            m.block,
        )
    # the modern block at ANDREA-120M's width, T and vocabulary: 6 heads of 128 (issue 46)
    (modern,) = MODERN
    big = ANDREA[1]
    assert (modern.block, modern.T, modern.C, modern.V, modern.C // modern.NH) == ("modern", big.T, big.C, big.V, 128)


def test_the_muon_groups_are_the_engines() -> None:
    """The catalogue builds Muon's groups itself (kernels/ sits below engine/): they are engine/optim.py's for the
    modern experiment, offsets included, and its optimizer is Muon."""
    from microgpt.engine import optim
    from microgpt.kernels.check.catalogue import MODERN, modern_muon_groups

    (modern,) = MODERN
    exp = config.load(REPO / "experiments" / f"{modern.name}-TRAIN.json")
    assert exp.train.optimizer == "muon"
    assert modern_muon_groups(modern) == optim.groups(exp.model)
    assert [(len(g.offsets), g.rows, g.cols) for g in optim.groups(exp.model)] == [
        (48, 768, 768),
        (12, 768, 3072),
        (12, 3072, 768),
    ]


def test_the_modern_shape_sweeps_its_own_kernels(sweep: dict) -> None:
    """The qkrope pair and its decode twin, and Muon's kernels (its wide, square and tall groups; of its Newton-Schulz
    GEMMs the symmetric tile, for the gram and the polynomial, in fp32 and in 16 bits), are swept at the modern shape
    (and only there), and attention at head size 128 under its own candidates (kernels/attention.py configs): every one
    of them, the default first."""
    rows = sweep["rows"]
    qk = {r["kernel"]: r["shapes"] for r in rows if "qkrope" in r["kernel"]}
    assert qk.keys() == {"k_qkrope_fwd", "k_qkrope_bwd", "k_decode_qkrope"}
    assert all(shapes == ["ANDREA-120M-MODERN"] for shapes in qk.values())
    muon = [r for r in rows if r["kernel"].startswith("k_muon_")]
    assert {r["kernel"] for r in muon} == {"k_muon_momentum", "k_muon_normalise", "k_muon_update"}
    assert all(r["shapes"] == ["ANDREA-120M-MODERN"] and r["fixed"] and r["targets"] == [80, 86, 89, 90] for r in muon)
    sym = [r for r in rows if r["kernel"] == "k_symmetric_mm"]  # Newton-Schulz's A = X X^T and B = b A + c A A
    assert sym and all(r["shapes"] == ["ANDREA-120M-MODERN"] and r["fixed"] for r in sym)
    assert {("HAS_C=True" in r["config"], "IEEE=True" in r["config"]) for r in sym} == {
        (has_c, ieee) for has_c in (False, True) for ieee in (False, True)
    }
    for half in ("fwd", "bwd"):
        labels = {r["label"] for r in rows if r["kernel"] == f"k_attention_{half}" and "BD=128" in r["config"]}
        fused = {"attention_qkrope fused"} if half == "bwd" else set()  # fp32's one tile, the fused way's
        assert labels == {"fixed"} | fused | {
            f"attention_{half} {i}" for i in range(len(attention.configs(half, 128)[0]))
        }
    fused = [r for r in rows if r["kernel"] == "k_attention_bwd" and "QKROPE=True" in r["config"]]
    assert {r["label"] for r in fused} == {"attention_qkrope fused"} | {
        f"attention_bwd {i}" for i in range(len(attention.configs("bwd", 128)[0]))
    }
    assert all(r["shapes"] == ["ANDREA-120M-MODERN"] for r in fused)


def test_every_kernel_is_swept(sweep: dict) -> None:
    """A kernel of kernels/ that no launch of the catalogue reaches would go unchecked: add its launch there."""
    assert sorted({r["kernel"] for r in sweep["rows"]}) == sweep["kernels"]


def test_fp8_kernels_are_built_for_fp8_targets_only(sweep: dict) -> None:
    casts = [r for r in sweep["rows"] if r["kernel"] == "k_cast"]
    assert casts and all(r["targets"] == [89, 90] for r in casts)
    assert all(r["targets"] == [80, 86, 89, 90] for r in sweep["rows"] if r["kernel"] == "k_attention_fwd")


def test_the_tma_tiles_fit_sm90_only_without_spills(sweep: dict) -> None:
    """The TMA tiles (gemm_tma.py) are built for sm_90 only, and CI compiles every one of them there: each
    configuration of gemm_tma.TILES as a way of the plain GEMM and of both MLP fusions (GELU's and ReLU^2's), each
    within sm_90's shared memory and registers and spilling nothing."""
    from microgpt.kernels import gemm_tma

    rows = [r for r in sweep["rows"] if r["kernel"].endswith("_tma")]
    assert rows and all(r["targets"] == [90] and list(r["usage"]) == ["90"] for r in rows)
    for kernel, table in (("k_gemm_tma", "gemm"), ("k_gemm_act_tma", "mlp_act"), ("k_gemm_dact_tma", "mlp_dact")):
        labels = {r["label"] for r in rows if r["kernel"] == kernel}
        assert labels == {f"{table} {name}" for name in gemm_tma.TILES}, (kernel, labels)
    acts = {("ACT=gelu" in r["config"], r["label"]) for r in rows if r["kernel"] == "k_gemm_act_tma"}
    assert len(acts) == 2 * len(gemm_tma.TILES)
    bad = [
        f"{r['kernel']} {r['label']} {r['config']}: {r['usage']['90']}" for r in rows if not fits(r["usage"]["90"], 90)
    ]
    bad += [f"{r['kernel']} {r['label']} {r['config']} spills" for r in rows if r["usage"]["90"]["stack"]]
    assert bad == [], "\n".join(bad)


def test_what_has_no_alternative_fits_every_target(sweep: dict) -> None:
    """Every fixed launch (the GEMM tile, the warm-up's reference way, among them) and every choice's default
    compiles for each of its targets within that target's shared memory and registers."""
    checked, over = 0, []
    for r in sweep["rows"]:
        if not (r["fixed"] or r["default"]):
            continue
        for cc in r["targets"]:
            usage = r["usage"][str(cc)]
            checked += 1
            if not fits(usage, cc):
                over.append(f"{r['kernel']} {r['label']} {r['config']} on sm_{cc}: {usage}")
    assert checked > 200, checked  # the sweep compiled them all: ~70 binaries a target
    assert over == [], "\n".join(over)


def test_no_kernel_overwrites_what_another_of_its_threads_reads(sweep: dict) -> None:
    """No compiled kernel stores over addresses it loads, in another thread layout, a value that does not depend on
    that load (check/hazards.py): such a store is ordered after the read by nothing, so the result depends on how the
    warps were scheduled (kernels/muon.py's normalise pass zeroing g did, and the Muon step did not repeat)."""
    found = [
        f"{r['kernel']} {r['label']} on sm_{cc}: {h}"
        for r in sweep["rows"]
        for cc, usage in r["usage"].items()
        for h in usage["hazards"]
    ]
    assert sum(len(r["usage"]) for r in sweep["rows"]) > 200
    assert found == [], "\n".join(found)


def test_sm80_86_89_lay_out_shared_memory_alike(sweep: dict) -> None:
    """Ampere and Ada compile to the same tiles (sm_90 to Hopper's): where a row was compiled for all three, its shared
    memory is the same. (A candidate over sm_86's limit is then over sm_89's, and only the limits differ.)"""
    differ = []
    for r in sweep["rows"]:
        u = r["usage"]
        if all(cc in u for cc in ("80", "86", "89")) and len({u[cc]["shared"] for cc in ("80", "86", "89")}) > 1:
            differ.append(f"{r['kernel']} {r['label']} {r['config']}")
    assert differ == [], differ


@pytest.mark.skipif(not FULL, reason="the full sweep: MICROGPT_SWEEP=full")
def test_every_candidate_fits_sm90(sweep: dict) -> None:
    """On the H200 the tuner drops nothing: its candidates are the lists as written."""
    over = [
        f"{r['kernel']} {r['label']}" for r in sweep["rows"] if 90 in r["targets"] and not fits(r["usage"]["90"], 90)
    ]
    assert over == []
