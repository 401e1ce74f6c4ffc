"""The trainer's own pieces: the learning-rate schedule, the run's log and the terminal's progress lines (the run
loop, checkpoints and signals are exercised end to end in tests/test_cli.py, tests/test_distributed.py and
tests/proxy)."""

from __future__ import annotations

import re

import pytest

from microgpt import checkpoint, config, runlog
from microgpt.engine import optim
from microgpt.run import progress, trainer
from tests.conftest import TINY, cli, json_lines, write_experiment


def test_lr_schedule_warmup_then_cosine() -> None:
    t = config.from_dict(TINY).train
    lrs = [optim.lr_at(s, t) for s in range(t.steps)]
    assert lrs[0] == t.lr / t.warmup_steps and lrs[t.warmup_steps - 1] == t.lr
    assert all(a >= b - 1e-15 for a, b in zip(lrs[t.warmup_steps - 1 :], lrs[t.warmup_steps :]))
    assert abs(optim.lr_at(t.steps, t) - t.min_lr) < 1e-12


def test_lr_schedule_restarts_at_schedule_start() -> None:
    """A phase starting at step 100 gets its own warmup and cosine over steps 100..steps."""
    base = config.from_dict(TINY).train
    t = config.from_dict({**TINY, "train": {**TINY["train"], "steps": 300, "schedule_start": 100}}).train
    plain = config.from_dict({**TINY, "train": {**TINY["train"], "steps": 200}}).train
    assert [optim.lr_at(100 + s, t) for s in range(200)] == [optim.lr_at(s, plain) for s in range(200)]
    assert base.schedule_start == 0


def test_past_the_schedules_end_the_lr_stays_at_min_lr() -> None:
    """train.schedule_steps ends the cosine early: the steps after it run at min_lr, never back up."""
    t = config.from_dict({**TINY, "train": {**TINY["train"], "steps": 400, "schedule_steps": 300}}).train
    short = config.from_dict({**TINY, "train": {**TINY["train"], "steps": 300}}).train
    assert [optim.lr_at(s, t) for s in range(300)] == [optim.lr_at(s, short) for s in range(300)]
    assert {optim.lr_at(s, t) for s in range(300, 400)} == {t.min_lr}
    assert optim.lr_at(299, t) > t.min_lr


def test_warmdown_holds_then_falls_in_a_line_and_muon_momentum_warms_up() -> None:
    """train.schedule "warmdown": warmup, lr held, then a straight line to min_lr over the last warmdown_frac of the
    steps; every group's lr scales by the same factor; Muon's momentum rises linearly over its warmup."""
    t = config.TrainConfig(steps=100, lr=0.1, min_lr=0.01, warmup_steps=4, schedule="warmdown", warmdown_frac=0.25,
                           head_lr=0.004, muon_lr=0.02, muon_momentum_warmup=10)  # fmt: skip
    lrs = [optim.lr_at(s, t) for s in range(100)]
    assert lrs[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1], rel=1e-12) and set(lrs[4:76]) == {0.1}
    assert all(a > b for a, b in zip(lrs[75:], lrs[76:])) and lrs[99] == pytest.approx(0.1 - 0.09 * 24 / 25)
    assert optim.lr_at(100, t) == pytest.approx(t.min_lr)
    assert optim.group_lrs(lrs[90], t) == pytest.approx(
        {"adamw": lrs[90], "head": 0.04 * lrs[90], "muon": 0.2 * lrs[90]}, rel=1e-12
    )
    assert [optim.muon_momentum(s, t) for s in (0, 5, 10, 50)] == pytest.approx([0.85, 0.9, 0.95, 0.95])


def test_muon_momentum_warmup_0_is_no_warmup() -> None:
    """train.muon_momentum_warmup W: the W steps s = 0 .. W - 1 of the schedule run below the final momentum; W = 0
    none, so the first step already runs at train.muon_momentum (it ran at muon_momentum_start, as W = 1 does)."""
    t = config.TrainConfig(optimizer="muon", steps=50, muon_momentum_warmup=0)
    assert [optim.muon_momentum(s, t) for s in (0, 1, 49)] == [t.muon_momentum] * 3
    phase = config.TrainConfig(optimizer="muon", steps=50, schedule_start=20, muon_momentum_warmup=0)
    assert optim.muon_momentum(20, phase) == t.muon_momentum
    one = config.TrainConfig(optimizer="muon", steps=50, muon_momentum_warmup=1)
    assert [optim.muon_momentum(s, one) for s in (0, 1)] == [one.muon_momentum_start, one.muon_momentum]
    assert optim.hyper_rows(0.01, t, 0, 1.0)[optim.HYPER_ROWS["muon"]][1] == t.muon_momentum


def test_a_first_muon_step_without_momentum_warmup_runs_at_the_final_momentum() -> None:
    """The host values the step writes (engine/step.py, the same on both backends): one whole optimizer step of the
    modern block with muon_momentum_warmup 0 leaves the weights and Muon's momentum bit for bit as one whose
    momentum starts at its final value."""
    import numpy as np

    from microgpt.engine import params
    from microgpt.engine.backend import numpy_backend
    from microgpt.engine.state import make_state
    from microgpt.engine.step import Step

    m = config.ModelConfig(vocab_size=61, d_model=32, n_layer=2, n_head=2, seq_len=16, block="modern")
    rng = np.random.default_rng(0)
    batch = [(rng.integers(0, 61, (2, 16)).astype(np.int32), rng.integers(0, 61, (2, 16)).astype(np.int32))]
    out = []
    for warmup, start in ((0, 0.85), (300, 0.95)):
        t = config.TrainConfig(micro_batch=2, optimizer="muon", muon_momentum_warmup=warmup, muon_momentum_start=start)
        S = make_state(m, t, numpy_backend())
        S.p += np.random.default_rng(1).normal(0, 0.1, S.p.shape).astype(np.float32)  # the zero head passes no grad
        Step(S)(batch, t.lr)
        out.append((S.p.copy(), S.adam_m.copy()))
    (p0, m0), (p1, m1) = out
    w_q = params.named(m0, m)["h0.w_q"]
    assert w_q.any() and np.array_equal(m0, m1) and np.array_equal(p0, p1)


