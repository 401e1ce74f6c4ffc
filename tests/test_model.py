"""The whole model against a PyTorch twin of the same architecture (written here, autograd as the oracle).

Layer 2 of the test pyramid: loss and every parameter gradient of a 2-layer model, in float64 (the op
pairs' arithmetic is then exact to ~1e-12, so any wiring mistake shows), and in float32 as trained.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt import config
from microgpt.config import ModelConfig
from microgpt.engine import collectives, memory, model, params
from microgpt.engine.backend import numpy_backend

M = ModelConfig(vocab_size=61, d_model=24, n_layer=2, n_head=3, seq_len=11)
B = 3


def torch_twin_loss(P: dict[str, torch.Tensor], m: ModelConfig, tokens: torch.Tensor, targets: torch.Tensor):
    """GPT-2 forward with [in, out] weights, no linear biases, tied LM head, mean loss over valid targets."""
    Bn, T = tokens.shape
    C, H = m.d_model, m.n_head
    x = P["wte"][tokens] + P["wpe"][:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in range(m.n_layer):
        h = f"h{layer}."
        a = F.layer_norm(x, (C,), P[h + "ln1_w"], P[h + "ln1_b"], eps=1e-5)
        q, k, v = ((a @ P[h + n]).view(Bn, T, H, C // H).transpose(1, 2) for n in ("w_q", "w_k", "w_v"))
        s = (q @ k.transpose(-1, -2)) / (C // H) ** 0.5
        y = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + y.transpose(1, 2).reshape(Bn, T, C) @ P[h + "w_o"]
        a = F.layer_norm(x, (C,), P[h + "ln2_w"], P[h + "ln2_b"], eps=1e-5)
        x = x + F.gelu(a @ P[h + "w_1"], approximate="tanh") @ P[h + "w_2"]
    x = F.layer_norm(x, (C,), P["lnf_w"], P["lnf_b"], eps=1e-5)
    logits = x @ P["wte"].T
    return F.cross_entropy(logits.view(-1, m.vocab_size), targets.view(-1), ignore_index=-1)


def engine_state(dtype: type, seed: int):
    """A NumPy-backend arena in `dtype`, params initialised then perturbed so LN weights are not all ones."""
    K = numpy_backend({"f32": dtype, "compute": dtype, "i32": np.int32, "u8": np.uint8})
    t = config.TrainConfig(micro_batch=B)
    arena = memory.Arena(memory.plan(M, t, K.precision, 7), K)
    K, _ = K.bind(arena, M)
    rng = np.random.default_rng(seed)
    flat = arena.flat("params")
    flat[...] = params.init_weights(M, seed) + rng.normal(0, 0.1, size=flat.shape)
    # named views; the model reads the attention's input projection as one (3, C, C) weight ("h{l}.w_qkv")
    P, G = params.views(flat, M), params.views(arena.flat("grads"), M)
    arena["tokens"][0] = rng.integers(0, M.vocab_size, size=(B, M.seq_len))
    targets = rng.integers(0, M.vocab_size, size=(B, M.seq_len))
    targets[0, :3] = -1  # ignored positions (loss masks) take part too
    arena["targets"][0] = targets
    arena["loss_scale"][0] = 1.0
    return K, arena, P, G


def check_close(name: str, got: np.ndarray, want: np.ndarray, tol: float) -> None:
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)
    assert np.isfinite(got).all() and err < tol, f"{name}: rel err {err:.2e}, max abs diff {np.abs(got - want).max()}"


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
def test_loss_and_every_gradient_match_torch(dtype: type, tol: float) -> None:
    K, A, P, G = engine_state(dtype, seed=0)
    names = [name for name, _ in params.param_shapes(M)]
    for name in names:  # gradients accumulate: start from noise and subtract it afterwards
        G[name][...] = np.random.default_rng(1).normal(size=G[name].shape)
    noise = {n: G[n].copy() for n in names}
    tokens, targets = A["tokens"][0], A["targets"][0]
    model.gpt_forward(K, M, P, A, tokens, targets)  # evaluation: losses only, no gradient touched
    eval_losses = A["losses"].copy()
    for name in names:
        np.testing.assert_array_equal(G[name], noise[name], err_msg=f"evaluation forward wrote into grad {name}")
    model.gpt_forward(K, M, P, A, tokens, targets, G)  # training: the loss head's backward runs here
    np.testing.assert_array_equal(A["losses"], eval_losses)
    K.loss_sum(A["loss_sum"], A["losses"], targets.reshape(-1))
    total, count = A["loss_sum"]
    model.gpt_backward(K, M, P, G, A, tokens)

    TP = {n: torch.tensor(P[n], dtype=torch.float64, requires_grad=True) for n in names}
    loss = torch_twin_loss(TP, M, torch.tensor(tokens, dtype=torch.long), torch.tensor(targets, dtype=torch.long))
    loss.backward()
    check_close("loss", np.array(total / count), loss.detach().numpy(), tol)
    assert len(names) == 4 + 10 * M.n_layer
    for name in names:
        check_close(f"grad {name}", G[name] - noise[name], TP[name].grad.numpy(), tol)


def test_layer_done_comes_once_a_layer_when_its_gradients_are_final() -> None:
    """Data parallel starts the sum of layer l's bucket (collectives.grad_buckets) at layer_done(l), beside a later
    kernel: by then every gradient in the bucket must hold its final value, and each layer comes once, top first."""
    K, A, P, G = engine_state(np.float32, seed=0)
    grads, (layers, _) = A.flat("grads"), collectives.grad_buckets(M)
    seen: list[tuple[int, np.ndarray]] = []
    tokens, targets = A["tokens"][0], A["targets"][0]
    model.gpt_forward(K, M, P, A, tokens, targets, G)
    model.gpt_backward(K, M, P, G, A, tokens, lambda layer: seen.append((layer, grads[slice(*layers[layer])].copy())))
    assert [layer for layer, _ in seen] == list(reversed(range(M.n_layer)))
    for layer, at_call in seen:
        assert np.abs(at_call).max() > 0
        np.testing.assert_array_equal(at_call, grads[slice(*layers[layer])], err_msg=f"layer {layer}")
