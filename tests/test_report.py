"""The report card (microgpt/run/report.py): written by `train` at the end of a run and on SIGTERM, its numbers taken
from the run's log and checked here against the log, the checkpoints and the FLOPs formula; and `--steps` beyond a
finished run's schedule, under `train` and under `run`: the steps past it run at the schedule's final lr."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

from microgpt import config, runlog
from microgpt.engine import params
from tests.conftest import REPO, TINY, cli, write_experiment
from tests.proxy._helpers import ENV, run_to_end


def test_the_report_card_of_a_run_says_what_its_log_and_checkpoints_say(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path, train={"ckpt_every": 3})
    out = tmp_path / "run"
    r = cli("train", str(exp), "--out", str(out), "--set", "train.lr=0.02")
    assert r.returncode == 0, r.stderr
    assert f"report card: {out / 'report.md'}" in r.stderr.splitlines()
    card = json.loads((out / "report.json").read_text())
    log = runlog.read_log(out / "train.jsonl")
    steps = [e for e in log if e["event"] == "step"]
    evals = [e for e in log if e["event"] == "eval"]
    assert card["outcome"] == "done" and card["step"] == 6 and card["recipe"]["overrides"] == ["--set train.lr=0.02"]
    assert card["recipe"]["command"] == f"microgpt train {exp} --out {out} --set train.lr=0.02"
    t, m = TINY["train"], TINY["model"]
    per_step = t["n_micro"] * t["micro_batch"] * m["seq_len"]
    assert card["tokens"] == {"seen": 6 * per_step, "per_step": per_step}
    loss = card["loss"]
    assert loss["train"] == steps[-1]["loss"] and loss["val"] == evals[-1]["val_loss"] and loss["val_step"] == 6
    assert math.isclose(loss["train_mean_last"], sum(e["loss"] for e in steps) / 6)
    # the byte tokenizer (vocab 256): one byte per scored token, so bits per byte is the loss in bits
    assert math.isclose(loss["val_bits_per_byte"], loss["val"] / math.log(2))
    assert math.isclose(loss["train_bits_per_byte"], loss["train"] / math.log(2))
    n = params.n_params(config.from_dict(TINY).model)
    assert card["speed"]["flops_per_token"] == 6 * n + 12 * m["n_layer"] * m["seq_len"] * m["d_model"]
    assert card["speed"]["mfu"] is None and "cpu" in card["speed"]["mfu_missing"]  # no known peak on the CPU
    assert card["speed"]["tokens_per_s"] == sorted(e["tokens_per_s"] for e in steps[1:])[2]  # the median of 5
    (total,) = [line.split()[1] for line in r.stderr.splitlines() if line.startswith("total ")]  # the printed plan
    assert card["memory"]["plan_bytes"] == int(total.replace(",", "")) < card["memory"]["peak_bytes"]
    assert [(c["step"], c["reason"]) for c in card["checkpoints"]] == [(6, "final"), (3, "periodic")]
    assert card["versions"]["numpy"] and card["device"] == "cpu"
    assert len(card["samples"]) == 3 and all(s["text"] and s["seed"] == 6 for s in card["samples"])
    md = (out / "report.md").read_text()
    for needle in (
        f"{loss['val']:.4f} nats/token at step 6",
        "6N + 12*L*T*d",
        "step-00000006.bin (final)",
        "`--set train.lr=0.02`",
        "## Samples",
    ):
        assert needle in md, needle


def test_the_report_card_counts_the_tokens_a_batch_warmup_read(tmp_path: Path) -> None:
    """With a batch warmup (n_micro 3 from 1 over 4 steps: 1, 1, 2, 2, then 3, 3) the card's tokens seen are the
    tokens the steps read (the sum of their records'), and report.md says how many the warmup left out."""
    warm = {"n_micro": 3, "batch_warmup_steps": 4, "batch_warmup_start": 1}
    out = tmp_path / "run"
    r = cli("train", str(write_experiment(tmp_path, train=warm)), "--out", str(out))
    assert r.returncode == 0, r.stderr
    card = json.loads((out / "report.json").read_text())
    steps = [e for e in runlog.read_log(out / "train.jsonl") if e["event"] == "step"]
    per_micro = TINY["train"]["micro_batch"] * TINY["model"]["seq_len"]
    assert [e["tokens"] for e in steps] == [per_micro * c for c in (1, 1, 2, 2, 3, 3)]
    assert card["tokens"] == {"seen": sum(e["tokens"] for e in steps), "per_step": 3 * per_micro}
    seen = f"{12 * per_micro:,} ({3 * per_micro:,} per step x 6 steps; {6 * per_micro:,} fewer in the batch warmup"
    assert seen in (out / "report.md").read_text()


def test_sigterm_writes_the_report_card_of_the_stopped_run(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "microgpt.cli", "train", str(exp), "--steps", "100000", "--out", str(out), "--json"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    for line in proc.stdout:
        if json.loads(line).get("step", 0) >= 3:
            break
    proc.send_signal(signal.SIGTERM)
    out_rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    card = json.loads((out / "report.json").read_text())
    stop = [json.loads(x) for x in out_rest.splitlines() if '"stopped"' in x][0]
    assert card["outcome"] == "stopped" and card["step"] == stop["step"] >= 3
    assert card["checkpoints"][0]["reason"] == "SIGTERM" and card["checkpoints"][0]["step"] == card["step"]
    assert f"stopped (SIGTERM) at step {card['step']}" in err and "report card:" in err


def lrs(out: Path) -> dict[int, float]:
    return {e["step"]: e["lr"] for e in runlog.read_log(out / "train.jsonl") if e["event"] == "step"}


def test_steps_beyond_a_finished_run_continue_at_its_final_lr_under_train_and_run(tmp_path: Path) -> None:
    """`--steps 10` after a finished 6-step run: steps 7..10 at min_lr (never back up), the same under `train
    --resume latest` and under `run`; then the 6-step command says the run is complete (exit 0), as `make train`
    does after a longer proxy run. `train` runs on the proxy's one BLAS thread (tests/proxy/_helpers.py ENV): resume
    is bit-exact for the same thread settings (docs/ANDREA.md), and OpenBLAS's Haswell kernels (which this
    machine's environment picks on an AMD CPU) sum some GEMMs otherwise on two threads than on one."""
    exp = write_experiment(tmp_path, train={"warmup_steps": 1})
    a, b = tmp_path / "a", tmp_path / "b"
    threads = {"OPENBLAS_NUM_THREADS": ENV["OPENBLAS_NUM_THREADS"], "OMP_NUM_THREADS": ENV["OMP_NUM_THREADS"]}
    for out in (a, b):
        assert cli("train", str(exp), "--out", str(out), env=threads).returncode == 0
    t = cli("train", str(exp), "--out", str(a), "--resume", "latest", "--steps", "10", env=threads)
    assert t.returncode == 0, t.stderr
    run_to_end(exp, b, "--steps", "10")
    min_lr = TINY["train"]["min_lr"]
    for out in (a, b):
        got = lrs(out)
        assert [got[s] for s in range(7, 11)] == [min_lr] * 4 and got[6] > min_lr
        assert all(got[s] >= got[s + 1] - 1e-15 for s in range(1, 10))  # never back up
    assert (a / "ckpt" / "step-00000010.bin").read_bytes() == (b / "ckpt" / "step-00000010.bin").read_bytes()
    again = cli("train", str(exp), "--out", str(b), "--resume", "latest")
    assert again.returncode == 0 and "already complete" in again.stderr and "step 10" in again.stderr


# --- the run folder's own records, hostile (issue 49 class 2) --------------------------------------------------
HOSTILE_LINES = [
    '{"event":"step","step":2,"lo',  # cut short: a kill or a full disk mid-write, no newline after it
    '{"event":"step","loss":2.0}',
    '{"event":"step","step":"3","loss":2.0}',
    '{"event":"step","step":null,"loss":2.0}',
    '{"event":"step","step":3,"loss":"low"}',
    '{"event":"step","step":3,"loss":NaN}',
    '{"event":"step","step":3,"loss":1e400}',
    '{"event":"eval","step":3,"val_loss":Infinity}',
    '{"event":"start","step":0,"versions":[1,2],"git":7}',
]


def test_a_resume_over_a_hostile_log_trains_and_reports(tmp_path: Path) -> None:
    """Each hostile line (the cut-off one last, as a kill leaves it) is passed over and counted by the log's one
    reader: the resumed run's start record is a line of its own, the report card is made from the rest, says so
    once, and report.json is strict JSON."""
    exp, out = write_experiment(tmp_path, train={"ckpt_every": 3}), tmp_path / "run"
    assert cli("train", str(exp), "--out", str(out), "--steps", "3").returncode == 0
    log = out / "train.jsonl"
    first = len(log.read_text().splitlines()) + 1
    with open(log, "a") as f:
        f.write("\n".join(HOSTILE_LINES[1:]) + "\n" + HOSTILE_LINES[0])
    r = cli("train", str(exp), "--out", str(out), "--resume", "latest")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: {log}: {len(HOSTILE_LINES)} unreadable lines were passed over (the first, line "
        f"{first}: its step is missing); the report card is made from the rest"
    ]
    card = json.loads((out / "report.json").read_text(), parse_constant=_no_constant)
    assert card["outcome"] == "done" and card["step"] == 6 and card["log"]["unreadable"] == len(HOSTILE_LINES)
    records = runlog.read_log(log)
    assert [e["step"] for e in records if e["event"] == "step"] == list(range(1, 7))  # nothing glued, nothing lost
    assert [e["step"] for e in records if e["event"] == "start"] == [0, 3]
    assert card["loss"]["train"] == [e["loss"] for e in records if e["event"] == "step"][-1]
    assert f"{len(HOSTILE_LINES)} unreadable line(s) of {log} passed over" in (out / "report.md").read_text()


def _no_constant(name: str) -> None:
    raise AssertionError(f"report.json holds {name}: not JSON")


def test_a_report_card_path_that_is_a_folder_is_refused_before_training(tmp_path: Path) -> None:
    exp, out = write_experiment(tmp_path), tmp_path / "run"
    (out / "report.md").mkdir(parents=True)
    r = cli("train", str(exp), "--out", str(out))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: --out {out}: {out / 'report.md'} is a folder, not a regular file; the run's report card is written "
        "there (move it away)"
    ], r.stderr
    assert sorted(p.name for p in out.rglob("*")) == ["report.md"]


def test_a_report_card_path_that_became_a_folder_is_one_error(tmp_path: Path) -> None:
    """report.md made a folder while the run trains (after the run folder was checked): the card is one error line
    naming it (exit 2), report.json written, the final checkpoint intact."""
    from microgpt.errors import InputError
    from microgpt.run import report, trainer

    exp = config.from_dict({**TINY, "train": {**TINY["train"], "steps": 2}})
    tr = trainer.Trainer(exp, tmp_path)
    assert tr.run() == 0
    (tmp_path / "report.md").mkdir()
    try:
        report.write(tr, tr.last_checkpoint)
    except InputError as e:
        assert str(e).startswith(f"{tmp_path / 'report.md'}: cannot write the report card (") and "\n" not in str(e)
    else:
        raise AssertionError("report.md, a folder, was written")
    json.loads((tmp_path / "report.json").read_text(), parse_constant=_no_constant)
    assert [p.name for p in (tmp_path / "report.md").iterdir()] == []


# --- the commit of the code that trained ----------------------------------------------------------------------------
def git(where: Path, *args: str) -> str:
    ident = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main", "-c", "gc.auto=0"]
    res = subprocess.run(["git", "-C", str(where), *ident, *args], capture_output=True, text=True, check=True)
    return res.stdout.strip()


def a_copy_of_the_package(folder: Path) -> Path:
    """microgpt/ copied into folder (no caches): the package as a clone or an install lays it out there."""
    import shutil

    import microgpt

    shutil.copytree(Path(microgpt.__file__).parent, folder / "microgpt", ignore=shutil.ignore_patterns("__pycache__"))
    return folder / "microgpt"


def train_with(package: Path, tmp_path: Path, out: str) -> tuple[dict, str]:
    """A 2-step run of the package's copy, from its own folder (training where the code is); its card, report.md."""
    exp = write_experiment(tmp_path, train={"steps": 2})
    env = {**os.environ, "PYTHONPATH": str(package.parent)}
    where = [sys.executable, "-c", "import microgpt; print(microgpt.__file__)"]
    assert subprocess.run(where, capture_output=True, text=True, cwd=package.parent, env=env).stdout.strip() == str(
        package / "__init__.py"
    )
    cmd = [sys.executable, "-m", "microgpt.cli", "train", str(exp), "--out", str(tmp_path / out)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=package.parent, env=env, timeout=300)
    assert res.returncode == 0 and "error" not in res.stderr, res.stderr
    return json.loads((tmp_path / out / "report.json").read_text()), (tmp_path / out / "report.md").read_text()


def test_the_report_card_names_the_commit_of_the_checkout_that_trained(tmp_path: Path) -> None:
    """A clone's own commit (a loose branch ref), and a linked worktree's whose branch git has packed into
    packed-refs, each in the start record and on the card; not the commit of another checkout of the same repo."""
    repo = tmp_path / "repo"
    package = a_copy_of_the_package(repo)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "the code")
    first = git(repo, "rev-parse", "HEAD")
    card, md = train_with(package, tmp_path, "run")
    assert card["git"] == first and f"git {first[:12]}" in md
    assert json.loads((tmp_path / "run/train.jsonl").read_text().splitlines()[0])["git"] == first

    tree = tmp_path / "tree"
    git(repo, "worktree", "add", "-q", "-b", "other", str(tree))
    (tree / "microgpt" / "NOTE").write_text("another commit\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "another commit")
    git(repo, "pack-refs", "--all")
    second = git(tree, "rev-parse", "HEAD")
    assert second != first and not (repo / ".git/refs/heads/other").exists()
    card, md = train_with(tree / "microgpt", tmp_path, "run2")
    assert card["git"] == second and f"git {second[:12]}" in md


def test_a_package_outside_any_checkout_says_unknown(tmp_path: Path) -> None:
    """Installed where no git folder is above it: the card says "git unknown", the run is as any other."""
    assert not any((p / ".git").exists() for p in (tmp_path, *tmp_path.parents))
    card, md = train_with(a_copy_of_the_package(tmp_path / "lib"), tmp_path, "run")
    assert card["git"] is None and "; git unknown" in md and card["outcome"] == "done"


def test_the_commit_is_read_from_the_git_folder_itself(tmp_path: Path) -> None:
    """git_commit without a git program: a detached HEAD; a submodule-style .git file with a relative gitdir; a
    branch with no commit yet, a git folder that cannot be read, and a package under site-packages inside a
    repository (a project's virtual environment: the project's commit is not the code's): None."""
    from microgpt.run.trainer import git_commit

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    git(repo, "init", "-q")
    assert git_commit(repo / "pkg") is None  # no commit yet
    (repo / "pkg/a.py").write_text("x = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    one = git(repo, "rev-parse", "HEAD")
    assert git_commit(repo / "pkg") == git_commit(repo) == one
    (repo / "pkg/a.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "two")
    git(repo, "checkout", "-q", "--detach", one)
    assert git_commit(repo / "pkg") == one
    venv = repo / ".venv/lib/python3.11/site-packages/microgpt"
    venv.mkdir(parents=True)
    assert git_commit(venv) is None
    moved = tmp_path / "modules" / "repo"  # as `git submodule` lays it out: .git a file, its path relative
    moved.parent.mkdir()
    (repo / ".git").rename(moved)
    (repo / ".git").write_text("gitdir: ../modules/repo\n")
    assert git_commit(repo / "pkg") == one
    (repo / ".git").write_text("not a gitdir line\n")
    assert git_commit(repo / "pkg") is None
