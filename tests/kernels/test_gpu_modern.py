"""The modern block's own kernels on the GPU at its ANDREA-120M shape (C 768, H 6, T 1024, V 50304, softcap 15)
against their NumPy pairs in float64, fed the same rounded inputs: rmsnorm (and its residual entry point), relu2, the
embedding without a position table (and the decode step's), the soft-capped loss head.

Run on the GPU machine: MICROGPT_TEST_GPU=1 python3 -m pytest -m gpu tests/kernels/test_gpu_modern.py
Relative error ||got - ref|| / ||ref||: fp32 under 1e-5, bf16 under 1e-2. Gradient buffers start as noise (at the
gradient's scale where the buffer is bf16) to prove the +=.
"""

import numpy as np
import pytest
import torch

from microgpt.ops import crossentropy as ref_ce
from microgpt.ops import decode as ref_decode
from microgpt.ops import embedding as ref_emb
from microgpt.ops import relu2 as ref_relu2
from microgpt.ops import rmsnorm as ref_rms

from ._kutil import MM, ON_GPU, REF_MM, TUNER, check, h, rounded, t

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs CUDA")]

B, T, C, NH, V = 4, 1024, 768, 6, 50304
N = B * T
SOFTCAP = 15.0
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def close(name: str, got: torch.Tensor | np.ndarray, want: np.ndarray, dtype: torch.dtype) -> None:
    check(f"{name} ({dtype})", h(got) if isinstance(got, torch.Tensor) else got, want, TOL[dtype])


