"""The triton backend end to end on a tiny model against the NumPy backend, through the same state, the same
step function and the same checkpoint; and the backend interface as the registry declares it."""

import dataclasses

import numpy as np
import torch

from microgpt import ops
from microgpt.config import ModelConfig, TrainConfig
from microgpt.engine import backend, memory, model, params
from microgpt.engine.infer import make_infer_state
from microgpt.engine.state import make_state
from microgpt.engine.step import Step

from ._kutil import check

M = ModelConfig(vocab_size=61, d_model=16, n_layer=2, n_head=2, seq_len=16)
B = 2


def _state(name: str, t: TrainConfig, seed: int = 0):
    """make_state on one backend, with the logits chunk forced to 12 rows (32 rows: 3 chunks, the last short)
    and the weights perturbed off their init (LN params off 1/0), the same on both backends."""
    K = backend.numpy_backend() if name == "numpy" else backend.triton_backend(t.precision)
    K = dataclasses.replace(K, logits_rows=lambda m, b: 12)
    S = make_state(M, dataclasses.replace(t, seed=seed), K)
    w = S.K.to_numpy(S.p).copy()
    w += np.random.default_rng(len(w)).standard_normal(w.shape).astype(np.float32) * 0.05
    S.K.copy_in(S.p, w)
    if S.p_compute is not None:
        S.K.copy_in(S.p_compute, w)
    return S


def _batch(rng):
    x = rng.integers(0, M.vocab_size, size=(B, M.seq_len)).astype(np.int32)
    y = rng.integers(0, M.vocab_size, size=(B, M.seq_len)).astype(np.int32)
    y[0, :3] = -1
    return x, y


def test_backend_fields_are_the_registry() -> None:
    """One declared interface: its op fields are exactly the registry's functions, and both halves have them."""
    fields = {f.name for f in dataclasses.fields(backend.Backend)}
    for row in [*ops.OPS.values(), *ops.HELPERS.values()]:
        for fn in row.functions:
            assert fn in fields, f"Backend lacks {fn}"
    named = {fn for row in [*ops.OPS.values(), *ops.HELPERS.values()] for fn in row.functions}
    K = backend.triton_backend("fp32")
    for fn in named:
        assert getattr(K, fn).__module__.startswith("microgpt.kernels."), fn


def test_forward_backward_matches_numpy() -> None:
    t = TrainConfig(micro_batch=B)
    Sn, St = _state("numpy", t), _state("triton", t)
    x, y = _batch(np.random.default_rng(1))
    for S in (Sn, St):
        K, A = S.K, S.arena
        K.copy_in(A["tokens"][0], x)
        K.copy_in(A["targets"][0], y)
        K.copy_in(A["loss_scale"], np.ones(1))
        model.gpt_forward(K, M, S.P_compute, A, A["tokens"][0], A["targets"][0], S.G)
        model.gpt_backward(K, M, S.P_compute, S.G, A, A["tokens"][0])
        K.loss_sum(A["loss_sum"], A["losses"], A["targets"][0].reshape(-1))
    check("losses", St.K.to_numpy(St.arena["losses"]), Sn.arena["losses"], 1e-5)
    check("loss sum", St.K.to_numpy(St.arena["loss_sum"]), Sn.arena["loss_sum"], 1e-5)
    for name in Sn.G:
        check(name, St.K.to_numpy(St.G[name]), Sn.G[name], 1e-4)


def test_one_step_function_gives_the_same_update_on_both_backends() -> None:
    """step.optimizer_step on NumPy and on Triton (interpreter in CI; eager or graph on the GPU): same loss, norm
    and per-micro-batch losses, same weights, m and v after two steps with clipping, grads left zero."""
    t = TrainConfig(micro_batch=B, n_micro=2, grad_clip=0.05, weight_decay=0.1)
    rng = np.random.default_rng(2)
    steps = [[_batch(rng) for _ in range(t.n_micro)] for _ in range(2)]
    results = {}
    for name in ("numpy", "triton"):
        S = _state(name, t)
        step = Step(S)
        res = [step(batches, 1e-3 * (i + 1)) for i, batches in enumerate(steps)]
        results[name] = (S, res)
    (Sn, rn), (St, rt) = results["numpy"], results["triton"]
    for a, b in zip(rt, rn):
        assert abs(a.loss - b.loss) < 1e-5 * abs(b.loss)
        assert abs(a.grad_norm - b.grad_norm) < 1e-4 * b.grad_norm
        np.testing.assert_allclose(a.micro_losses, b.micro_losses, rtol=1e-5)
    assert rn[0].grad_norm > t.grad_clip, "the clip should act"
    for name in ("p", "adam_m", "adam_v"):
        check(name, St.K.to_numpy(getattr(St, name)), getattr(Sn, name), 1e-4)
    assert St.step == Sn.step == 2
    assert not St.K.to_numpy(St.g).any(), "the step leaves the grads zeroed"


