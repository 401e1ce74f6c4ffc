"""The triton backend end to end on a tiny model: forward, backward and one whole step against the NumPy backend."""

import numpy as np
import torch

from microgpt import memory, model
from microgpt.backend import numpy_backend
from microgpt.config import ModelConfig, TrainConfig
from microgpt.kernels import TritonBackend
from microgpt.kernels.step import GraphStep
from microgpt.ops import adamw_step

from ._kutil import ON_GPU, check

M = ModelConfig(vocab_size=61, d_model=16, n_layer=2, n_head=2, seq_len=16)
B = 2


def _setup(K, seed=0):
    bufs = memory.plan(M, B, logits_rows=12)  # 32 rows in 3 chunks, the last one short
    A = memory.Arena(bufs, K.alloc)
    host = {name: np.zeros(shape, np.float32) for name, shape in memory.param_shapes(M)}
    model.init_params(host, M, np.random.default_rng(seed))
    for name, p in host.items():
        p += np.random.default_rng(len(name)).standard_normal(p.shape).astype(np.float32) * 0.05  # LN params off 1/0
    K.copy_in(A.flat_f32("params"), np.concatenate([a.reshape(-1) for a in host.values()]))
    mask = np.concatenate([np.full(a.size, a.ndim == 2, np.uint8) for a in host.values()])
    K.copy_in(A["decay_mask"], mask)
    return A


def _batch(rng):
    x = rng.integers(0, M.vocab_size, size=(B, M.seq_len)).astype(np.int32)
    y = rng.integers(0, M.vocab_size, size=(B, M.seq_len)).astype(np.int32)
    y[0, :3] = -1
    return x, y


def test_forward_backward_matches_numpy() -> None:
    Kn, Kt = numpy_backend(), TritonBackend("fp32")
    An, At = _setup(Kn), _setup(Kt)
    x, y = _batch(np.random.default_rng(1))
    for K, A in ((Kn, An), (Kt, At)):
        K.copy_in(A["tokens"], x)
        K.copy_in(A["targets"], y)
        model.gpt_forward(K, M, A.role("params"), A, A.role("grads"))
        model.gpt_backward(K, M, A.role("params"), A.role("grads"), A)
    check("losses", Kt.to_numpy(At["losses"]), An["losses"], 1e-5)
    assert abs(Kt.loss_sum(At["losses"], At["targets"].reshape(-1))[0] - An["losses"].sum()) < 1e-4
    gn, gt = An.role("grads"), At.role("grads")
    for name in gn:
        check(name, Kt.to_numpy(gt[name]), gn[name], 1e-4)


def test_graph_step_eager_matches_numpy_step() -> None:
    """GraphStep's device-side scale/clip/AdamW (eager here; the same body is what the GPU captures)."""
    t = TrainConfig(micro_batch=B, n_micro=2, grad_clip=0.05, weight_decay=0.1)
    rng = np.random.default_rng(2)
    batches = [_batch(rng) for _ in range(t.n_micro)]
    Kn = numpy_backend()
    An = _setup(Kn)
    Pn, Gn, g = An.role("params"), An.role("grads"), An.flat_f32("grads")
    loss, micro_losses = 0.0, []
    for x, y in batches:
        An["tokens"][...], An["targets"][...] = x, y
        model.gpt_forward(Kn, M, Pn, An, Gn)
        micro_losses.append(Kn.loss_sum(An["losses"], An["targets"].reshape(-1))[0] / (y >= 0).sum())
        loss += micro_losses[-1] / t.n_micro
        model.gpt_backward(Kn, M, Pn, Gn, An)
    g *= 1.0 / t.n_micro
    norm = float(np.sqrt((g.astype(np.float64) ** 2).sum()))
    g *= min(1.0, t.grad_clip / (norm + 1e-6))
    p = An.flat_f32("params")
    adamw_step(p, g, An.flat_f32("adam_m"), An.flat_f32("adam_v"), An["decay_mask"], 1e-3, t.beta1, t.beta2, t.eps,
               t.weight_decay, 1)  # fmt: skip

    Kt = TritonBackend("fp32")
    At = _setup(Kt)
    step = GraphStep(Kt, M, t, At, use_graph=ON_GPU)
    got_loss, got_norm = step.step(batches, 1e-3, 1)
    assert abs(got_loss - loss) < 1e-5 * abs(loss)
    np.testing.assert_allclose(step.micro_losses, micro_losses, rtol=1e-5)  # per micro-batch: the data mixture's
    assert abs(got_norm - norm) < 1e-4 * norm
    check("params", Kt.to_numpy(At.flat_f32("params")), p, 1e-5)
    assert not Kt.to_numpy(At.flat_f32("grads")).any(), "the step leaves the grads zeroed"


