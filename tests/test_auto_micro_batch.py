"""`--micro-batch auto` through the real command on the NumPy backend (the host's memory is its device's): the
micro-batch chosen keeps the recipe's sequences a step, the run says why on stderr, trains, and records what ran;
a margin that leaves nothing is one `error:` line and exit 2, with nothing written. (On the GPU the same choice
reads the card's free memory: tests/kernels/test_cards.py stands a card in for it.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microgpt import checkpoint
from tests.conftest import cli, json_lines, write_experiment


def test_auto_trains_with_the_recipe_s_sequences_a_step(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path, train={"micro_batch": 4, "n_micro": 2, "steps": 2, "eval_every": 2})
    r = cli("train", str(exp), "--out", str(tmp_path / "run"), "--micro-batch", "auto", "--json")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("train.micro_batch auto: ")]
    assert len(said) == 1 and said[0].startswith(
        "train.micro_batch auto: 8 x n_micro 1 = 8 sequences a step, the largest micro-batch whose plan ("
    )
    recs = json_lines(r.stdout)
    train = next(rec for rec in recs if rec["event"] == "start")["config"]["train"]
    assert (train["micro_batch"], train["n_micro"]) == (8, 1)
    assert [rec["tokens"] for rec in recs if rec["event"] == "step"] == [4 * 2 * 32] * 2  # the recipe's tokens a step
    (ckpt,) = checkpoint.list_checkpoints(tmp_path / "run" / "ckpt")
    side = json.loads(checkpoint.sidecar_path(ckpt).read_text())
    assert (side["config"]["train"]["micro_batch"], side["config"]["train"]["n_micro"]) == (8, 1)


def test_no_room_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path)
    for flags, needle in (
        (
            ["--micro-batch", "auto"],
            "error: train.micro_batch 'auto': no micro-batch fits the device (cpu): a micro-batch of 1 needs ",
        ),
        ([], "error: the memory plan needs "),
    ):
        r = cli("train", str(exp), "--out", str(tmp_path / "run"), "--memory-margin", "1048576", *flags)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(needle), r.stderr
        assert not list((tmp_path / "run").glob("ckpt/*"))
    assert "no micro-batch of the 8 sequences a step (train.micro_batch x train.n_micro) fits" in r.stderr


def test_run_hands_auto_to_each_phase_s_engine(tmp_path: Path) -> None:
    """`microgpt run --micro-batch auto`: each phase's engine gets "auto" with the step's sequences as n_micro, and
    resolves it on its own device when it starts."""
    from microgpt.proxy import phases

    exp = write_experiment(tmp_path, train={"micro_batch": 4, "n_micro": 2})
    sched = phases.load_schedule(exp, micro_batch="auto")
    assert [(ph.engine["train"]["micro_batch"], ph.engine["train"]["n_micro"]) for ph in sched.phases] == [("auto", 8)]


def test_auto_under_data_parallel_is_refused_naming_the_field(tmp_path: Path) -> None:
    """Each rank would read its own card's free memory; the ranks must agree on the micro-batch."""
    from types import SimpleNamespace

    from microgpt import config
    from microgpt.run import trainer

    exp = config.from_dict(json.loads(write_experiment(tmp_path, train={"micro_batch": "auto"}).read_text()))
    with pytest.raises(config.ConfigError, match=r"^train.micro_batch 'auto' is one process's choice: under data"):
        trainer.Trainer(exp, tmp_path / "run", dp=SimpleNamespace(rank=0, world_size=2))


def test_auto_with_procs_is_one_line_before_any_rank(tmp_path: Path) -> None:
    """`--procs 2 --micro-batch auto`: the job is refused where it is checked (job.check_job), one line."""
    exp = write_experiment(tmp_path)
    r = cli("train", str(exp), "--out", str(tmp_path / "run"), "--procs", "2", "--micro-batch", "auto")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: train.micro_batch 'auto' is one process's choice: under data parallel give it as a number (the one "
        "`microgpt train --micro-batch auto` prints on one card)"
    ], r.stderr
    assert not list((tmp_path / "run").glob("ckpt/*")) and not (tmp_path / "run" / "train.jsonl").exists()


def test_run_asks_the_engine_to_check_the_job_before_writing(tmp_path: Path) -> None:
    """`microgpt run --procs 2 --micro-batch auto`: the proxy builds no plan and checks no job itself; the engine's
    own check (`microgpt train --check`) refuses it, and its line is the run's one line, exit 2, nothing written."""
    exp = write_experiment(tmp_path)
    r = cli("run", str(exp), "--out", str(tmp_path / "run"), "--procs", "2", "--micro-batch", "auto")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: train.micro_batch 'auto' is one process's choice: under data parallel give it as a number (the one "
        "`microgpt train --micro-batch auto` prints on one card)"
    ], r.stderr
    assert not (tmp_path / "run").exists()


def test_train_check_writes_nothing(tmp_path: Path) -> None:
    """`microgpt train --check`: the pre-flight alone, exit 0 and no run folder for a job this machine can run."""
    exp = write_experiment(tmp_path)
    r = cli("train", str(exp), "--out", str(tmp_path / "run"), "--procs", "2", "--check")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("start, want", [(1, (4, 4, 1)), (2, (8, 2, 1)), (4, (16, 1, 1))])
def test_auto_keeps_a_batch_warmup_s_first_step(tmp_path: Path, start: int, want: tuple[int, int, int]) -> None:
    """`--micro-batch auto` on a recipe of 4 x 4 with a batch warmup from `start` micro-batches: n_micro and
    batch_warmup_start count sequences (16, 4 x start), and the micro-batch chosen divides both, so the warmup's
    first step reads the recipe's sequences too (the largest that does, where the room allows any)."""
    from microgpt import config
    from microgpt.engine.backend import numpy_backend
    from microgpt.engine.state import auto_micro_batch

    train = {"micro_batch": 4, "n_micro": 4, "batch_warmup_steps": 5, "batch_warmup_start": start}
    exp = config.load(write_experiment(tmp_path, train=train), micro_batch="auto")
    t = exp.train
    assert (t.micro_batch, t.n_micro, t.batch_warmup_start) == ("auto", 16, 4 * start)
    got = auto_micro_batch(exp.model, t, numpy_backend(), 1 << 40, 0)
    assert (got.micro_batch, got.n_micro, got.batch_warmup_start) == want
    assert got.micro_batch * got.batch_warmup_start == 4 * start and got.micro_batch * got.n_micro == 16
