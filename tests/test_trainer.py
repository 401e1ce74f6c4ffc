"""The trainer's own pieces: the learning-rate schedule and the terminal's progress lines (the run loop, checkpoints
and signals are exercised end to end in tests/test_cli.py, tests/test_distributed.py and tests/proxy)."""

from __future__ import annotations

import json
import re

from microgpt import checkpoint, config, trainer
from tests.conftest import TINY, cli, json_lines, write_experiment


def test_lr_schedule_warmup_then_cosine() -> None:
    t = config.from_dict(TINY).train
    lrs = [trainer.lr_at(s, t) for s in range(t.steps)]
    assert lrs[0] == t.lr / t.warmup_steps and lrs[t.warmup_steps - 1] == t.lr
    assert all(a >= b - 1e-15 for a, b in zip(lrs[t.warmup_steps - 1 :], lrs[t.warmup_steps :]))
    assert abs(trainer.lr_at(t.steps, t) - t.min_lr) < 1e-12


def test_lr_schedule_restarts_at_schedule_start() -> None:
    """A phase starting at step 100 gets its own warmup and cosine over steps 100..steps."""
    base = config.from_dict(TINY).train
    t = config.from_dict({**TINY, "train": {**TINY["train"], "steps": 300, "schedule_start": 100}}).train
    plain = config.from_dict({**TINY, "train": {**TINY["train"], "steps": 200}}).train
    assert [trainer.lr_at(100 + s, t) for s in range(200)] == [trainer.lr_at(s, plain) for s in range(200)]
    assert base.schedule_start == 0


def test_the_final_checkpoint_records_the_last_validation_loss(tmp_path, capfd) -> None:
    """The sidecar carries the latest eval (the exported model card quotes it)."""
    exp = config.from_dict({**TINY, "train": {**TINY["train"], "steps": 3, "eval_every": 3}})
    assert trainer.Trainer(exp, tmp_path).run() == 0
    evals = [json.loads(line) for line in capfd.readouterr().out.splitlines() if '"event":"eval"' in line]
    side = checkpoint.read_sidecar(checkpoint.list_checkpoints(tmp_path / "ckpt")[0])
    assert (side["val_loss"], side["val_step"]) == (evals[-1]["val_loss"], 3)


def test_the_terminal_shows_validation_loss_elapsed_time_and_eta(tmp_path) -> None:
    """stderr: each step line ends with elapsed time and an ETA, and each evaluation has its own line with the same
    val_loss as the JSON eval line; stdout's step lines keep their fields."""
    exp = write_experiment(tmp_path)
    r = cli("train", str(exp), "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    events = json_lines(r.stdout)
    step_lines = [line for line in r.stderr.splitlines() if re.match(r"step +\d+/", line)]
    assert len(step_lines) == TINY["train"]["steps"]
    assert all(re.search(r"\| \d+:\d\d elapsed, ETA \d+:\d\d$", line) for line in step_lines), step_lines
    assert step_lines[-1].endswith("ETA 0:00")  # nothing left after the last step
    evals = [e for e in events if e["event"] == "eval"]
    eval_lines = [line for line in r.stderr.splitlines() if line.startswith("eval ")]
    assert eval_lines == [f"eval {e['step']:>6}/6 | val_loss {e['val_loss']:.4f}" for e in evals]
    assert len(evals) == 2
    steps = [e for e in events if e["event"] == "step"]
    assert set(steps[0]) == {"event", "step", "loss", "lr", "grad_norm", "tokens_per_s", "dt_ms", "tokens"}
