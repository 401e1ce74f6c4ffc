"""The optimizer step (microgpt/engine/step.py) through the trainer: N steps of forward/backward, scale, clip and AdamW
against PyTorch, accumulation, determinism, and the memory plan as the one allocation. In-process, on the NumPy
backend in float64 where the comparison is with autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from microgpt import config
from microgpt.engine import optim
from microgpt.engine.backend import numpy_backend
from microgpt.run import trainer
from tests.conftest import TINY
from tests.test_model import torch_twin_loss


class FixedBatches:
    """A data.Batches for tests: step s, micro u -> rows [u*b, (u+1)*b) of batch s of a fixed random token array."""

    def __init__(self, tokens: np.ndarray, targets: np.ndarray, micro_batch: int):
        self.tokens, self.targets, self.b = tokens, targets, micro_batch

    def batch(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        rows = slice(micro * self.b, (micro + 1) * self.b)
        return self.tokens[step, rows], self.targets[step, rows]

    def end_step(self, step: int, micro_losses: list[float], dp: object) -> dict:
        return {}

    def state(self) -> None:
        return None

    def load_state(self, state: dict | None, step: int, where: str) -> None:
        pass


def float64_backend():
    return numpy_backend({"f32": np.float64, "compute": np.float64, "i32": np.int32, "u8": np.uint8})


def make_trainer(tmp_path, micro_batch: int, n_micro: int, steps: int, grad_clip: float, data, **train):
    raw = {
        **TINY,
        "train": {
            **TINY["train"],
            "micro_batch": micro_batch,
            "n_micro": n_micro,
            "steps": steps,
            "grad_clip": grad_clip,
            "weight_decay": 0.1,
            **train,
        },
    }
    tr = trainer.Trainer(config.from_dict(raw), tmp_path, K=float64_backend())
    tr.train_data = data
    return tr


def random_batches(steps: int, rows: int, m: config.ModelConfig, seed: int):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, m.vocab_size, size=(steps, rows, m.seq_len)).astype(np.int32)
    return tokens, rng.integers(0, m.vocab_size, size=(steps, rows, m.seq_len)).astype(np.int32)


def test_steps_match_torch_adamw_and_clipping(tmp_path) -> None:
    steps, b, n_micro = 4, 2, 2
    m = config.from_dict(TINY).model
    tokens, targets = random_batches(steps, b * n_micro, m, seed=3)
    tr = make_trainer(tmp_path, b, n_micro, steps, grad_clip=0.5, data=FixedBatches(tokens, targets, b))
    TP = {n: torch.tensor(p, requires_grad=True) for n, p in tr.S.P.items()}  # float64 copies of the init
    decay = [p for p in TP.values() if p.ndim == 2]
    rest = [p for p in TP.values() if p.ndim != 2]
    t = tr.t
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
    )
    clipped = 0
    for s in range(steps):
        rec = tr.train_step()
        losses = []
        for u in range(n_micro):
            x, y = (torch.tensor(a[s, u * b : (u + 1) * b], dtype=torch.long) for a in (tokens, targets))
            loss = torch_twin_loss(TP, m, x, y) / n_micro
            loss.backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(list(TP.values()), t.grad_clip)
        clipped += norm.item() > t.grad_clip
        for group in opt.param_groups:
            group["lr"] = optim.lr_at(s, t)
        opt.step()
        opt.zero_grad()
        assert abs(rec["loss"] - sum(losses)) < 1e-10 * abs(sum(losses)), (s, rec["loss"], sum(losses))
        assert abs(rec["grad_norm"] - norm.item()) < 1e-9 * norm.item()
    assert clipped > 0, "the clip threshold should be hit at least once"
    want = np.concatenate([p.detach().numpy().reshape(-1) for p in TP.values()])
    err = np.linalg.norm(tr.S.p - want) / np.linalg.norm(want)
    assert err < 1e-10, f"weights after {steps} steps: rel err {err:.2e}"
    state = opt.state[TP["wte"]]
    n = TP["wte"].numel()
    assert np.allclose(tr.S.adam_m[:n], state["exp_avg"].numpy().reshape(-1), rtol=1e-9, atol=1e-15)
    assert np.allclose(tr.S.adam_v[:n], state["exp_avg_sq"].numpy().reshape(-1), rtol=1e-9, atol=1e-18)


def test_accumulation_equals_one_big_batch(tmp_path) -> None:
    """n_micro micro-batches of b rows give the update of one batch of n_micro*b rows (to rounding)."""
    m = config.from_dict(TINY).model
    tokens, targets = random_batches(2, 4, m, seed=5)
    results = []
    for b, n_micro in ((4, 1), (2, 2), (1, 4)):
        tr = make_trainer(tmp_path / f"{b}", b, n_micro, 2, grad_clip=1.0, data=FixedBatches(tokens, targets, b))
        recs = [tr.train_step() for _ in range(2)]
        results.append((np.array([r["loss"] for r in recs]), tr.S.p.copy(), tr.S.adam_v.copy()))
    for losses, p, v in results[1:]:
        assert np.allclose(losses, results[0][0], rtol=1e-12)
        assert np.linalg.norm(p - results[0][1]) / np.linalg.norm(results[0][1]) < 1e-12
        assert np.linalg.norm(v - results[0][2]) / np.linalg.norm(results[0][2]) < 1e-10


def test_two_runs_with_the_same_seed_are_bitwise_equal(tmp_path) -> None:
    exp = config.from_dict(TINY)
    runs = []
    for i in range(2):
        tr = trainer.Trainer(exp, tmp_path / str(i))
        runs.append(([tr.train_step()["loss"] for _ in range(3)], tr.S.p.copy()))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1].tobytes() == runs[1][1].tobytes()


# --- a batch-size warmup (train.batch_warmup_steps: data/loader.py MicroSchedule) ---------------------------------
BATCH_WARMUP = {"batch_warmup_steps": 3, "batch_warmup_start": 1}
WARMUP = {"n_micro": 3, **BATCH_WARMUP}  # steps 0, 1: 1 micro-batch; step 2: 2; then 3


def test_a_batch_warmup_step_is_the_mean_over_what_it_read(tmp_path) -> None:
    """Steps of 1, 1, 2, 3, 3 micro-batches against PyTorch: each step's loss and gradient are the mean over the
    micro-batches it read (its own 1/count, not 1/n_micro), the clip and AdamW as before, the lr in steps; the step
    records count the tokens read."""
    steps, b = 5, 2
    m = config.from_dict(TINY).model
    tokens, targets = random_batches(steps, b * 3, m, seed=4)
    tr = make_trainer(tmp_path, b, 3, steps, grad_clip=0.5, data=FixedBatches(tokens, targets, b), **BATCH_WARMUP)
    TP = {n: torch.tensor(p, requires_grad=True) for n, p in tr.S.P.items()}
    decay = [p for p in TP.values() if p.ndim == 2]
    rest = [p for p in TP.values() if p.ndim != 2]
    t = tr.t
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
    )
    counts = []
    for s in range(steps):
        rec = tr.train_step()
        count = rec["tokens"] // (b * m.seq_len)
        counts.append(count)
        loss = 0.0
        for u in range(count):
            x, y = (torch.tensor(a[s, u * b : (u + 1) * b], dtype=torch.long) for a in (tokens, targets))
            part = torch_twin_loss(TP, m, x, y) / count
            part.backward()
            loss += part.item()
        norm = torch.nn.utils.clip_grad_norm_(list(TP.values()), t.grad_clip)
        for group in opt.param_groups:
            group["lr"] = optim.lr_at(s, t)
        opt.step()
        opt.zero_grad()
        assert abs(rec["loss"] - loss) < 1e-10 * loss, (s, rec["loss"], loss)
        assert abs(rec["grad_norm"] - norm.item()) < 1e-9 * norm.item(), s
        assert rec["lr"] == optim.lr_at(s, t)
    assert counts == [1, 1, 2, 3, 3]
    want = np.concatenate([p.detach().numpy().reshape(-1) for p in TP.values()])
    assert np.linalg.norm(tr.S.p - want) / np.linalg.norm(want) < 1e-10


@pytest.mark.parametrize("block", ["gpt2", "modern"])
def test_a_warmup_step_of_c_micro_batches_is_the_step_of_n_micro_c(tmp_path, block: str) -> None:
    """Bit for bit, on both block families (Muon on the modern one): each step of a run with a batch warmup equals the
    step, from the same state and on the same batches, of a run whose n_micro is that step's count."""
    modern = {"optimizer": "muon", "weight_decay": 0.0} if block == "modern" else {}
    model = {"block": "modern", "n_head": 2} if block == "modern" else {}
    raw = {**TINY, "model": {**TINY["model"], **model}, "train": {**TINY["train"], **modern, **WARMUP, "steps": 5}}
    tr = trainer.Trainer(config.from_dict(raw), tmp_path / "warm")
    for s in range(5):
        count = tr.micro.count(s)
        batches = [tr.train_data.batch(s, u) for u in range(count)]
        flat = {**raw["train"], "n_micro": count, "batch_warmup_steps": 0}
        ref = trainer.Trainer(config.from_dict({**raw, "train": flat}), tmp_path / f"ref{s}")
        for name in ("p", "adam_m", "adam_v"):
            ref.S.K.copy_in(getattr(ref.S, name), getattr(tr.S, name))
        ref.S.step = s
        want = ref.step_fn(batches, optim.lr_at(s, ref.t))
        got = tr.train_step()
        assert (got["loss"], got["grad_norm"]) == (want.loss, want.grad_norm), s
        for name in ("p", "adam_m", "adam_v"):
            assert getattr(tr.S, name).tobytes() == getattr(ref.S, name).tobytes(), (s, name)
    assert [tr.micro.count(s) for s in range(5)] == [1, 1, 2, 3, 3]


def test_a_step_reads_its_count_of_micro_batches(tmp_path) -> None:
    """Step refuses batches that are not its step's count (the schedule is the step's, not the caller's)."""
    tr = trainer.Trainer(config.from_dict({**TINY, "train": {**TINY["train"], **WARMUP}}), tmp_path)
    batches = [tr.train_data.batch(0, 0)] * 3
    with pytest.raises(ValueError, match=r"^step 0 reads 1 micro-batches, got 3$"):
        tr.step_fn(batches, 1e-3)
    with pytest.raises(ValueError, match=r"micro=1\): need step >= 0 and 0 <= micro < 1"):
        tr.train_data.batch(0, 1)
