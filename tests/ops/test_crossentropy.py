"""crossentropy pair (fused LM head) against F.cross_entropy(reduction="none") over x @ wte.T, and over its soft-capped
logits softcap * tanh(x @ wte.T / softcap)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt.ops.crossentropy import (
    crossentropy_backward,
    crossentropy_forward,
    crossentropy_forward_backward,
    head_logits,
)
from microgpt.ops.linear import Matmul

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt

# (N, C, V, R): R not dividing N, R = 1, R = N, R > N (one short chunk).
SHAPES = [(21, 12, 37, 8), (1, 1, 3, 1), (13, 16, 50, 13), (10, 8, 37, 64), (35, 7, 11, 4)]


def make_inputs(rng: np.random.Generator, N: int, C: int, V: int) -> dict:
    targets = rng.integers(0, V, size=N).astype(np.int32)
    targets[rng.random(N) < 0.25] = -1  # ignored positions (padding, or a masked prompt)
    if N > 1:
        targets[0] = -1  # at least one ignored and one scored row
        targets[-1] = V - 1
    return {
        "x": rng.standard_normal((N, C)),
        "wte": rng.standard_normal((V, C)),
        "targets": targets,
        "dlosses": rng.standard_normal(N),  # non-zero on ignored rows too: backward must drop them
    }


def torch_reference(inp: dict, softcap: float = 0.0) -> dict:
    x, wte = tt(inp["x"]), tt(inp["wte"])
    logits = x @ wte.T
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    targets = torch.from_numpy(inp["targets"]).long()
    losses = F.cross_entropy(logits, targets, reduction="none", ignore_index=-1)
    (losses * torch.from_numpy(inp["dlosses"])).sum().backward()
    return {"losses": losses, "lse": torch.logsumexp(logits, dim=1), "dx": x.grad, "dwte": wte.grad}


def run_numpy(inp: dict, R: int, dtype, grads: dict, rng: np.random.Generator, softcap: float = 0.0) -> dict:
    x, wte, dlosses = (inp[k].astype(dtype) for k in ("x", "wte", "dlosses"))
    targets = inp["targets"]
    N, V = x.shape[0], wte.shape[0]
    losses, lse = noise_like(rng, N, dtype), noise_like(rng, N, dtype)  # forward writes with =
    logits = noise_like(rng, (R, V), dtype)  # scratch: its contents must not matter
    crossentropy_forward(losses, lse, x, wte, targets, logits, mm=Matmul(), softcap=softcap)
    logits[...] = noise_like(rng, (R, V), dtype)
    crossentropy_backward(
        grads["dx"], grads["dwte"], dlosses, x, wte, targets, lse, logits, mm=Matmul(), softcap=softcap
    )
    return {"losses": losses, "lse": lse, **grads}


def run_numpy_fused(inp: dict, R: int, dtype, grads: dict, rng: np.random.Generator, softcap: float = 0.0) -> dict:
    """The training path: crossentropy_forward_backward, both halves in one call."""
    x, wte, dlosses = (inp[k].astype(dtype) for k in ("x", "wte", "dlosses"))
    N, V = x.shape[0], wte.shape[0]
    losses, lse = noise_like(rng, N, dtype), noise_like(rng, N, dtype)
    logits = noise_like(rng, (R, V), dtype)
    crossentropy_forward_backward(
        losses, lse, grads["dx"], grads["dwte"], dlosses, x, wte, inp["targets"], logits, mm=Matmul(), softcap=softcap
    )
    return {"losses": losses, "lse": lse, **grads}


def grad_shapes(inp: dict) -> dict:
    return {"dx": inp["x"].shape, "dwte": inp["wte"].shape}


@pytest.mark.parametrize("run", [run_numpy, run_numpy_fused], ids=["pair", "forward_backward"])
@pytest.mark.parametrize("N,C,V,R", SHAPES)
def test_crossentropy_float64(N: int, C: int, V: int, R: int, run) -> None:
    rng = np.random.default_rng(1300 + N * C * V + R)
    inp = make_inputs(rng, N, C, V)
    noise = {k: noise_like(rng, s, np.float64) for k, s in grad_shapes(inp).items()}
    got = run(inp, R, np.float64, {k: v.copy() for k, v in noise.items()}, rng)
    ref = torch_reference(inp)
    check_outputs_and_added_grads(got, ref, noise, ("losses", "lse"), F64_TOL)
    assert np.all(got["losses"][inp["targets"] < 0] == 0.0), "ignored rows must have loss 0"


@pytest.mark.parametrize("run", [run_numpy, run_numpy_fused], ids=["pair", "forward_backward"])
@pytest.mark.parametrize("N,C,V,R", SHAPES)
def test_crossentropy_float32(N: int, C: int, V: int, R: int, run) -> None:
    rng = np.random.default_rng(1400 + N * C * V + R)
    inp = make_inputs(rng, N, C, V)
    inp = {k: (v.astype(np.float32).astype(np.float64) if v.dtype == np.float64 else v) for k, v in inp.items()}
    got = run(inp, R, np.float32, {k: np.zeros(s, np.float32) for k, s in grad_shapes(inp).items()}, rng)
    ref = torch_reference(inp)
    for k in ref:
        check(k, got[k], ref[k], F32_TOL)


@pytest.mark.parametrize("run", [run_numpy, run_numpy_fused], ids=["pair", "forward_backward"])
def test_crossentropy_all_ignored(run) -> None:
    """A microbatch with every target ignored: zero losses, and backward adds exactly nothing."""
    rng = np.random.default_rng(1500)
    inp = make_inputs(rng, 9, 6, 13)
    inp["targets"][:] = -1
    noise = {k: noise_like(rng, s, np.float64) for k, s in grad_shapes(inp).items()}
    got = run(inp, 4, np.float64, {k: v.copy() for k, v in noise.items()}, rng)
    np.testing.assert_array_equal(got["losses"], 0.0)
    for k in noise:
        np.testing.assert_array_equal(got[k], noise[k])


# caps under the logits' spread (x @ wte.T ~ N(0, C) here: tanh saturates) and above it (nearly linear)
SOFTCAPS = [2.5, 15.0]


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("run", [run_numpy, run_numpy_fused], ids=["pair", "forward_backward"])
@pytest.mark.parametrize("N,C,V,R", SHAPES)
def test_crossentropy_softcap_float64(N: int, C: int, V: int, R: int, run, softcap: float) -> None:
    rng = np.random.default_rng(1600 + N * C * V + R)
    inp = make_inputs(rng, N, C, V)
    noise = {k: noise_like(rng, s, np.float64) for k, s in grad_shapes(inp).items()}
    got = run(inp, R, np.float64, {k: v.copy() for k, v in noise.items()}, rng, softcap)
    ref = torch_reference(inp, softcap)
    check_outputs_and_added_grads(got, ref, noise, ("losses", "lse"), F64_TOL)
    assert np.all(got["losses"][inp["targets"] < 0] == 0.0), "ignored rows must have loss 0"


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("run", [run_numpy, run_numpy_fused], ids=["pair", "forward_backward"])
@pytest.mark.parametrize("N,C,V,R", SHAPES)
def test_crossentropy_softcap_float32(N: int, C: int, V: int, R: int, run, softcap: float) -> None:
    rng = np.random.default_rng(1700 + N * C * V + R)
    inp = make_inputs(rng, N, C, V)
    inp = {k: (v.astype(np.float32).astype(np.float64) if v.dtype == np.float64 else v) for k, v in inp.items()}
    got = run(inp, R, np.float32, {k: np.zeros(s, np.float32) for k, s in grad_shapes(inp).items()}, rng, softcap)
    ref = torch_reference(inp, softcap)
    for k in ref:
        check(k, got[k], ref[k], F32_TOL)


@pytest.mark.parametrize("softcap", [0.0, *SOFTCAPS])
def test_head_logits(softcap: float) -> None:
    """The inference step's next-token logits: x @ wte.T, capped as the loss caps them."""
    rng = np.random.default_rng(1800)
    x, wte = rng.standard_normal((3, 7)), rng.standard_normal((37, 7))
    out = noise_like(rng, (3, 37), np.float64)
    head_logits(out, x, wte, mm=Matmul(), softcap=softcap)
    z = torch.from_numpy(x @ wte.T)
    check("logits", out, softcap * torch.tanh(z / softcap) if softcap else z, F64_TOL)
