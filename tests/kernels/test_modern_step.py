"""The modern block (model.block "modern") and Muon on the triton backend, end to end, against the NumPy backend:
the training forward and backward, two whole optimizer steps (AdamW on the embedding and head, Muon on the
matrices, the clip acting), and the decode step. Through the interpreter in CI (fp32), on the GPU where there is
one (MICROGPT_TEST_GPU=1)."""

import dataclasses

import numpy as np
import pytest

from microgpt.config import ModelConfig, TrainConfig
from microgpt.engine import backend, model, params
from microgpt.engine.infer import make_infer_state
from microgpt.engine.state import make_state
from microgpt.engine.step import Step

from ._kutil import check

M = ModelConfig(vocab_size=61, d_model=32, n_layer=2, n_head=2, seq_len=16, block="modern", softcap=6.0)
MV = dataclasses.replace(M, value_embeds=1)  # one value-embedding table, layers 0 and 1 share it
# skips: layer 3 adds the stream after layer 0 (dskip), layer 2 its own input (skip_kept)
MS = dataclasses.replace(M, n_layer=4, skips=2)
# a window under the interpreter's 16-key tiles and <|endoftext|> (0) starting documents (issue 55); MWS: at T 32, the
# window's schedule (16 positions at step 0, 32 from step 1) with documents
MW = dataclasses.replace(M, attn_window=5, doc_mask=0)
MWS = dataclasses.replace(M, seq_len=32, doc_mask=0)
# every lever of the block at once: skips, a value embedding, the window and the documents
MALL = dataclasses.replace(MS, value_embeds=1, attn_window=5, doc_mask=0)
B = 2


def _state(name: str, t: TrainConfig, m: ModelConfig = M):
    """make_state on one backend, the logits chunk forced to 12 rows (3 chunks, the last short), the weights
    perturbed off their init (its zero matrices would hide wiring mistakes), the same on both backends."""
    K = backend.numpy_backend() if name == "numpy" else backend.triton_backend(t.precision)
    K = dataclasses.replace(K, logits_rows=lambda m, b: 12)
    S = make_state(m, t, K)
    w = S.K.to_numpy(S.p).copy()
    w += np.random.default_rng(len(w)).standard_normal(w.shape).astype(np.float32) * 0.1
    S.K.copy_in(S.p, w)
    if S.p_compute is not None:
        S.K.copy_in(S.p_compute, w)
    return S


def _batch(rng: np.random.Generator, m: ModelConfig = M) -> tuple[np.ndarray, np.ndarray]:
    x = rng.integers(1, m.vocab_size, size=(B, m.seq_len)).astype(np.int32)
    x[0, [4, 9]] = x[1, 0] = 0  # <|endoftext|> where model.doc_mask reads it, an ordinary token elsewhere
    y = rng.integers(0, m.vocab_size, size=(B, m.seq_len)).astype(np.int32)
    y[0, :3] = -1
    return x, y


@pytest.mark.parametrize(
    "m, recompute",
    [(M, False), (MV, False), (MS, False), (MW, False), (MALL, False), (M, True)],
    ids=["plain", "value-embeds", "skips", "window-docs", "every-lever", "recompute"],
)
def test_forward_backward_matches_numpy(m: ModelConfig, recompute: bool) -> None:
    """The plan keeps ReLU^2's a and no h (its backward reads a: memory.pre_activation_kept), or with
    train.recompute_gelu h and a scratch, on both backends; the losses and every gradient agree."""
    t = TrainConfig(micro_batch=B, optimizer="muon", recompute_gelu=recompute)
    Sn, St = _state("numpy", t, m), _state("triton", t, m)
    x, y = _batch(np.random.default_rng(1))
    for S in (Sn, St):
        K, A = S.K, S.arena
        assert ("h" in A) is recompute and A["a"].ndim == (2 if recompute else 3)
        K.copy_in(A["tokens"][0], x)
        K.copy_in(A["targets"][0], y)
        K.copy_in(A["loss_scale"], np.ones(1))
        model.gpt_forward(K, m, S.P_compute, A, A["tokens"][0], A["targets"][0], S.G)
        model.gpt_backward(K, m, S.P_compute, S.G, A, A["tokens"][0])
    check("losses", St.K.to_numpy(St.arena["losses"]), Sn.arena["losses"], 1e-5)
    for name, _ in params.param_shapes(m):
        check(name, St.K.to_numpy(St.G[name]), Sn.G[name], 1e-4)


def _steps_on_both(t: TrainConfig, m: ModelConfig, steps: list, lrs: list[float]) -> tuple:
    """The same steps (each a list of batches, at its lr) on the NumPy and the Triton backend: ((state, results)
    of NumPy, of Triton), whose losses and grad norms already agree (1e-5, 1e-4 relative)."""
    results = {}
    for name in ("numpy", "triton"):
        S = _state(name, t, m)
        step = Step(S)
        results[name] = (S, [step(batches, lr) for batches, lr in zip(steps, lrs)])
    for a, b in zip(results["triton"][1], results["numpy"][1]):
        assert abs(a.loss - b.loss) < 1e-5 * abs(b.loss)
        assert abs(a.grad_norm - b.grad_norm) < 1e-4 * b.grad_norm
    return results["numpy"], results["triton"]