def test_graph_step_fp16_copy_follows_master() -> None:
    """fp16 compute: the step keeps a compute copy of the weights equal to the rounded fp32 masters."""
    t = TrainConfig(micro_batch=B, n_micro=1)
    Kt = TritonBackend("fp16")
    At = _setup(Kt)
    step = GraphStep(Kt, M, t, At, use_graph=ON_GPU)
    loss, norm = step.step([_batch(np.random.default_rng(3))], 1e-3, 1)
    assert np.isfinite(loss) and np.isfinite(norm)
    p = At.flat_f32("params")
    assert torch.equal(step.p_lp, p.to(torch.float16))


def test_trainer_on_triton_matches_numpy(tmp_path) -> None:
    """The engine's Trainer on the triton backend (fp32, GraphStep) follows the NumPy backend's loss line."""
    from microgpt import config, engine
    from tests.conftest import TINY

    small = {"vocab_size": 256, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16}  # the interpreter is slow
    raw = {**TINY, "model": small, "train": {**TINY["train"], "steps": 2, "n_micro": 2, "micro_batch": 2}}
    losses = {}
    for backend in ("numpy", "triton"):
        exp = config.from_dict({**raw, "train": {**raw["train"], "backend": backend}})
        tr = engine.Trainer(exp, tmp_path / backend)
        losses[backend] = [tr.train_step()["loss"] for _ in range(2)]
    np.testing.assert_allclose(losses["triton"], losses["numpy"], rtol=2e-5)
    tr.evaluate()
    # the plan the CLI prints counts the launchers' scratch before step 1: the same bytes they took since
    assert tr.K.plan_extras(tr.m, tr.t)["kernel scratch"] == tr.K.extra_bytes


def test_checkpoints_cross_backends(tmp_path) -> None:
    """One checkpoint format for every backend: a triton checkpoint resumes on NumPy and the reverse, and the
    resumed steps follow the uninterrupted NumPy run."""
    from microgpt import config, engine
    from tests.conftest import TINY

    small = {"vocab_size": 256, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16}
    raw = {**TINY, "model": small, "train": {**TINY["train"], "steps": 4, "n_micro": 1, "micro_batch": 2}}

    def trainer(backend: str, out: str) -> engine.Trainer:
        return engine.Trainer(config.from_dict({**raw, "train": {**raw["train"], "backend": backend}}), tmp_path / out)

    ref = trainer("numpy", "ref")
    want = [ref.train_step()["loss"] for _ in range(4)]
    for first, second in (("triton", "numpy"), ("numpy", "triton")):
        a = trainer(first, f"{first}-then-{second}")
        for _ in range(2):
            a.train_step()
        path = a.save("periodic")
        b = trainer(second, f"{second}-from-{first}")
        b.load(path)
        assert b.step == 2
        got = [b.train_step()["loss"] for _ in range(2)]
        np.testing.assert_allclose(got, want[2:], rtol=2e-5, err_msg=f"{first} checkpoint resumed on {second}")


def test_fp16_loss_scale_state_travels_with_the_checkpoint(tmp_path) -> None:
    """fp16: the loss scale and its growth counter go into the sidecar and come back on load (bit-exact resume)."""
    from microgpt import checkpoint, config, engine
    from tests.conftest import TINY

    small = {"vocab_size": 256, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16}
    train = {**TINY["train"], "steps": 4, "n_micro": 1, "micro_batch": 2, "backend": "triton", "precision": "fp16"}
    exp = config.from_dict({**TINY, "model": small, "train": train})
    a = engine.Trainer(exp, tmp_path / "a")
    for _ in range(2):
        a.train_step()
    a.K.loss_scale = 512.0  # as if overflows had lowered it
    path = a.save("periodic")
    side = checkpoint.read_sidecar(path)
    assert side["loss_scale"] == 512.0 and side["loss_scale_good_steps"] == a.fast.good_steps == 2
    b = engine.Trainer(exp, tmp_path / "b")
    b.load(path)
    assert b.K.loss_scale == 512.0 and b.fast.good_steps == 2
