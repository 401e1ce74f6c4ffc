"""The inference step (model.gpt_infer) on the NumPy backend: a prefill's losses are the training forward's bit for
bit, decoding over the KV cache gives the logits of a prefill of the whole sequence, and its plan holds the cache
and no training state."""

from __future__ import annotations

import numpy as np
import pytest

from microgpt.config import ModelConfig, TrainConfig
from microgpt.engine import memory, model, params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.infer import make_infer_state
from microgpt.engine.state import make_state
from microgpt.use.sample import Generator, Sampling, generate

M = ModelConfig(vocab_size=96, d_model=32, n_layer=2, n_head=4, seq_len=24)


def weights(seed: int = 0) -> np.ndarray:
    """The init, moved off it (LayerNorms off 1/0, larger logits) so the checks see a model that has trained."""
    w = params.init_weights(M, seed)
    return w + np.random.default_rng(seed).standard_normal(w.shape).astype(np.float32) * 0.05


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_a_prefill_scores_as_the_training_forward(precision: str) -> None:
    """Windows of B sequences from position 0 with targets: the inference plan's per-token losses equal the
    training forward's (make_state's arena, gpt_forward without gradients) bit for bit."""
    B = 3
    rng = np.random.default_rng(1)
    x = rng.integers(0, M.vocab_size, (B, M.seq_len)).astype(np.int32)
    y = rng.integers(0, M.vocab_size, (B, M.seq_len)).astype(np.int32)
    y[1, :5] = -1
    w = weights()
    S = make_state(M, TrainConfig(micro_batch=B, precision=precision), numpy_backend(precision_name=precision))
    S.K.copy_in(S.p, w)
    S.prec.cast_weights()
    S.arena["tokens"][0], S.arena["targets"][0] = x, y
    model.gpt_forward(S.K, M, S.P_compute, S.arena, S.arena["tokens"][0], S.arena["targets"][0])
    inf = make_infer_state(M, numpy_backend(precision_name=precision), B, w)
    inf.arena["tokens"][...], inf.arena["targets"][...] = x, y
    inf.run(inf.arena["tokens"], 0, inf.arena["targets"])
    np.testing.assert_array_equal(inf.arena["losses"], S.arena["losses"])


def prefill_logits(ids: list[int], w: np.ndarray) -> np.ndarray:
    """The next-token logits after ids, from a prefill of the whole sequence in a fresh state (no cache reused)."""
    return Generator(make_infer_state(M, numpy_backend(), 1, w)).feed(ids).astype(np.float64)


def test_decoding_over_the_cache_gives_the_prefills_logits() -> None:
    """After a prompt, each token fed alone (the decode step over the cache) gives the logits a prefill of the
    whole sequence so far gives, to fp32 rounding; so does a window of several new tokens at a later position
    (chat's new turn); and greedy decoding picks the same tokens."""
    w = weights(2)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, M.vocab_size, 20).tolist()
    gen = Generator(make_infer_state(M, numpy_backend(), 1, w))
    got = [gen.feed(ids[:6])] + [gen.feed([t]) for t in ids[6:12]] + [gen.feed(ids[12:20])]
    ends = [6, *range(7, 13), 20]
    for end, logits in zip(ends, got):
        want = prefill_logits(ids[:end], w)
        err = np.linalg.norm(logits - want) / np.linalg.norm(want)
        assert err < 1e-5, (end, err)
    assert gen.pos == 20
    gen.pos = 0
    (greedy,) = generate(gen, ids[:5], 10, Sampling(), [0])
    seq = ids[:5]
    for _ in range(10):  # the same continuation from prefills alone
        seq.append(int(np.argmax(prefill_logits(seq, w))))
    assert greedy == seq[5:]


def test_the_context_slides_when_full() -> None:
    """Past seq_len the cache is rebuilt from the last seq_len - 1 tokens: generation goes on without error and a
    rebuilt step's logits are a prefill's of those tokens."""
    w = weights(4)
    gen = Generator(make_infer_state(M, numpy_backend(), 1, w))
    ids = list(range(1, 11))
    (out,) = generate(gen, ids, 3 * M.seq_len, Sampling(1.0), [7])
    assert len(out) == 3 * M.seq_len and all(0 <= t < M.vocab_size for t in out)
    assert 1 <= gen.pos <= M.seq_len


def test_the_inference_plan_holds_the_cache_and_no_training_state() -> None:
    """A KV cache row of (L, 2, B, T, C), one layer's activations for B*T rows, no gradients, Adam moments or saved
    activations; smaller than the training plan of the same batch; refused in one line where it cannot fit."""
    B = 4
    K = numpy_backend()
    bufs = memory.inference_plan(M, K.precision, B, 8)
    roles = {b.role for b in bufs}
    assert {"grads", "adam_m", "adam_v", "acts"}.isdisjoint(roles)
    (kv,) = [b for b in bufs if b.role == "kv_cache"]
    assert kv.shape == (M.n_layer, 2, B, M.seq_len, M.d_model)
    assert [b.shape for b in bufs if b.name == "h"] == [(B * M.seq_len, 4 * M.d_model)]
    train = memory.plan(M, TrainConfig(micro_batch=B), K.precision, 8)

    def used(plan: list[memory.Buf]) -> int:  # the bytes of its buffers, before the arena's rounding
        return sum(n for role, n in memory.role_bytes(plan, K.precision).items() if role != "rounding")

    assert used(bufs) < used(train) / 2
    with pytest.raises(memory.PlanError, match=r"^the memory plan needs [\d,]+ bytes but the device \(cpu\)"):
        memory.check_fits(bufs, K.precision, M, 1000, "cpu")


def test_rows_at_their_own_positions_decode_as_each_sequence_alone() -> None:
    """Continuous batching (serve.py): rows at positions of their own in cache rows of their own. The same rows at
    one position give the one-group step's logits bit for bit (the same GEMMs, attention row by row); rows of
    different lengths in permuted cache rows each give their own sequence's logits, as decoded alone."""
    w = weights(5)
    rng = np.random.default_rng(6)
    B = 3
    S = make_infer_state(M, numpy_backend(), B, w)
    gen = Generator(S)
    ids = rng.integers(0, M.vocab_size, (B, 9)).astype(np.int32)
    gen.feed_rows(ids[:, :8])
    shared = gen.run(ids[:, 8:], 8)
    gen.feed_rows(ids[:, :8])
    per_row = gen.run(ids[:, 8:], [8, 8, 8], [0, 1, 2])
    np.testing.assert_array_equal(per_row, shared)
    seqs = [rng.integers(0, M.vocab_size, n).tolist() for n in (4, 11, 7)]
    slots = [2, 0, 1]
    for seq, slot in zip(seqs, slots):  # each prompt prefilled alone into its own cache row
        gen.run(np.asarray(seq[:-1], np.int32)[None], 0, [slot])
    got = gen.run(np.asarray([[s[-1]] for s in seqs], np.int32), [len(s) - 1 for s in seqs], slots)
    for seq, logits in zip(seqs, got):
        want = prefill_logits(seq, w)
        assert np.linalg.norm(logits - want) / np.linalg.norm(want) < 1e-5
    with pytest.raises(ValueError, match="3 rows need 3 positions"):
        gen.run(np.zeros((3, 1), np.int32), [1, 2], [0, 1, 2])
