"""bench/torch_modern.py, the PyTorch twin of the modern recipe, against docs/ANDREA.md section 9 written out here in
NumPy float64: its forward (every op of the block: RMSNorm, QK-norm, rotate-half RoPE, causal attention, ReLU^2, untied
soft-capped head) on random weights in microgpt's [in, out] layout, its Muon step in that layout (momentum, Nesterov,
the tall transpose, Newton-Schulz, the update scale, weight decay), and its initial weights and schedule against the
engine's; and its loss and every gradient against the engine's (the NumPy backend in float64), with skips too."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from bench import torch_modern as tm
from microgpt.config import ModelConfig, TrainConfig
from microgpt.engine import params
from microgpt.engine.optim import lr_at, muon_momentum

M = ModelConfig(vocab_size=37, d_model=24, n_layer=2, n_head=2, seq_len=9, block="modern", softcap=3.0)  # D = 12
MV = dataclasses.replace(M, value_embeds=1)  # one value embedding, layers 0 and 1
MS1 = dataclasses.replace(M, skips=1)  # layer 1 adds skip_w[0] times the stream after layer 0: its own input
MS = dataclasses.replace(M, n_layer=4, skips=2)  # layer 3 adds the stream after layer 0, layer 2 its own input


def random_weights(rng: np.random.Generator, m: ModelConfig = M) -> dict[str, np.ndarray]:
    """Every parameter random (the zero-initialised ones too, so every branch counts), in microgpt's layout."""
    return {name: rng.normal(0.0, 0.4, size=shape) for name, shape in params.param_shapes(m)}


def rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + tm.EPS)


def reference_loss(w: dict[str, np.ndarray], idx: np.ndarray, targets: np.ndarray, softcap: float) -> float:
    """Section 9's model in NumPy float64; a value embedding "ve0" (k = 1) goes to the first and the last layer, and a
    skip "skip_w" (k = 1) adds skip_w[0] times the stream after the first layer to the last layer's input."""
    B, T = idx.shape
    C, H = M.d_model, M.n_head
    D = C // H
    angles = np.arange(T)[:, None] * 10000.0 ** (-2 * np.arange(D // 2) / D)
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]

    def rope(q: np.ndarray) -> np.ndarray:
        q1, q2 = q[..., : D // 2], q[..., D // 2 :]
        return np.concatenate([q1 * cos - q2 * sin, q2 * cos + q1 * sin], axis=-1)

    x = rms(w["wte"][idx])
    causal = np.tril(np.ones((T, T), dtype=bool))
    kept = None
    for layer in range(M.n_layer):
        if "skip_w" in w and layer == M.n_layer - 1:
            x = x + w["skip_w"][0] * kept
        n = rms(x)
        q, k, v = ((n @ w[f"h{layer}.w_{c}"]).reshape(B, T, H, D) for c in "qkv")
        if "ve0" in w and layer in (0, M.n_layer - 1):
            v = v + w["ve0"][idx].reshape(B, T, H, D)
        q, k = rope(rms(q)), rope(rms(k))
        s = np.where(causal, np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("bhts,bshd->bthd", p, v).reshape(B, T, C) @ w[f"h{layer}.w_o"]
        x = x + np.maximum(rms(x) @ w[f"h{layer}.w_1"], 0) ** 2 @ w[f"h{layer}.w_2"]
        kept = x if layer == 0 else kept
    z = rms(x) @ w["lm_head"].T
    z = softcap * np.tanh(z / softcap)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], -1).mean())


@pytest.mark.parametrize("m", [M, MV, MS1], ids=["plain", "value-embeds", "skips"])
def test_forward_is_moderns_math(m: ModelConfig) -> None:
    rng = np.random.default_rng(0)
    w = random_weights(rng, m)
    idx, targets = rng.integers(0, M.vocab_size, (3, M.seq_len)), rng.integers(0, M.vocab_size, (3, M.seq_len))
    model = tm.Modern(m).double()
    model.load_weights(w)
    got = model(torch.from_numpy(idx), torch.from_numpy(targets)).item()
    want = reference_loss(w, idx, targets, M.softcap)
    assert abs(got - want) / want < 1e-10, (got, want)
    short = reference_loss(w, idx[:, :5], targets[:, :5], M.softcap)  # rope's tables at positions 0..4
    assert model(torch.from_numpy(idx[:, :5]), torch.from_numpy(targets[:, :5])).item() == pytest.approx(short, 1e-10)


