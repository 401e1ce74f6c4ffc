"""precision "fp8" as a run: the memory plan's rows, training on the NumPy reference (loss next to fp32's, the E4M3
weight copies refreshed every step), bit-exact resume through the real CLI, and the one-line refusal where the
machine has no FP8 tensor cores."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from microgpt import checkpoint, config, fp8, memory
from microgpt.backend import get_backend
from microgpt.ops import fp8 as ref
from microgpt.state import make_state
from microgpt.step import Step
from tests.conftest import cli, json_lines, write_experiment

M = config.ModelConfig(vocab_size=61, d_model=16, n_layer=2, n_head=2, seq_len=16)


def state(precision: str, **train):
    t = config.TrainConfig(micro_batch=2, n_micro=2, precision=precision, backend="numpy", grad_clip=1.0, **train)
    return make_state(M, t, get_backend("numpy", precision))


def batches(seed: int, steps: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Two steps' random batches, repeated: a model can only learn them by heart, which shows it learning."""
    rng = np.random.default_rng(seed)
    draw = lambda: rng.integers(0, M.vocab_size, (2, M.seq_len)).astype(np.int32)  # noqa: E731
    two = [[(draw(), draw()) for _ in range(2)] for _ in range(2)]
    return [two[i % 2] for i in range(steps)]


def test_plan_has_the_fp8_rows_and_the_state_reads_them() -> None:
    S = state("fp8")
    names = {b.name: b for b in S.plan}
    for layer in range(M.n_layer):
        for site, (G, C, OC) in fp8.site_shapes(M.d_model).items():
            assert names[f"h{layer}.{site}.w8"].shape == (C, G * OC) and names[f"h{layer}.{site}.w8"].kind == "f8"
            assert names[f"h{layer}.{site}.w8t"].shape == (G, OC, C)
            assert S.P_compute[f"h{layer}.{site}"] is next(w for w in S.w8 if w.name == f"h{layer}.{site}")
    assert memory.role_bytes(S.plan, S.t)["fp8_weights"] >= 2 * 12 * M.d_model**2 * M.n_layer
    assert "compute_params" not in {b.role for b in S.plan}  # the NumPy backend computes on the fp32 masters
    t = config.TrainConfig(micro_batch=2, precision="fp8", backend="triton")
    assert "compute_params" in {b.role for b in memory.plan(M, t, 7)}  # the GPU reads bf16 beside the E4M3 copies


def test_fp8_trains_next_to_fp32_and_recasts_the_weights_each_step() -> None:
    runs = {}
    for precision in ("fp32", "fp8"):
        S = state(precision)
        step = Step(S)
        runs[precision] = [step(b, 1e-2).loss for b in batches(0, 30)]
        if precision == "fp8":
            for w in S.w8:  # the copies are the masters' cast after the last update
                q, inv = ref.quantize(w.master)
                np.testing.assert_array_equal(w.w8t.view(np.uint8), q.transpose(0, 2, 1).view(np.uint8))
                assert w.scale[0] == inv
    f32, f8 = np.array(runs["fp32"]), np.array(runs["fp8"])
    assert f8[-4:].mean() < f8[:4].mean() - 0.5, "fp8 should learn the repeated batches"
    assert np.abs(f8 - f32).max() < 0.02 * f32.max(), (f32, f8)
    assert not np.array_equal(f8, f32), "fp8 must differ from fp32: its operands are rounded"


def test_fp8_resume_is_bit_exact(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path, train={"precision": "fp8", "backend": "numpy"})
    straight = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr
    half = cli("train", str(exp), "--steps", "3", "--out", str(tmp_path / "b"))
    assert half.returncode == 0, half.stderr
    resumed = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "b"), "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr
    final = checkpoint.ckpt_name(6)
    assert (tmp_path / "a/ckpt" / final).read_bytes() == (tmp_path / "b/ckpt" / final).read_bytes()
    assert json_lines(resumed.stdout)[0]["step"] == 3


def test_fp8_without_fp8_tensor_cores_is_one_line_naming_the_field(tmp_path: Path) -> None:
    """The triton backend on a machine without CUDA (and without the interpreter): exit 2, one line naming
    train.precision, nothing written."""
    exp = write_experiment(tmp_path, train={"precision": "fp8", "backend": "triton"})
    res = cli(
        "train", str(exp), "--out", str(tmp_path / "run"), env={"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "train.precision 'fp8'" in lines[0] and "compute capability" in lines[0], lines[0]
    assert not (tmp_path / "run" / "ckpt").exists()
