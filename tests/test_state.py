"""TrainState: made once from (model, train, backend), the fp16 loss scaler, and the checkpoint round trip
(weights, m, v, step and scaler out and back in, bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

from microgpt import checkpoint, config
from microgpt.engine import params, precision
from microgpt.engine.backend import get_backend, numpy_backend
from microgpt.engine.precision import GROWTH_INTERVAL, LossScaler
from microgpt.engine.state import make_state
from microgpt.engine.step import Step

M = config.ModelConfig(vocab_size=61, d_model=24, n_layer=2, n_head=3, seq_len=11)


def batch(rng: np.random.Generator, B: int) -> tuple[np.ndarray, np.ndarray]:
    return tuple(rng.integers(0, M.vocab_size, (B, M.seq_len)).astype(np.int32) for _ in range(2))


def test_make_state_initialises_from_the_seed() -> None:
    t = config.TrainConfig(micro_batch=2, seed=11)
    a, b = make_state(M, t, numpy_backend()), make_state(M, t, numpy_backend())
    assert a.p.tobytes() == b.p.tobytes() and a.p.size == params.n_params(M)
    assert not a.g.any() and not a.adam_m.any() and not a.adam_v.any() and a.step == 0
    mask = a.arena["decay_mask"]
    assert mask[: M.vocab_size * M.d_model].all() and mask.sum() == sum(
        np.prod(s) for _, s in params.param_shapes(M) if len(s) == 2
    )
    other = make_state(M, config.TrainConfig(micro_batch=2, seed=12), numpy_backend())
    assert other.p.tobytes() != a.p.tobytes()


def test_loss_scaler_halves_on_overflow_and_doubles_after_a_streak() -> None:
    s = LossScaler.for_precision(precision.make("fp16", "triton"))
    assert s.dynamic and s.scale == 2.0**16
    s.update(False)
    assert (s.scale, s.good_steps) == (2.0**15, 0)
    for _ in range(GROWTH_INTERVAL):
        s.update(True)
    assert s.scale == 2.0**16
    static = LossScaler.for_precision(precision.make("bf16", "triton"))
    static.update(False)
    assert (static.scale, static.dynamic) == (1.0, False)


def test_checkpoint_round_trip_is_bit_exact(tmp_path) -> None:
    t = config.TrainConfig(micro_batch=2, n_micro=2, seed=3)
    rng = np.random.default_rng(0)
    a = make_state(M, t, numpy_backend())
    step = Step(a)
    for _ in range(2):
        step([batch(rng, 2) for _ in range(2)], 1e-3)
    a.scaler.scale, a.scaler.good_steps = 512.0, 7
    path = a.save_checkpoint(tmp_path / checkpoint.ckpt_name(a.step), {"config": {"model": vars(M)}})
    b = make_state(M, t, numpy_backend())
    b.load_checkpoint(path)
    for name in ("p", "adam_m", "adam_v"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
    assert (b.step, b.scaler.scale, b.scaler.good_steps) == (2, 512.0, 7)
    nxt = [batch(rng, 2) for _ in range(2)]
    assert Step(a)(nxt, 1e-3).loss == Step(b)(nxt, 1e-3).loss and a.p.tobytes() == b.p.tobytes()


def test_a_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    t = config.TrainConfig(micro_batch=2)
    a = make_state(M, t, numpy_backend())
    path = a.save_checkpoint(tmp_path / "step-00000000.bin", {"config": {"model": {**vars(M), "n_head": 4}}})
    with pytest.raises(checkpoint.CheckpointError, match="model.n_head differs"):
        make_state(M, t, numpy_backend()).load_checkpoint(path)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_recomputing_gelu_trains_the_same_bits_on_numpy(precision: str) -> None:
    """train.recompute_gelu changes where a = gelu(h) lives (a saved plane per layer, or one scratch that backward
    refills), not what the reference computes: the same GELU of the same h. Three steps of two micro-batches each
    (so a is overwritten between a forward and its backward's neighbours) give the same losses, norms and weights."""
    rng = np.random.default_rng(5)
    data = [[batch(rng, 2) for _ in range(2)] for _ in range(3)]
    runs = []
    for recompute in (False, True):
        t = config.TrainConfig(micro_batch=2, n_micro=2, seed=3, precision=precision, recompute_gelu=recompute)
        S = make_state(M, t, get_backend("numpy", precision))
        step = Step(S)
        results = [step(d, 1e-2) for d in data]
        runs.append(([(r.loss, r.grad_norm) for r in results], S.p.tobytes()))
    assert runs[0] == runs[1]
