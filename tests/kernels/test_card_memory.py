"""The memory plan against a card's free memory before anything is allocated: a plan that does not fit is one line
naming what would, and train.micro_batch "auto" picks the largest that fits.

No such GPU here: what is replaced is what the runtime reads as the card's room for the plan (Runtime.memory_bytes:
torch.cuda.mem_get_info on a GPU, within the process's cap); the plans and the command line are the real ones, on
the Triton interpreter."""

from __future__ import annotations

import pytest

from microgpt import config
from microgpt.engine import backend, memory, state
from microgpt.kernels import runtime
from tests.conftest import write_experiment

from ._kutil import ON_GPU
from .test_cards import one_error_line

GIB = 1 << 30
ANDREA_120M = {"vocab_size": 50304, "d_model": 768, "n_layer": 12, "n_head": 12, "seq_len": 1024}


def card_memory(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """The runtime reads `free` bytes for the plan (as torch.cuda.mem_get_info would give them on a card)."""
    monkeypatch.setattr(runtime.Runtime, "memory_bytes", lambda self: free)


def plan_bytes(m: config.ModelConfig, t: config.TrainConfig, K: backend.Backend, B: int) -> int:
    sequences = t.micro_batch * t.n_micro
    bufs = state.training_plan(m, config.TrainConfig(**{**t.__dict__, "micro_batch": B, "n_micro": sequences // B}), K)
    return sum(memory.role_bytes(bufs, K.precision).values())


def test_a_plan_over_the_card_is_one_line_with_what_fits(tmp_path, monkeypatch, capsys) -> None:
    """ANDREA-120M at micro-batch 8 (5 GiB) on a card with 4.5 GiB free: refused before the arena is allocated,
    naming the plan's total, the room and the largest micro-batch that fits with the n_micro that keeps the 128
    sequences a step."""
    card_memory(monkeypatch, int(4.5 * GIB))
    exp = write_experiment(
        tmp_path, model=ANDREA_120M, train={"micro_batch": 8, "n_micro": 16, "backend": "triton", "precision": "bf16"}
    )
    line = one_error_line(["train", str(exp), "--out", str(tmp_path / "run")], capsys)
    e = config.load(exp)
    K = backend.get_backend("triton", "bf16")
    total, room = plan_bytes(e.model, e.train, K, 8), 4 * GIB
    device = K.device  # the interpreter's in CI, the card's on the GPU machine
    assert line.startswith(
        f"error: the memory plan needs {total:,} bytes but the device ({device}) has {room:,} "
        f"bytes for it ({total / GIB:.2f} GiB against 4.50 GiB available less train.memory_margin "
        "0.50 GiB); train.micro_batch 4 with train.n_micro 32 fits "
    )
    assert line.endswith(
        f"fits ({plan_bytes(e.model, e.train, K, 4) / GIB:.2f} GiB) and keeps the 128 sequences a "
        "step (--micro-batch auto picks it)"
    )
    assert plan_bytes(e.model, e.train, K, 4) <= room < total
    assert not list((tmp_path / "run").glob("ckpt/*"))


@pytest.mark.parametrize("free_gib, margin", [(3.5, 0.5), (7.5, 0.5), (23.5, 0.5), (7.5, 4.0)])
def test_auto_picks_the_largest_micro_batch_that_fits(monkeypatch, capsys, free_gib, margin) -> None:
    card_memory(monkeypatch, int(free_gib * GIB))
    m = config.ModelConfig(**ANDREA_120M)
    t = config.TrainConfig(
        micro_batch=config.AUTO, n_micro=128, backend="triton", precision="bf16", memory_margin=margin
    )
    K = backend.get_backend("triton", "bf16")
    got = state.auto_micro_batch(m, t, K, K.memory_bytes(), int(margin * GIB))
    B, room = got.micro_batch, int((free_gib - margin) * GIB)
    assert B * got.n_micro == 128 and plan_bytes(m, got, K, B) <= room
    assert B == 128 or plan_bytes(m, got, K, 2 * B) > room  # the next micro-batch dividing 128 does not fit
    said = capsys.readouterr().err
    assert said.startswith(f"train.micro_batch auto: {B} x n_micro {128 // B} = 128 sequences a step, the largest ")
    assert f"({free_gib:.2f} GiB available less train.memory_margin {margin:.2f} GiB)" in said


@pytest.mark.skipif(ON_GPU, reason="the interpreter's device has no memory figure; a GPU has one")
def test_auto_without_a_memory_figure_or_room_is_one_line() -> None:
    m = config.ModelConfig(**ANDREA_120M)
    t = config.TrainConfig(micro_batch=config.AUTO, n_micro=128, backend="triton", precision="bf16")
    K = backend.get_backend("triton", "bf16")  # the interpreter: no device memory to read
    with pytest.raises(
        memory.PlanError,
        match=r"^train.micro_batch 'auto': the device \(cpu \(triton interpreter\)\) "
        "does not say how much memory it has",
    ):
        state.make_state(m, t, K)
    refusal = r"no micro-batch fits the device .* a micro-batch of 1 needs 2\.\d\d GiB of the 1\.00 GiB available"
    with pytest.raises(memory.PlanError, match=refusal):
        state.auto_micro_batch(m, t, K, GIB, GIB // 2)