@pytest.mark.parametrize("m", [M, MV, MS], ids=["plain", "value-embeds", "skips"])
def test_loss_and_every_gradient_are_the_engines(m: ModelConfig) -> None:
    """The twin (eager, float64, autograd) against microgpt's training forward and backward (the NumPy backend in
    float64) on the same weights and batch, some targets ignored: the loss, and the gradient of every parameter in
    microgpt's layout, the skips' scalars included (the twin's rotary table rounded to fp32 as the engine's is)."""
    from microgpt.engine import model as engine
    from tests.test_model import check_close
    from tests.test_modern import engine_state

    K, A, P, G = engine_state(np.float64, 5, m)
    tokens, targets = A["tokens"][0], A["targets"][0]
    engine.gpt_forward(K, m, P, A, tokens, targets, G)
    engine.gpt_backward(K, m, P, G, A, tokens)
    K.loss_sum(A["loss_sum"], A["losses"], targets.reshape(-1))
    total, count = A["loss_sum"]
    names = [name for name, _ in params.param_shapes(m)]
    twin = tm.Modern(m).double()
    twin.load_weights({name: np.array(P[name]) for name in names})
    for table in (twin.cos, twin.sin):  # the engine's rotary table is one fp32 buffer: the same angles, rounded so
        table.copy_(table.float())
    loss = twin(torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(targets.astype(np.int64)))
    loss.backward()
    check_close("loss", np.array(total / count), loss.detach().numpy(), 1e-10)
    for name in names:
        view = twin.slot(name)
        grad = (grad_slot(twin, name) if view._base is not None else view.grad).detach()
        check_close(f"grad {name}", G[name], (grad.t() if "." in name else grad).numpy(), 1e-10)


def test_adamw_keeps_the_skips_at_the_head_s_lr_undecayed() -> None:
    """The twin's AdamW groups are the engine's ranges (engine/optim.adamw_ranges): the embedding at train.lr, the head
    and the skips' scalars at train.head_lr, the scalars undecayed (the engine's decay mask leaves out vectors)."""
    adamw = tm.make_adamw(tm.Modern(MS), TrainConfig(weight_decay=0.1))
    groups = [(g["name"], g["weight_decay"], [tuple(p.shape) for p in g["params"]]) for g in adamw.param_groups]
    V, C = M.vocab_size, M.d_model
    assert groups == [("adamw", 0.1, [(V, C)]), ("head", 0.1, [(V, C)]), ("head", 0.0, [(2,)])]


def reference_muon(
    W: np.ndarray, G: np.ndarray, Mo: np.ndarray, lr: float, mu: float, wd: float, ns_steps: int = 5
) -> None:
    """Section 9's Muon on one matrix W [in, out], in place on W and its momentum Mo (ns_steps: train.muon_ns_steps)."""
    Mo += (1 - mu) * (G - Mo)
    U = G + mu * (Mo - G)
    tall = W.shape[0] > W.shape[1]
    X = U.T if tall else U
    X = X / (np.linalg.norm(X) + tm.NORM_EPS)
    a, b, c = tm.NS_COEFFS
    for _ in range(ns_steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    W *= 1 - lr * wd
    W -= lr * math.sqrt(max(1.0, W.shape[1] / W.shape[0])) * (X.T if tall else X)


def grad_slot(model: tm.Modern, name: str) -> torch.Tensor:
    """The part of its stacked parameter's grad that holds microgpt's `name`'s gradient (transposed, as slot)."""
    view = model.slot(name)
    return view._base.grad.as_strided(view.shape, view.stride(), view.storage_offset())


@pytest.mark.parametrize("ns_steps", [5, 3])
def test_muon_step_is_moderns_update_in_microgpts_layout(ns_steps: int) -> None:
    """The twin's Muon step against section 9's, at the default Newton-Schulz steps and at train.muon_ns_steps 3
    (which a step of 5 would not match: checked on the last step's result)."""
    rng = np.random.default_rng(1)
    w = random_weights(rng)
    model = tm.Modern(M).double()
    model.load_weights(w)
    muon = tm.Muon(model, compiled=False, dtype=torch.float64, ns_steps=ns_steps)
    matrices = [name for name in w if "." in name]
    momentum = {name: np.zeros_like(w[name]) for name in matrices}
    for lr, mu, wd in ((0.05, 0.85, 0.1), (0.02, 0.95, 0.0)):  # the second step reads the first's momentum
        for p in (model.qkvo, model.fc, model.proj):
            p.grad = torch.zeros_like(p)
        for name in matrices:
            g = rng.normal(size=w[name].shape)
            grad_slot(model, name).copy_(torch.from_numpy(g).t())
            other = w[name].copy()
            reference_muon(other, g, momentum[name].copy(), lr, mu, wd, 8 - ns_steps)  # the other count: 3 or 5
            reference_muon(w[name], g, momentum[name], lr, mu, wd, ns_steps)
            assert np.abs(other - w[name]).max() / np.abs(w[name]).max() > 1e-6, name
        muon.step(lr, mu, wd)
    for name in matrices:
        got = model.slot(name).detach().t().numpy()
        assert np.abs(got - w[name]).max() / np.abs(w[name]).max() < 1e-10, name


def test_initial_weights_are_the_engines() -> None:
    """The twin starts from the engine's initial weights (engine/params.py), each in its slot of the stacked [out, in]
    parameters; the recipe's zero-initialised w_o, w_2 and lm_head make that the uniform prediction's loss."""
    engine = params.named(params.init_weights(M, 1337), M)
    weights = tm.initial_weights(M, 1337)
    assert [(n, w.shape) for n, w in weights.items()] == params.param_shapes(M)
    model = tm.Modern(M)
    model.load_weights(weights)
    for name, w in engine.items():
        got = model.slot(name).detach()
        np.testing.assert_array_equal((got.t() if "." in name else got).numpy(), w, err_msg=name)
        assert (not w.any()) == (name.rsplit(".", 1)[-1] in ("w_o", "w_2", "lm_head")), name
    assert weights["wte"].std() == pytest.approx(1.0, rel=0.05)
    assert weights["h0.w_1"].std() == pytest.approx(M.d_model**-0.5, rel=0.05)
    idx = torch.randint(0, M.vocab_size, (2, M.seq_len))
    assert model(idx, idx).item() == pytest.approx(math.log(M.vocab_size), rel=1e-6)  # the zero head: uniform


def test_warmdown_schedule_and_momentum() -> None:
    """The twin's schedule (engine/optim.py's lr_at and muon_momentum over its run's steps) in the warmdown shape."""
    t = TrainConfig(
        steps=100, lr=0.1, min_lr=0.01, warmup_steps=4, schedule="warmdown", warmdown_frac=0.25, muon_momentum_warmup=10
    )
    factors = [lr_at(s, tm.schedule(t, 100)) / t.lr for s in range(100)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0], rel=1e-12) and set(factors[4:75]) == {1.0}
    assert factors[75] == 1.0 and factors[99] == pytest.approx(1 - 0.9 * 24 / 25)
    assert all(a > b for a, b in zip(factors[75:], factors[76:]))  # a straight line down
    assert [muon_momentum(s, t) for s in (0, 5, 10, 50)] == pytest.approx([0.85, 0.9, 0.95, 0.95])