def noise(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    """Device noise of shape in dtype, for a buffer a kernel must overwrite."""
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_modern_gpu(dtype):
    from microgpt.kernels import rmsnorm as k

    rng = np.random.default_rng(0)
    x, y, dout = (rounded(rng.standard_normal((N, C)) * 2 + 0.5, dtype) for _ in range(3))
    dx0 = rounded(rng.standard_normal((N, C)), dtype)
    out, rstd, dx = np.empty((N, C)), np.empty(N), dx0.copy()
    ref_rms.rmsnorm_forward(out, rstd, x)
    ref_rms.rmsnorm_backward(dx, dout, x, rstd)
    gout, grstd = noise(rng, N, C).to(dtype), noise(rng, N)
    k.rmsnorm_forward(gout, grstd, t(x, dtype), tuner=TUNER)
    close("out", gout, out, dtype)
    close("rstd", grstd, rstd, torch.float32)
    gdx = t(dx0, dtype)
    k.rmsnorm_backward(gdx, t(dout, dtype), t(x, dtype), grstd, tuner=TUNER)
    close("dx", gdx, dx, dtype)
    # the residual entry point: the sum as stored, normalized
    s = rounded(x + y, dtype)
    ref_rms.rmsnorm_forward(out, rstd, s)
    gs = noise(rng, N, C).to(dtype)
    k.residual_rmsnorm_forward(gs, gout, grstd, t(x, dtype), t(y, dtype), tuner=TUNER)
    close("s", gs, s, dtype)
    close("residual out", gout, out, dtype)
    close("residual rstd", grstd, rstd, torch.float32)


def test_rmsnorm_every_configuration_gpu(monkeypatch):
    """Each launch configuration the warm-up may choose for the RMSNorm forward and backward, forced, in bf16."""
    from microgpt.kernels import rmsnorm as k

    rng = np.random.default_rng(1)
    dtype = torch.bfloat16
    x, dout = (rounded(rng.standard_normal((N, C)) * 2 + 0.5, dtype) for _ in range(2))
    out, rstd, dx = np.empty((N, C)), np.empty(N), np.zeros((N, C))
    ref_rms.rmsnorm_forward(out, rstd, x)
    ref_rms.rmsnorm_backward(dx, dout, x, rstd)
    gx, gdout = t(x, dtype), t(dout, dtype)
    for name in k.FWD_CONFIGS:
        monkeypatch.setenv("MICROGPT_RMSNORM_FWD", name)
        monkeypatch.setenv("MICROGPT_RMSNORM_BWD", name)
        gout, grstd, gdx = noise(rng, N, C).to(dtype), noise(rng, N), torch.zeros(N, C, dtype=dtype, device="cuda")
        k.rmsnorm_forward(gout, grstd, gx, tuner=TUNER)
        k.rmsnorm_backward(gdx, gdout, gx, grstd, tuner=TUNER)
        close(f"{name}: out", gout, out, dtype)
        close(f"{name}: rstd", grstd, rstd, torch.float32)
        close(f"{name}: dx", gdx, dx, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu2_gpu(dtype):
    from microgpt.kernels import relu2 as k

    rng = np.random.default_rng(2)
    hh, da = rounded(rng.standard_normal((N, 4 * C)) - 0.2, dtype), rounded(rng.standard_normal((N, 4 * C)), dtype)
    a, dh = np.empty((N, 4 * C)), da.copy()
    ref_relu2.relu2_forward(a, hh)
    ref_relu2.relu2_backward_h(dh, hh)  # float64 from h: the kernel's from a rounds to it (ops/relu2.py)
    ga, gdh, gh = noise(rng, N, 4 * C).to(dtype), t(da, dtype), t(hh, dtype)
    k.relu2_forward(ga, gh)
    k.relu2_backward(gdh, ga)
    close("a", ga, a, dtype)
    close("dh", gdh, dh, dtype)


@pytest.mark.parametrize("chunk", [8192, 1024])  # one sort chunk; one chunk per sequence
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_without_positions_gpu(dtype, chunk):
    from microgpt.kernels import embedding as k

    rng = np.random.default_rng(3)
    tok = rng.integers(0, V, size=(B, T)).astype(np.int32)
    tok[0, :64] = 7  # a long run of one token
    wte, dout = rounded(rng.standard_normal((V, C)), dtype), rounded(rng.standard_normal((B, T, C)), dtype)
    out, dwte = np.empty((B, T, C)), np.zeros((V, C))
    ref_emb.embedding_forward(out, tok, wte)
    ref_emb.embedding_backward(dwte, None, dout, tok)
    gout = noise(rng, B, T, C).to(dtype)
    k.embedding_forward(gout, t(tok), t(wte, dtype))
    close("out", gout, out, dtype)
    dwte0 = noise(rng, V, C)
    gdwte = dwte0.clone()
    order = torch.empty(N, dtype=torch.int32, device="cuda")
    k.embedding_backward(gdwte, None, t(dout, dtype), t(tok), order=order, chunk=chunk, tuner=TUNER)
    close("dwte", h(gdwte) - h(dwte0), dwte, dtype)
    untouched = np.setdiff1d(np.arange(V), tok)
    assert torch.equal(gdwte[t(untouched).long()], dwte0[t(untouched).long()]), "rows no token hit must not move"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_embedding_without_positions_gpu(dtype):
    from microgpt.kernels import decode as k

    rng = np.random.default_rng(4)
    b = 32
    tokens, positions = rng.integers(0, V, b).astype(np.int32), rng.integers(0, T, b).astype(np.int32)
    wte = rounded(rng.standard_normal((V, C)), dtype)
    want = np.empty((b, C))
    ref_decode.decode_embedding(want, tokens, positions, wte)
    out = noise(rng, b, C).to(dtype)
    k.decode_embedding(out, t(tokens), t(positions), t(wte, dtype))
    np.testing.assert_array_equal(h(out), want)  # a gather: exact


def _loss_head_inputs(rng: np.random.Generator, n: int, dtype: torch.dtype):
    """x (n,C); an untied head (V,C) at the scale of test_gpu.py's head (logits of std 1.4: larger ones, rounded to
    the bf16 scratch, would alone take bf16's error towards 1e-2; the cap still bends the tails by a few percent,
    which fp32 resolves); targets with ignored rows; the mean loss's dlosses."""
    x, head = rounded(rng.standard_normal((n, C)), dtype), rounded(rng.standard_normal((V, C)) * 0.05, dtype)
    targets = rng.integers(0, V, size=n).astype(np.int32)
    targets[::7] = -1
    dlosses = np.where(targets >= 0, 1.0 / (targets >= 0).sum(), 0.0)
    return x, head, targets, dlosses


@pytest.mark.parametrize("dtype", DTYPES)
def test_crossentropy_softcap_gpu(dtype):
    """Two sequences in logits chunks of 1024 rows: the pair and the training call against the NumPy pair; the
    training call bit for bit the pair's."""
    from microgpt.kernels import crossentropy as k

    rng = np.random.default_rng(5)
    n, R = 2 * T, 1024
    x, head, targets, dlosses = _loss_head_inputs(rng, n, dtype)
    dx0 = rounded(rng.standard_normal((n, C)) * 1e-4, dtype)  # noise at the gradient's scale
    losses, lse, dx, dhead = np.empty(n), np.empty(n), dx0.copy(), np.zeros((V, C))
    ref_ce.crossentropy_forward(losses, lse, x, head, targets, np.empty((R, V)), mm=REF_MM, softcap=SOFTCAP)
    ref_ce.crossentropy_backward(
        dx, dhead, dlosses, x, head, targets, lse, np.empty((R, V)), mm=REF_MM, softcap=SOFTCAP
    )

    f32 = dict(dtype=torch.float32, device="cuda")
    gx, ghead, gt, gdl = t(x, dtype), t(head, dtype), t(targets), t(dlosses, torch.float32)
    logits = torch.empty(R, V, dtype=dtype, device="cuda")
    dhead0 = noise(rng, V, C) * 1e-4
    pair = [torch.empty(n, **f32), torch.empty(n, **f32), t(dx0, dtype), dhead0.clone()]
    k.crossentropy_forward(pair[0], pair[1], gx, ghead, gt, logits, mm=MM, tuner=TUNER, softcap=SOFTCAP)
    k.crossentropy_backward(pair[2], pair[3], gdl, gx, ghead, gt, pair[1], logits, mm=MM, tuner=TUNER, softcap=SOFTCAP)
    close("losses", pair[0], losses, dtype)
    close("lse", pair[1], lse, dtype)
    close("dx", pair[2], dx, dtype)
    close("dhead", h(pair[3]) - h(dhead0), dhead, dtype)
    fused = [torch.empty(n, **f32), torch.empty(n, **f32), t(dx0, dtype), dhead0.clone()]
    k.crossentropy_forward_backward(*fused, gdl, gx, ghead, gt, logits, mm=MM, tuner=TUNER, softcap=SOFTCAP)
    for name, a, b in zip(("losses", "lse", "dx", "dhead"), fused, pair):
        assert torch.equal(a, b), f"{name}: forward_backward differs from forward + backward"


def test_crossentropy_softcap_every_configuration_gpu():
    """Each launch configuration of the row kernel with the cap, on bf16 logits of the modern head's spread: loss,
    lse and the gradient of the uncapped logits against the NumPy pair (logits = I @ z^T: its head gradient is dz^T)."""
    from microgpt.kernels import crossentropy as k

    rng = np.random.default_rng(6)
    r, dtype = 64, torch.bfloat16
    z = rounded(rng.standard_normal((r, V)) * 3.0, dtype)
    targets = rng.integers(0, V, size=r).astype(np.int32)
    targets[5] = -1
    dloss = rng.random(r)
    loss, lse, dz_t = np.empty(r), np.empty(r), np.zeros((V, r))
    ref_ce.crossentropy_forward_backward(
        loss,
        lse,
        np.zeros((r, r)),
        dz_t,
        dloss,
        np.eye(r),
        z.T.copy(),
        targets,
        np.empty((r, V)),
        mm=REF_MM,
        softcap=SOFTCAP,
    )
    gz, gt, gdl = t(z, dtype), t(targets), t(dloss, torch.float32)
    for name, config in k.ROW_CONFIGS.items():
        g, gloss, glse = gz.clone(), torch.empty(r, device="cuda"), torch.empty(r, device="cuda")
        k.row_launch(gloss, glse, g, gt, gdl, V, *config, softcap=SOFTCAP)()
        close(f"{name}: lse", glse, lse, torch.float32)
        close(f"{name}: loss", gloss, loss, torch.float32)
        close(f"{name}: dz", g, dz_t.T, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_logits_softcap_gpu(dtype):
    from microgpt.kernels import crossentropy as k

    rng = np.random.default_rng(7)
    b = 32  # the decode step's rows
    x, head, _, _ = _loss_head_inputs(rng, b, dtype)
    want = np.empty((b, V))
    ref_ce.head_logits(want, x, head, mm=REF_MM, softcap=SOFTCAP)
    out = noise(rng, b, V).to(dtype)
    k.head_logits(out, t(x, dtype), t(head, dtype), mm=MM, softcap=SOFTCAP)
    close("logits", out, want, dtype)
