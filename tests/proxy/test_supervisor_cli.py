"""Bad input to `microgpt run`: one clear line on stderr, exit code 2, and nothing already written is touched."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.proxy._helpers import ENV, REPO, run_to_end, write_exp


def snapshot(folder: Path) -> dict[str, str]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


FINISHED_TRAIN = {"steps": 10, "ckpt_every": 5}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 10-step run: the files that bad input must leave alone."""
    folder = tmp_path_factory.mktemp("finished")
    return run_to_end(write_exp(folder, train=FINISHED_TRAIN), folder / "run").out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "microgpt.cli", "run", *args]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


PHASES_BAD_FIELD = [{"name": "pretrain", "steps": 5}, {"name": "polish", "steps": 5, "lrr": 1e-4}]


@pytest.mark.parametrize(
    "sections, needles",
    [
        ({"phases": PHASES_BAD_FIELD}, ["phases[1]", "unknown phase field 'lrr'"]),
        (
            {"phases": [{"name": "polish", "steps": 5, "data": {"source": "shards", "path": "/nonexistent/megachat"}}]},
            ["phases[0]", "data.path", "/nonexistent/megachat", "does not exist"],
        ),
        ({"data": {"source": "shards", "path": "/nonexistent/shards"}}, ["data.path", "/nonexistent/shards"]),
        ({"phases": [{"name": "a", "steps": 5}, {"name": "a", "steps": 5}]}, ["phases[1]", "'a' is used twice"]),
        ({"phases": [{"name": "a", "steps": 5, "train": {"steps": 9}}]}, ["train.steps is set by the proxy"]),
        ({"phases": [{"name": "a", "steps": 5, "train": {"warmup": 9}}]}, ["phases[0] (a)", "unknown field 'warmup'"]),
        ({"proxy": {"hang_timeout": 5}}, ["proxy", "unknown field 'hang_timeout'"]),
        ({"train": {"hellaswag": "/nonexistent/hs.jsonl"}}, ["train.hellaswag /nonexistent/hs.jsonl: cannot read"]),
        ({"proxy": {"prompts": [3]}}, ["proxy.prompts[0]"]),
    ],
)
def test_bad_experiment(tmp_path: Path, finished: Path, sections: dict, needles: list[str]) -> None:
    before = snapshot(finished)
    exp = write_exp(tmp_path, **sections)
    assert_one_line_error(run_cli(str(exp), "--out", str(finished)), str(exp), *needles)
    assert snapshot(finished) == before
    assert_one_line_error(run_cli(str(exp), "--out", str(tmp_path / "new")), *needles)
    assert not (tmp_path / "new").exists()


def test_port_in_use(tmp_path: Path, finished: Path) -> None:
    before = snapshot(finished)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        exp = write_exp(tmp_path, train=FINISHED_TRAIN)  # the finished run's own experiment
        res = run_cli(str(exp), "--out", str(finished), "--dashboard", str(port))
    assert_one_line_error(res, f"--dashboard {port}", "in use")
    assert snapshot(finished) == before


def test_another_experiment_in_the_same_folder(tmp_path: Path, finished: Path) -> None:
    before = snapshot(finished)
    res = run_cli(str(write_exp(tmp_path, train={**FINISHED_TRAIN, "lr": 1e-3})), "--out", str(finished))
    assert_one_line_error(res, "different experiment", "use another --out")
    assert snapshot(finished) == before


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--steps", "abc"], "--steps"),
        (["--steps", "0"], "--steps must be an integer in [1, 2147483647], got 0"),
        (["--dashboard", "99999"], "99999"),
        (["--hang-timeout", "0"], "--hang-timeout"),
        (["--seed", "-"], "--seed"),
        (["--hang-timeout", "nan"], "--hang-timeout must be a finite number"),
        (["--hang-timeout", "inf"], "--hang-timeout must be a finite number"),
        (["--max-restarts", "-1"], "--max-restarts must be an integer in [0, 2147483647]"),
        (["--max-restarts", "1" + "0" * 30], "--max-restarts must be an integer in [0, 2147483647]"),
        (["--procs", "0"], "--procs must be an integer in [1, 2147483647], got 0"),
        (["--set", "model.d_model=33"], "d_model (33) must be divisible"),
        (["--set", "nope"], "--set 'nope'"),
    ],
)
def test_bad_flags(tmp_path: Path, args: list[str], needle: str) -> None:
    res = run_cli(str(write_exp(tmp_path)), "--out", str(tmp_path / "new"), *args)
    assert_one_line_error(res, needle)
    assert not (tmp_path / "new").exists()


def test_missing_or_broken_experiment_file(tmp_path: Path) -> None:
    assert_one_line_error(run_cli(str(tmp_path / "nope.json")), "nope.json", "cannot read")
    (tmp_path / "broken.json").write_text("{")
    assert_one_line_error(run_cli(str(tmp_path / "broken.json")), "broken.json", "invalid JSON")


def test_the_proxy_never_imports_the_engine_side() -> None:
    """JSON lines, signals and run files are the whole interface: `microgpt run` loads no trainer, step or model."""
    code = "import sys, microgpt.training_proxy; print(' '.join(m for m in sys.modules if m.startswith('microgpt')))"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    loaded = set(res.stdout.split())
    assert res.returncode == 0 and "microgpt.proxy.supervisor" in loaded, res.stderr
    engine_side = {
        "microgpt.run.trainer",
        "microgpt.engine.step",
        "microgpt.engine.state",
        "microgpt.engine.model",
        "microgpt.engine.backend",
        "microgpt.cli",
        "microgpt.kernels",
    }
    assert not loaded & engine_side, sorted(loaded & engine_side)
