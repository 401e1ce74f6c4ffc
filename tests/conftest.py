"""Shared test helpers: a tiny experiment file and a way to run the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.proxy._cdp import Chromium, chromium_binary

# Property tests (tests/test_properties.py) are deterministic in CI: the same examples on every run, no example
# database, no deadline (a busy 2-core machine must not turn a slow example into a failure).
settings.register_profile(
    "microgpt",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("microgpt")

REPO = Path(__file__).resolve().parent.parent

TINY = {
    "name": "tiny-test",
    "model": {"vocab_size": 256, "d_model": 32, "n_layer": 2, "n_head": 4, "seq_len": 32},
    "train": {"micro_batch": 4, "n_micro": 2, "steps": 6, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2,
              "eval_every": 3, "eval_batches": 2, "ckpt_every": 100, "seed": 7},
    "data": {"source": "builtin", "max_bytes": 400000, "val_fraction": 0.3},
}  # fmt: skip


def write_experiment(folder: Path, **sections: dict) -> Path:
    """TINY with per-section overrides, written to folder/exp.json."""
    raw = json.loads(json.dumps(TINY))
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    path = folder / "exp.json"
    path.write_text(json.dumps(raw))
    return path


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    """Run `python -m microgpt.cli ARGS` to completion, capturing output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-m", "microgpt.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=kw.pop("cwd", REPO),
        timeout=kw.pop("timeout", 300),
        **kw,
    )


def json_lines(stdout: str, beats: bool = False) -> list[dict]:
    """The JSON lines of a command's stdout; heartbeats (microgpt/events.py) only if beats: a run's heartbeat thread
    beats every 10 s from start to exit, between and after any of its records, so a run slowed by load has them
    wherever a test looks (the last two lines of a run: "stopped" or "done", then "report", are not so then)."""
    recs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return recs if beats else [r for r in recs if r.get("event") != "heartbeat"]


@pytest.fixture
def tiny_exp(tmp_path: Path) -> Path:
    return write_experiment(tmp_path)


@pytest.fixture(scope="session")
def run_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY with a 256-token context (a ChatML turn in bytes is ~50 tokens), trained 3 steps: the run folder that
    the tests of sample, chat and serve share."""
    tmp = tmp_path_factory.mktemp("run256")
    exp = write_experiment(tmp, model={"seq_len": 256})
    res = cli("train", str(exp), "--steps", "3", "--out", str(tmp / "r"))
    assert res.returncode == 0, res.stderr
    return tmp / "r"


@contextmanager
def tmpfs(where: Path, size: int, read_only: bool = False) -> Iterator[Path]:
    """A real tmpfs of `size` bytes mounted at `where` (root: CAP_SYS_ADMIN), unmounted after; the test is skipped,
    saying why, where it cannot be mounted."""
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(res.stderr or res.stdout).strip() or res.returncode})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def one_error(res: subprocess.CompletedProcess, code: int, *needles: str, after_progress: bool = False) -> str:
    """Exit `code`, no traceback, and exactly one `error: ...` line on stderr holding every needle: stderr's only
    line, or with after_progress its last (progress lines may come before it). The line."""
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = res.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    assert lines[-1] == errors[0] if after_progress else lines == errors, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    """Headless Chromium driven over its DevTools protocol (tests/proxy/_cdp.py): the dashboard's and serve's chat
    page's tests. Missing: skipped where MICROGPT_SKIP_BROWSER=1 says so (scripts/test-browser.sh), else a failure."""
    binary = chromium_binary()
    if binary is None:
        if os.environ.get("MICROGPT_SKIP_BROWSER") == "1":
            pytest.skip("no chromium and MICROGPT_SKIP_BROWSER=1")
        pytest.fail("chromium is not installed: apt-get install -y chromium (or set MICROGPT_SKIP_BROWSER=1)")
    chrome = Chromium(tmp_path / "profile", binary)
    yield chrome
    chrome.close()