@pytest.mark.parametrize("m", [M, MS, MWS], ids=["plain", "skips-ns-steps-3", "window-schedule-docs"])
def test_two_muon_steps_match_numpy(m: ModelConfig) -> None:
    """step.optimizer_step on both backends: the same losses and norms, and after two steps with the clip acting
    the same weights and m (Muon's momentum on the matrices, AdamW's on the embedding and head, and the skips'
    scalars), v zero where Muon owns a parameter, the gradients left zero; with skips and 3 Newton-Schulz steps
    (train.muon_ns_steps: both backends' steps bound to it), and with the window's schedule (each step's window
    written before it) and documents."""
    window = {"attn_window_start": 16, "attn_window_every": 1} if m is MWS else {}
    t = TrainConfig(
        **window,
        muon_ns_steps=3 if m is MS else 5,
        micro_batch=B,
        n_micro=2,
        grad_clip=0.05,
        optimizer="muon",
        lr=0.05,
        head_lr=0.01,
        muon_lr=0.03,
        weight_decay=0.0,
        muon_weight_decay=0.1,
        beta1=0.8,
    )
    rng = np.random.default_rng(2)
    steps = [[_batch(rng, m) for _ in range(t.n_micro)] for _ in range(2)]
    (Sn, rn), (St, rt) = _steps_on_both(t, m, steps, [t.lr / 2, t.lr])
    assert rn[0].grad_norm > t.grad_clip, "the clip should act"
    for name in ("p", "adam_m", "adam_v"):
        check(name, St.K.to_numpy(getattr(St, name)), getattr(Sn, name), 1e-4)
    v = params.views(Sn.adam_v, m)
    assert not any(v[name].any() for name, _, _ in params.matrices(m)), "Muon writes nothing into v"
    assert v["wte"].any() and v["lm_head"].any() and (not m.skips or v["skip_w"].all())
    assert not St.K.to_numpy(St.g).any(), "the step leaves the grads zeroed"


def test_batch_warmup_muon_steps_match_numpy() -> None:
    """A batch warmup under Muon on Triton: steps of 1, 2 and 3 micro-batches (n_micro 3 from 1 over 2 steps) give
    the NumPy backend's losses, norms, weights and momentum."""
    t = TrainConfig(
        micro_batch=B,
        n_micro=3,
        batch_warmup_steps=2,
        batch_warmup_start=1,
        grad_clip=0.05,
        optimizer="muon",
        lr=0.05,
        head_lr=0.01,
        muon_lr=0.03,
        weight_decay=0.0,
        beta1=0.8,
    )
    rng = np.random.default_rng(6)
    steps = [[_batch(rng) for _ in range(count)] for count in (1, 2, 3)]
    (Sn, rn), (St, rt) = _steps_on_both(t, M, steps, [t.lr] * 3)
    for name in ("p", "adam_m"):
        check(name, St.K.to_numpy(getattr(St, name)), getattr(Sn, name), 1e-4)


@pytest.mark.parametrize(
    "m", [M, MV, MS, MW, MALL], ids=["plain", "value-embeds", "skips", "window-docs", "every-lever"]
)
def test_decode_matches_numpy(m: ModelConfig) -> None:
    """The decode step (rotary at each row's position, from its own cache row; the window and each row's document
    start from its cache row's tokens) on both backends."""
    w = params.init_weights(m, 3) + np.random.default_rng(4).standard_normal(params.n_params(m)).astype(np.float32)
    w *= 0.3
    ids = np.random.default_rng(5).integers(1, m.vocab_size, (2, 9)).astype(np.int32)
    ids[0, 2] = ids[1, 6] = 0
    logits = {}
    for name in ("numpy", "triton"):
        K = backend.numpy_backend() if name == "numpy" else backend.triton_backend("fp32")
        S = make_infer_state(m, K, 2, w)
        slots = np.array([1, 0], np.int32)
        logits[name] = [S.K.to_numpy(S.decode(ids[:, i], np.full(2, i, np.int32), slots)).copy() for i in range(9)]
    for i, (a, b) in enumerate(zip(logits["triton"], logits["numpy"])):
        check(f"logits at {i}", a, b, 1e-4)


def test_fp8_muon_steps_match_numpy() -> None:
    """precision fp8 (E4M3 block linears and untied head; fp32 activations, which the interpreter runs and the NumPy
    reference specifies without bf16's rounding): two whole steps under Muon on both backends, the same losses and
    weights; the weights' E4M3 copies follow the masters through the cast's own amax pass."""
    m = dataclasses.replace(M, vocab_size=64)  # a multiple of 16: the head's logits GEMM in E4M3 too
    t = TrainConfig(
        micro_batch=B,
        n_micro=2,
        precision="fp8",
        optimizer="muon",
        lr=0.05,
        head_lr=0.01,
        muon_lr=0.03,
        weight_decay=0.0,
    )
    rng = np.random.default_rng(6)
    draw = lambda: rng.integers(0, m.vocab_size, (B, m.seq_len)).astype(np.int32)  # noqa: E731
    steps = [[(draw(), draw()) for _ in range(t.n_micro)] for _ in range(2)]
    out = {}
    for name, K in (
        ("numpy", backend.numpy_backend(precision_name="fp8")),
        ("triton", backend.triton_backend("fp8", compute="fp32")),
    ):
        S = make_state(m, t, K)
        step = Step(S)
        out[name] = (S, [step(batches, t.lr) for batches in steps])
    (Sn, rn), (St, rt) = out["numpy"], out["triton"]
    for a, b in zip(rt, rn):
        assert abs(a.loss - b.loss) < 1e-3 * abs(b.loss), (a.loss, b.loss)
    check("p", St.K.to_numpy(St.p), Sn.p, 1e-3)
