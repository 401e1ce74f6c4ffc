"""precision "fp8" as a run: the memory plan's rows, training on the NumPy reference (loss next to fp32's, the E4M3
weight copies refreshed every step), the amax histories (primed once, rolled every micro-batch, untouched by
evaluation, in the checkpoint), bit-exact resume through the real CLI, a bad history in a sidecar, and the
one-line refusal where the machine has no FP8 tensor cores."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint, config, fp8
from microgpt.engine import memory, params, precision
from microgpt.engine.backend import get_backend
from microgpt.engine.state import make_state
from microgpt.engine.step import Step
from microgpt.ops import fp8 as ref
from microgpt.run import trainer
from tests.conftest import TINY, cli, json_lines, write_experiment

M = config.ModelConfig(vocab_size=64, d_model=16, n_layer=2, n_head=2, seq_len=16)  # a multiple of 16: E4M3 head


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
        for site, (G, C, OC) in params.site_shapes(M.d_model).items():
            assert names[f"h{layer}.{site}.w8"].shape == (C, G * OC) and names[f"h{layer}.{site}.w8"].kind == "f8"
            assert names[f"h{layer}.{site}.w8t"].shape == (G, OC, C)
            assert S.P_compute[f"h{layer}.{site}"] is next(w for w in S.prec.sites if w.name == f"h{layer}.{site}")
    assert memory.role_bytes(S.plan, S.K.precision)["fp8_weights"] >= 2 * 12 * M.d_model**2 * M.n_layer
    assert "compute_params" not in {b.role for b in S.plan}  # the NumPy backend computes on the fp32 masters
    assert names["lm_head.w8"].shape == (M.vocab_size, M.d_model) and names["fp8_head_slots"].shape == (2, fp8.SLOT)
    head = S.prec.head
    assert head is S.prec.mm.head and head.master.base is not None and head.w8 is S.arena["lm_head.w8"]
    np.testing.assert_array_equal(head.master, S.P["wte"])
    assert np.shares_memory(head.master, S.P["wte"]) and np.shares_memory(head.w, S.P_compute["wte"])
    t = config.TrainConfig(micro_batch=2, precision="fp8", backend="triton")
    gpu = precision.make("fp8", "triton")  # the GPU reads bf16 beside the E4M3 copies
    assert "compute_params" in {b.role for b in memory.plan(M, t, gpu, 7)}
    odd = dataclasses.replace(M, vocab_size=61)  # not a multiple of 16: the head stays in the compute dtype
    S = make_state(odd, S.t, get_backend("numpy", "fp8"))
    assert S.prec.head is None and "lm_head.w8" not in {b.name for b in S.plan}


def test_fp8_trains_next_to_fp32_and_recasts_the_weights_each_step() -> None:
    runs = {}
    for name in ("fp32", "fp8"):
        S = state(name)
        step = Step(S)
        runs[name] = [step(b, 1e-2).loss for b in batches(0, 30)]
        if name == "fp8":
            for w in [*S.prec.sites, S.prec.head]:  # the copies (the LM head's too): the masters' cast after the update
                q, inv = ref.cast(w.master, np.zeros(fp8.SLOT, np.float32), current=True)
                got, want = (w.w8, q) if w.w8t is None else (w.w8t, q.transpose(0, 2, 1))
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
                assert w.scale[0] == inv
    f32, f8 = np.array(runs["fp32"]), np.array(runs["fp8"])
    assert f8[-4:].mean() < f8[:4].mean() - 0.5, "fp8 should learn the repeated batches"
    assert np.abs(f8 - f32).max() < 0.02 * f32.max(), (f32, f8)
    assert not np.array_equal(f8, f32), "fp8 must differ from fp32: its operands are rounded"


def test_histories_are_primed_once_then_rolled_every_micro_batch() -> None:
    """A fresh state primes (its first micro-batch scales operands by their own amax); every micro-batch then adds
    one entry to each operand's history, the oldest dropping out after fp8.HISTORY."""
    S = state("fp8")
    assert S.prec.priming and not S.arena["fp8_slots"].any()
    step = Step(S)
    for i, b in enumerate(batches(1, 10)):
        step(b, 1e-2)
        assert not S.prec.priming
        hist = S.arena["fp8_slots"][..., fp8.HIST :]
        filled = min(2 * (i + 1), fp8.HISTORY)  # n_micro = 2 entries a step
        assert (hist[..., :filled] > 0).all() and not hist[..., filled:].any(), i
        assert not S.arena["fp8_slots"][..., fp8.PRE : fp8.AMAX + 1].any()  # cleared for the next micro-batch


def test_the_warm_up_leaves_no_trace_in_the_scales() -> None:
    """A backend whose prepare runs the step once first, as the GPU's warm-up does (gscale = inf: nothing is
    updated): the losses and the histories are those of a backend without one. The warm-up's casts and rolls are
    undone, the first step still primes, and the step prepared (the one the GPU captures) does not prime."""
    runs, held, priming_when_prepared = {}, {}, []

    def prepare(run, graph):
        priming_when_prepared.append(held["S"].prec.priming)
        run()
        return run

    for warm in (False, True):
        K = get_backend("numpy", "fp8")
        if warm:
            K = dataclasses.replace(K, prepare=prepare)
        t = config.TrainConfig(micro_batch=2, n_micro=2, precision="fp8", backend="numpy", grad_clip=1.0)
        S = held["S"] = make_state(M, t, K)
        step = Step(S)
        runs[warm] = [step(b, 1e-2).loss for b in batches(2, 4)], S.arena["fp8_slots"].copy()
    assert priming_when_prepared == [False]
    assert runs[True][0] == runs[False][0]
    np.testing.assert_array_equal(runs[True][1], runs[False][1])