WARMUP = {"n_micro": 3, "batch_warmup_steps": 2, "batch_warmup_start": 1}  # steps of 1, 2, then 3 micro-batches


def test_batch_warmup_steps_match_numpy() -> None:
    """A batch warmup on Triton: steps of 1, 2 and 3 micro-batches (each count a prepared run of its own) give the
    NumPy backend's losses, norms, per-micro-batch losses and weights."""
    t = TrainConfig(micro_batch=B, grad_clip=0.05, weight_decay=0.1, **WARMUP)
    rng = np.random.default_rng(4)
    steps = [[_batch(rng) for _ in range(count)] for count in (1, 2, 3)]
    results = {}
    for name in ("numpy", "triton"):
        S = _state(name, t)
        step = Step(S)
        results[name] = (S, [step(batches, 1e-3) for batches in steps], sorted(step.runs))
    (Sn, rn, runs_n), (St, rt, runs_t) = results["numpy"], results["triton"]
    assert runs_n == runs_t == [1, 2, 3]
    for a, b, count in zip(rt, rn, (1, 2, 3)):
        assert len(a.micro_losses) == len(b.micro_losses) == count
        assert abs(a.loss - b.loss) < 1e-5 * abs(b.loss) and abs(a.loss - np.mean(a.micro_losses)) < 1e-6 * a.loss
        assert abs(a.grad_norm - b.grad_norm) < 1e-4 * b.grad_norm
    for name in ("p", "adam_m", "adam_v"):
        check(name, St.K.to_numpy(getattr(St, name)), getattr(Sn, name), 1e-4)


def test_fp16_warmup_step_is_the_step_of_its_count() -> None:
    """fp16 (loss scaling): a warmup step of one micro-batch, of a run of n_micro 3, is bit for bit the step of a
    run of n_micro 1 on the same batch: the loss head scales by the loss scale, gscale = 1 / (count x scale)
    divides it out with the step's own count."""
    batch = [_batch(np.random.default_rng(5))]
    got = {}
    for name, train in (("warmup", WARMUP), ("one", {"n_micro": 1})):
        S = _state("triton", TrainConfig(micro_batch=B, precision="fp16", backend="triton", **train))
        res = Step(S)(batch, 1e-3)
        got[name] = (res.loss, res.grad_norm, S.K.to_numpy(S.p).tobytes(), S.K.to_numpy(S.adam_v).tobytes())
    assert got["warmup"] == got["one"]


def test_fp16_compute_copy_follows_master() -> None:
    """fp16 compute: AdamW keeps the compute copy of the weights equal to the rounded fp32 masters."""
    S = _state("triton", TrainConfig(micro_batch=B, n_micro=1, precision="fp16", backend="triton"))
    res = Step(S)([_batch(np.random.default_rng(3))], 1e-3)
    assert np.isfinite(res.loss) and np.isfinite(res.grad_norm)
    assert torch.equal(S.p_compute, S.p.to(torch.float16))


def test_plan_is_every_byte_the_backend_uses() -> None:
    """The printed plan's total is the arena plus the runtime rows; the launchers' scratch are planned views (a
    training plan's and an inference plan's)."""
    t = TrainConfig(micro_batch=B, n_micro=3, precision="fp16", backend="triton")
    S = make_state(M, t, backend.triton_backend("fp16"))
    sizes = memory.role_bytes(S.plan, S.K.precision)
    runtime = sum(b.numel for b in S.plan if b.role == "runtime")
    assert sum(sizes.values()) == S.arena.nbytes + runtime
    assert S.arena.pool.numel() == S.arena.nbytes
    assert sizes["kernel"] > 0 and sizes["compute_params"] == (params.n_params(M) * 2 + 255) // 256 * 256
    inf = make_infer_state(M, backend.triton_backend("fp16"), 3, params.init_weights(M, 0))
    # a training plan has the backward's scratch, an inference plan the decode step's
    for St, bufs in ((S, {"emb_order", "ln_partials", "att_delta"}), (inf, {"dec_partials"})):
        lo, hi = St.arena.pool.data_ptr(), St.arena.pool.data_ptr() + St.arena.nbytes
        assert {buf for _, _, buf in St.K.scratch_args if buf in St.arena} == bufs
        for fn, kw, buf in St.K.scratch_args:
            if buf in bufs:
                view = getattr(St.K, fn).keywords[kw]
                assert view is St.arena[buf] and lo <= view.data_ptr() < hi, (fn, buf)
    assert S.arena["tokens"].shape == (3, B, M.seq_len)