def test_schedule_is_the_engines() -> None:
    """The twin's schedule over `steps` from its first step is an engine run's of train.steps = steps, whatever phase
    start or schedule_steps the experiment names."""
    cases = (("warmdown", 100, 0, 0.3), ("warmdown", 37, 5, 0.3), ("warmdown", 20, 15, 0.5), ("cosine", 50, 3, 0.3))
    for name, steps, warmup, frac in cases:
        t = TrainConfig(
            steps=steps,
            lr=0.1,
            min_lr=0.01,
            warmup_steps=warmup,
            schedule=name,
            warmdown_frac=frac,
            muon_momentum_warmup=warmup,
        )
        twin = tm.schedule(dataclasses.replace(t, steps=1000, schedule_start=7, schedule_steps=500), steps)
        for s in range(steps):
            assert lr_at(s, twin) == lr_at(s, t), (name, s)
            assert muon_momentum(s, twin) == muon_momentum(s, t), (name, s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_twin_on_cuda_agrees_with_the_reference() -> None:
    """The GPU path: torch.compile of the model under bf16 autocast, and the compiled Muon update in bf16, against the
    float64 references above (bf16's tolerance)."""
    rng = np.random.default_rng(2)
    w = random_weights(rng)
    idx, targets = rng.integers(0, M.vocab_size, (3, M.seq_len)), rng.integers(0, M.vocab_size, (3, M.seq_len))
    model = tm.Modern(M).cuda()
    model.load_weights(w)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = torch.compile(model)(torch.from_numpy(idx).cuda(), torch.from_numpy(targets).cuda()).item()
    want = reference_loss(w, idx, targets, M.softcap)
    assert abs(got - want) / want < 2e-2, (got, want)
    muon = tm.Muon(model, compiled=True)
    momentum = {name: np.zeros_like(w[name]) for name in w if "." in name}
    for p in (model.qkvo, model.fc, model.proj):
        p.grad = torch.zeros_like(p)
    before = {name: model.slot(name).detach().t().cpu().numpy().astype(np.float64) for name in momentum}
    for name in momentum:
        g = rng.normal(size=w[name].shape)
        grad_slot(model, name).copy_(torch.from_numpy(g).t())
        reference_muon(before[name], g, momentum[name], 0.05, 0.9, 0.0)
    muon.step(0.05, 0.9, 0.0)
    for name in momentum:
        got_w = model.slot(name).detach().t().cpu().numpy()
        step_ref, step_got = before[name] - w[name], got_w - w[name]
        assert np.linalg.norm(step_got - step_ref) / np.linalg.norm(step_ref) < 3e-2, name


def test_the_twin_follows_the_engines_batch_warmup(tmp_path) -> None:
    """With a batch warmup the twin reads the engine's micro-batches of each step (1, 1, 2, 3, 3 of n_micro 3), its
    loss the mean over them: the engine's losses (fp32 both, rounding apart) and tokens; its calibration times whole
    steps (those after the warmup)."""
    from microgpt import config
    from microgpt.run import trainer
    from tests.conftest import TINY

    train = {**TINY["train"], "optimizer": "muon", "weight_decay": 0.0, "n_micro": 3, "micro_batch": 2}
    train.update(batch_warmup_steps=3, batch_warmup_start=1, steps=5)
    exp = config.from_dict({**TINY, "model": {**TINY["model"], "block": "modern", "n_head": 2}, "train": train})
    engine = trainer.Trainer(exp, tmp_path / "engine")
    want = [engine.train_step() for _ in range(5)]
    run = tm.Run(exp, "cpu", compiled=False)
    t = tm.schedule(run.t, 5)
    got = [run.step(s, t) for s in range(5)]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want] == [2 * 32 * c for c in (1, 1, 2, 3, 3)]
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * b["loss"], (a["step"], a["loss"], b["loss"])
    timed = []
    step = run.step
    run.step = lambda s, t: timed.append((s, run.micro.count(s))) or step(s, t)
    run.calibrate(1, 2)
    assert timed == [(3, 3), (4, 3), (5, 3)]