def test_the_final_checkpoint_records_the_last_validation_loss(tmp_path) -> None:
    """The sidecar carries the latest eval (the exported model card quotes it)."""
    exp = config.from_dict({**TINY, "train": {**TINY["train"], "steps": 3, "eval_every": 3}})
    log = runlog.RunLog(tmp_path / "train.jsonl")
    log.open()
    assert trainer.Trainer(exp, tmp_path, log=log).run() == 0
    log.close()
    evals = [r for r in runlog.read_log(tmp_path / "train.jsonl") if r["event"] == "eval"]
    side = checkpoint.read_sidecar(checkpoint.list_checkpoints(tmp_path / "ckpt")[0])
    assert (side["val_loss"], side["val_step"]) == (evals[-1]["val_loss"], 3)


def test_the_terminal_shows_validation_loss_elapsed_time_and_eta(tmp_path) -> None:
    """stderr: each step line ends with elapsed time and an ETA, each evaluation has its own line with the same
    val_loss as the log's eval record and says which windows it scored, each checkpoint says it is written; no JSON
    on stdout unless asked (--json: the same records as the log's)."""
    exp = write_experiment(tmp_path)
    r = cli("train", str(exp), "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    events = runlog.read_log(tmp_path / "run" / "train.jsonl")
    step_lines = [line for line in r.stderr.splitlines() if re.match(r"step +\d+/", line)]
    assert len(step_lines) == TINY["train"]["steps"]
    assert all(re.search(r"\| \d+:\d\d elapsed, ETA \d+:\d\d$", line) for line in step_lines), step_lines
    assert step_lines[-1].endswith("ETA 0:00")  # nothing left after the last step
    evals = [e for e in events if e["event"] == "eval"]
    eval_lines = [line for line in r.stderr.splitlines() if line.startswith("eval ")]
    windows = r"the first 8 of [\d,]+ val windows"  # eval_batches 2 x micro_batch 4 of the val split's windows
    want = [f"eval {e['step']:>6}/6 | val_loss {e['val_loss']:.4f} | " for e in evals]
    assert len(evals) == 2 and all(re.fullmatch(re.escape(w) + windows, line) for w, line in zip(want, eval_lines))
    final = tmp_path / "run" / "ckpt" / "step-00000006.bin"
    assert f"checkpoint step 6 written (final): {final}" in r.stderr.splitlines()
    steps = [e for e in events if e["event"] == "step"]
    assert set(steps[0]) == {
        "event",
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "dt_ms",
        "tokens",
        "time",
        "elapsed_s",
        "memory_peak",
    }
    assert [e["event"] for e in events] == ["start"] + ["step"] * 3 + ["eval"] + ["step"] * 3 + [
        "eval",
        "checkpoint",
        "done",
        "report",
    ]
    times = [e["time"] for e in events]
    assert times == sorted(times) and all(t > 1.7e9 for t in times)  # real Unix times, in order
    again = cli("train", str(exp), "--out", str(tmp_path / "json"), "--json")
    drop = ("time", "elapsed_s", "memory_peak", "tokens_per_s", "dt_ms", "path")
    same = lambda recs: [{k: v for k, v in e.items() if k not in drop} for e in recs if e["event"] in ("step", "eval")]  # noqa: E731
    assert same(json_lines(again.stdout)) == same(events)


def test_an_eval_line_that_wraps_says_which_windows_it_scores_twice(tmp_path) -> None:
    """eval_batches x micro_batch past the val split's windows wraps around the split (Loader.val_batch): the eval
    line says that all windows are scored and which of them twice, not just "(wrapping)"."""
    exp = write_experiment(
        tmp_path, train={"steps": 1, "eval_every": 1, "eval_batches": 60}, data={"val_fraction": 0.01}
    )
    r = cli("train", str(exp), "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stderr.splitlines() if line.startswith("eval "))
    m = re.fullmatch(r"eval +1/1 \| val_loss [\d.]+ \| all (\d+) val windows, the first (\d+) of them twice: "
                     r"the 240 asked wrap around the split", line)  # fmt: skip
    assert m and int(m[1]) + int(m[2]) == 240, line


def test_the_step_line_shows_the_runs_training_time() -> None:
    """A step line's elapsed time is the record's elapsed_s (the run's training time across resumes, which the
    dashboard shows under `run`), not the seconds this process has been up."""
    rec = {"step": 301, "loss": 3.9, "lr": 3e-4, "grad_norm": 0.7, "tokens_per_s": 2000.0, "elapsed_s": 3725.4}
    line = progress.step_line(rec, 400, progress.Clock(300, 400))
    assert line.startswith(
        "step    301/400 | loss 3.9000 | lr 3.00e-04 | norm 0.700 | 2,000 tok/s | 1:02:05 elapsed, ETA "
    )