def test_trainer_on_triton_matches_numpy(tmp_path) -> None:
    """The Trainer on the triton backend (fp32) follows the NumPy backend's loss line and validation loss."""
    from microgpt import config
    from microgpt.run import trainer
    from tests.conftest import TINY

    small = {"vocab_size": 256, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16}  # the interpreter is slow
    raw = {**TINY, "model": small, "train": {**TINY["train"], "steps": 2, "n_micro": 2, "micro_batch": 2}}
    losses, val = {}, {}
    for name in ("numpy", "triton"):
        exp = config.from_dict({**raw, "train": {**raw["train"], "backend": name}})
        tr = trainer.Trainer(exp, tmp_path / name)
        losses[name] = [tr.train_step()["loss"] for _ in range(2)]
        val[name] = tr.evaluate()["val_loss"]
    np.testing.assert_allclose(losses["triton"], losses["numpy"], rtol=2e-5)
    assert abs(val["triton"] - val["numpy"]) < 2e-5 * val["numpy"]


def test_checkpoints_cross_backends(tmp_path) -> None:
    """One checkpoint format for every backend: a triton checkpoint resumes on NumPy and the reverse, and the
    resumed steps follow the uninterrupted NumPy run."""
    from microgpt import config
    from microgpt.run import trainer
    from tests.conftest import TINY

    small = {"vocab_size": 256, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16}
    raw = {**TINY, "model": small, "train": {**TINY["train"], "steps": 4, "n_micro": 1, "micro_batch": 2}}

    def make(name: str, out: str) -> trainer.Trainer:
        return trainer.Trainer(config.from_dict({**raw, "train": {**raw["train"], "backend": name}}), tmp_path / out)

    ref = make("numpy", "ref")
    want = [ref.train_step()["loss"] for _ in range(4)]
    for first, second in (("triton", "numpy"), ("numpy", "triton")):
        a = make(first, f"{first}-then-{second}")
        for _ in range(2):
            a.train_step()
        path = a.save("periodic")
        b = make(second, f"{second}-from-{first}")
        b.load(path)
        assert b.step == 2
        got = [b.train_step()["loss"] for _ in range(2)]
        np.testing.assert_allclose(got, want[2:], rtol=2e-5, err_msg=f"{first} checkpoint resumed on {second}")


def test_fp16_loss_scale_state_travels_with_the_checkpoint(tmp_path) -> None:
    """fp16: the loss scale and its growth counter go into the sidecar and come back on load (bit-exact resume)."""
    from microgpt import checkpoint, config
    from microgpt.run import trainer
    from tests.conftest import TINY

    small = {"vocab_size": 256, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16}
    train = {**TINY["train"], "steps": 4, "n_micro": 1, "micro_batch": 2, "backend": "triton", "precision": "fp16"}
    exp = config.from_dict({**TINY, "model": small, "train": train})
    a = trainer.Trainer(exp, tmp_path / "a")
    for _ in range(2):
        a.train_step()
    a.S.scaler.scale = 512.0  # as if overflows had lowered it
    path = a.save("periodic")
    side = checkpoint.read_sidecar(path)
    assert side["loss_scale"] == 512.0 and side["loss_scale_good_steps"] == a.S.scaler.good_steps == 2
    b = trainer.Trainer(exp, tmp_path / "b")
    b.load(path)
    assert b.S.scaler.scale == 512.0 and b.S.scaler.good_steps == 2


def test_inference_step_matches_numpy() -> None:
    """The inference step (model.gpt_infer) on the triton backend against the NumPy one, fp32, same weights: a
    prefill's losses, then its next-token logits, then two decode steps over the KV cache (the cached attention
    kernel), a window of three at a later position, and a decode step whose rows are at positions of their own in
    permuted cache rows (serving's continuous batching), one of them a prefill from position 0."""
    from microgpt.engine.infer import make_infer_state

    w = params.init_weights(M, 3)
    w += np.random.default_rng(4).standard_normal(w.shape).astype(np.float32) * 0.05
    rng = np.random.default_rng(5)
    x = rng.integers(0, M.vocab_size, (B, 9)).astype(np.int32)
    y = rng.integers(0, M.vocab_size, (B, 9)).astype(np.int32)
    got = {}
    for name, K in (("numpy", backend.numpy_backend()), ("triton", backend.triton_backend("fp32"))):
        S = make_infer_state(M, K, B, w)
        A, out = S.arena, []
        tokens, targets = S.inputs(B, 9)
        S.K.copy_in(tokens, x)
        S.K.copy_in(targets, y)
        S.run(tokens, 0, targets)
        out.append(S.K.to_numpy(A["losses"][: B * 9]).copy())
        S.run(tokens, 0)
        out.append(S.K.to_numpy(A["next_logits"]).copy())
        for pos, n in ((9, 1), (10, 1), (11, 3)):
            window, _ = S.inputs(B, n)
            S.K.copy_in(window, x[:, :n])
            S.run(window, pos)
            out.append(S.K.to_numpy(A["next_logits"]).copy())
        window, _ = S.inputs(B, 1)
        S.K.copy_in(window, x[:, :1])
        S.run(window, [14 - 3 * i for i in range(B - 1)] + [0], slots=list(reversed(range(B))))
        out.append(S.K.to_numpy(A["next_logits"]).copy())
        got[name] = out
    for i, (a, b) in enumerate(zip(got["triton"], got["numpy"])):
        check(f"step {i}", a, b, 1e-5)
