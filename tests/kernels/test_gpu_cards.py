"""On the GPU: what keeps a run going on a card that offers less than the H200, made to happen on the H200.

Run on the GPU machine: MICROGPT_TEST_GPU=1 python3 -m pytest -m gpu tests/kernels/test_gpu_cards.py
- a tuning candidate too big for the device's shared memory is skipped by the tuner (Triton's OutOfResources, raised
  before launching), and the result is the one of a candidate that fits;
- a Triton GEMM tile too big for the device leaves the GEMM (the warm-up's reference included) to cuBLAS;
- the runtime's room for the plan is the free memory, within a per-process cap where one is set, and
  `--micro-batch auto` under a cap trains with the allocator's peak within it (dev/capped_train.py).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from microgpt.kernels import attention, runtime
from microgpt.kernels import gemm as kgemm
from microgpt.kernels.tuning import Tuner
from tests.conftest import REPO, json_lines, write_experiment

from ._kutil import ON_GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs CUDA")]

# far over any card's shared memory a block: each stage holds K and V tiles (2 x 128 x 64 bf16; about 145 KiB at 4
# stages on sm_90, kernels/targets.py) and the GEMM's A and B tiles (2 x 128 x 64 bf16; 129 KiB at 4 stages)
HUGE_ATTENTION = dict(BM=128, BN=128, num_warps=8, num_stages=8)
HUGE_TILE = dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=8)


def test_an_attention_candidate_over_the_device_is_skipped(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MICROGPT_CACHE", str(tmp_path))
    monkeypatch.setattr(attention, "FWD_CONFIGS", [HUGE_ATTENTION, *attention.FWD_CONFIGS])
    monkeypatch.setattr(attention, "FWD_DEFAULT", 0)  # the one that does not fit is the default too
    torch.manual_seed(0)
    B, T, C, NH = 2, 1024, 768, 12
    q, k, v = (torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    outs = []
    for window in (False, True):  # the default outside the warm-up, then the timed choice
        out, lse = torch.empty_like(q), torch.empty(B, NH, T, device="cuda")
        tuner = Tuner()
        if window:
            with tuner.window():
                attention.attention_forward(out, lse, q, k, v, NH, tuner=tuner)
        else:
            attention.attention_forward(out, lse, q, k, v, NH, tuner=tuner)
        outs.append(out.float())
    ref = (
        torch.nn.functional.scaled_dot_product_attention(
            *(x.view(B, T, NH, -1).transpose(1, 2).float() for x in (q, k, v)), is_causal=True
        )
        .transpose(1, 2)
        .reshape(B, T, C)
    )
    for out in outs:
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    assert "attention_fwd candidate 0 does not fit" in capsys.readouterr().err


def test_a_gemm_tile_over_the_device_leaves_the_gemms_to_cublas(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MICROGPT_CACHE", str(tmp_path))
    monkeypatch.setattr(kgemm, "tile_config", lambda dtype: HUGE_TILE)
    tuner = Tuner()
    tuner.set_probe(torch.zeros(2 * kgemm.PROBE_ROWS * 4096, device="cuda"))
    g = kgemm.Gemm(tuner, None)
    a, b = (torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with tuner.window():
        g.mm(out, a, b.t())
    ref = a.float() @ b.float().t()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert set(g.choices().values()) == {"cublas"}
    assert (
        "the Triton GEMM tile (BM128 BN128 BK64 GROUP_M8 num_warps8 num_stages8) does not fit"
        in capsys.readouterr().err
    )


def test_the_room_for_the_plan_is_the_free_memory_within_a_cap() -> None:
    rt = runtime.Runtime("bf16")
    free, total = torch.cuda.mem_get_info()
    assert abs(rt.memory_bytes() - (free + rt.workspace_bytes)) < 64 << 20
    assert ", sm_" in rt.device and " SMs, " in rt.device
    before = torch.cuda.get_per_process_memory_fraction()
    try:
        torch.cuda.set_per_process_memory_fraction(7.5 * 2**30 / total)
        assert rt.memory_bytes() <= 7.5 * 2**30 - torch.cuda.memory_reserved() + rt.workspace_bytes
    finally:
        torch.cuda.set_per_process_memory_fraction(before)


@pytest.mark.parametrize("cap_gib", [7.5, 11.5])
def test_auto_micro_batch_under_a_cap_trains_within_it(tmp_path, cap_gib) -> None:
    """ANDREA-120M's body (byte vocabulary: the builtin data, 3 steps) with `--micro-batch auto` under a
    per-process cap: the chosen micro-batch keeps 128 sequences a step and the allocator's peak stays within the
    cap."""
    exp = write_experiment(
        tmp_path,
        model={"vocab_size": 256, "d_model": 768, "n_layer": 12, "n_head": 12, "seq_len": 1024},
        train={
            "micro_batch": 8,
            "n_micro": 16,
            "steps": 3,
            "backend": "triton",
            "precision": "bf16",
            "eval_every": 1000,
        },
    )
    cmd = [
        sys.executable,
        "dev/capped_train.py",
        str(cap_gib),
        "train",
        str(exp),
        "--out",
        str(tmp_path / "run"),
        "--micro-batch",
        "auto",
        "--json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    start = next(rec for rec in json_lines(r.stdout) if rec["event"] == "start")
    t = start["config"]["train"]
    assert t["micro_batch"] * t["n_micro"] == 128 and math.log2(t["micro_batch"]).is_integer()
    capped = json.loads(next(line for line in r.stderr.splitlines() if '"event": "capped"' in line))
    assert capped["within"], capped
    assert "train.micro_batch auto: " in r.stderr
    steps = [rec for rec in json_lines(r.stdout) if rec["event"] == "step"]
    print(
        next(line for line in r.stderr.splitlines() if line.startswith("train.micro_batch auto: ")),
        capped,
        [round(rec["tokens_per_s"]) for rec in steps],
    )  # the evidence a run on the GPU machine keeps (-s)