@pytest.mark.parametrize("window", [None, 2, 4])
def test_the_engine_is_the_twin_with_the_window_and_documents(window: int | None) -> None:
    """The whole modern model on the NumPy backend in float64 against the twin with the window and document masking
    (model.attn_window 4, model.doc_mask 0; the window buffer set to the schedule's earlier 2 as a step sets it): the
    loss and every parameter's gradient, the twin's attention under its explicit mask (attention_mask). To 1e-6: the
    engine's rotary table is rounded to float32 once (section 9), the twin's is float64; a mask off by one key moves
    them by 1e-2 and more."""
    from microgpt.engine import model as engine_model
    from tests.test_modern import MW, engine_state

    m = MW if window is not None else dataclasses.replace(MW, attn_window=0)
    K, A, P, G = engine_state(np.float64, 5, m)
    if window is not None:
        A["attn_window"][0] = window
    tokens, targets = A["tokens"][0], A["targets"][0]
    engine_model.gpt_forward(K, m, P, A, tokens, targets, G)
    engine_model.gpt_backward(K, m, P, G, A, tokens)
    K.loss_sum(A["loss_sum"], A["losses"], targets.reshape(-1))
    total, count = A["loss_sum"]

    twin = tm.Modern(m).double()
    twin.load_weights({name: np.array(P[name]) for name, _ in params.param_shapes(m)})
    idx = torch.from_numpy(tokens.astype(np.int64))
    mask = tm.attention_mask(m, idx, window)
    assert mask is not None and not mask[:, :, -1, :-1].all(), "the mask narrows the last row somewhere"
    loss = twin(idx, torch.from_numpy(targets.astype(np.int64)), mask)
    loss.backward()
    assert abs(total / count - loss.item()) < 1e-6 * loss.item()
    for name, _ in params.param_shapes(m):
        want = grad_slot(twin, name).t() if "." in name else twin.slot(name).grad
        assert np.linalg.norm(G[name] - want.numpy()) <= 1e-6 * np.linalg.norm(want.numpy()), name


def test_the_twins_mask_follows_the_engines_schedule() -> None:
    """Run.mask: the window of step s is engine/optim.py's attn_window_at (16 positions widening by 16 every 3 steps
    to the whole sequence of 48); without any lever, None (SDPA's causal kernel)."""
    from microgpt.engine.optim import attn_window_at

    m = dataclasses.replace(M, seq_len=48)
    t = TrainConfig(attn_window_start=16, attn_window_every=3)
    assert [attn_window_at(s, m, t) for s in (0, 2, 3, 5, 6, 100)] == [16, 16, 32, 32, 48, 48]
    idx = torch.randint(1, M.vocab_size, (2, 48))
    run = tm.Run.__new__(tm.Run)
    run.m, run.t = m, t
    for s, w in ((0, 16), (4, 32), (9, 48)):
        i, j = torch.arange(48)[:, None], torch.arange(48)[None, :]
        assert torch.equal(run.mask(idx, s)[0, 0], (j <= i) & (i - j < w)), s
    run.t = TrainConfig()
    assert run.mask(idx, 0) is None