def test_evaluation_leaves_the_histories_as_they_were(tmp_path: Path) -> None:
    raw = json.loads(json.dumps(TINY))
    raw["train"].update(precision="fp8", backend="numpy")
    tr = trainer.Trainer(config.from_dict(raw), tmp_path)
    for _ in range(2):
        tr.train_step()
    before = tr.S.arena["fp8_slots"][..., 1:].copy()  # all but 2^-k, which every cast rewrites before its GEMM
    assert np.isfinite(tr.evaluate()["val_loss"])
    np.testing.assert_array_equal(tr.S.arena["fp8_slots"][..., 1:], before)


def test_fp8_resume_is_bit_exact(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path, train={"precision": "fp8", "backend": "numpy"})
    straight = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr
    half = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "b"), "--set", "train.ckpt_every=3")
    assert half.returncode == 0, half.stderr
    for late in ("step-00000006.bin", "step-00000006.state.json"):  # as if stopped after step 3's checkpoint
        (tmp_path / "b/ckpt" / late).unlink()
    resumed = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "b"), "--resume", "latest", "--json")
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


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory) -> tuple[Path, Path]:
    """An fp8 run of 2 steps with its checkpoint (experiment, run folder)."""
    tmp = tmp_path_factory.mktemp("fp8run")
    exp = write_experiment(tmp, train={"precision": "fp8", "backend": "numpy", "steps": 2, "eval_every": 100})
    res = cli("train", str(exp), "--out", str(tmp / "run"))
    assert res.returncode == 0, res.stderr
    return exp, tmp / "run"


def test_checkpoint_carries_the_histories(fp8_run: tuple[Path, Path]) -> None:
    exp, run = fp8_run
    side = checkpoint.read_sidecar(run / "ckpt" / checkpoint.ckpt_name(2))
    L, n_sites = TINY["model"]["n_layer"], len(params.SITES)
    hist = np.array(side["fp8_amax_history"]).reshape(L, n_sites, 2, fp8.HISTORY)
    assert (hist[..., :4] > 0).all() and not hist[..., 4:].any()  # 2 steps of 2 micro-batches


@pytest.mark.parametrize(
    "bad,why",
    [
        ("short", "must hold 256 numbers"),
        ("neg", "item 0 must be a finite number in"),
        ("str", "item 0 must be a finite number"),
    ],
)
def test_bad_history_in_the_sidecar_is_one_line_and_harms_nothing(
    fp8_run: tuple[Path, Path], tmp_path: Path, bad, why: str
) -> None:
    """A sidecar whose fp8_amax_history is the wrong length, negative or not numbers: resume exits 2 with one
    line naming the sidecar and the field; the checkpoint and the loss history are byte for byte as they were."""
    import shutil

    exp, run = fp8_run
    run2 = tmp_path / "run"
    shutil.copytree(run, run2)
    ck = run2 / "ckpt" / checkpoint.ckpt_name(2)
    side_path = checkpoint.sidecar_path(ck)
    side = json.loads(side_path.read_text())
    hist = side["fp8_amax_history"]
    side["fp8_amax_history"] = {"short": hist[:2], "neg": [-1.0] + hist[1:], "str": ["x"] * len(hist)}[bad]
    side_path.write_text(json.dumps(side))
    before = {p: p.read_bytes() for p in run2.rglob("*") if p.is_file()}
    res = cli("train", str(exp), "--steps", "4", "--out", str(run2), "--resume", "latest")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "fp8_amax_history" in lines[0] and why in lines[0] and side_path.name in lines[0], lines[0]
    assert {p: p.read_bytes() for p in run2.rglob("*") if p.is_file()} == before


def test_bf16_checkpoint_resumes_in_fp8_by_priming(tmp_path: Path) -> None:
    """A checkpoint without histories (another precision's) resumes in fp8: the first micro-batch primes them."""
    exp32 = write_experiment(tmp_path, train={"backend": "numpy", "steps": 2, "eval_every": 100})
    assert cli("train", str(exp32), "--out", str(tmp_path / "run")).returncode == 0
    exp8 = write_experiment(tmp_path, train={"precision": "fp8", "backend": "numpy", "steps": 3, "eval_every": 100})
    res = cli("train", str(exp8), "--out", str(tmp_path / "run"), "--resume", "latest")
    assert res.returncode == 0, res.stderr
    side = checkpoint.read_sidecar(tmp_path / "run" / "ckpt" / checkpoint.ckpt_name(3))
    hist = np.array(side["fp8_amax_history"]).reshape(-1, fp8.HISTORY)  # a row per slot: 2 layers x 4 sites x 2
    assert hist.shape[0] == 16 and (hist[:, :2] > 0).all() and not hist[:, 2:].any()  # one step: 2 micro-batches


def test_sample_of_an_fp8_run(fp8_run: tuple[Path, Path]) -> None:
    """The run samples on the NumPy backend in fp8 (its amax histories from the sidecar) and in fp32 (the triton
    backend's fp8: tests/kernels/test_sample_backends.py)."""
    _, run = fp8_run
    for prec in ("fp8", "fp32"):
        res = cli("sample", str(run), "--backend", "numpy", "--precision", prec, "--tokens", "4")
        assert res.returncode == 0 and res.stdout.strip(), res.stderr
