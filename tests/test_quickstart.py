"""The README's quick start plumbing: `make test` (Makefile) gets the browser the dashboard's tests need or says,
before the tests start, that it skips them; CI runs exactly the README's test command."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from tests.conftest import REPO

SOURCE = ". scripts/test-browser.sh && echo skip=${MICROGPT_SKIP_BROWSER:-}"


def fake_path(tmp_path: Path, tools: list[str]) -> str:
    """A PATH holding only these real tools (a machine without chromium or apt-get, say)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def source_script(path: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("MICROGPT_SKIP_BROWSER", "CI")}
    return subprocess.run(
        [shutil.which("sh"), "-c", SOURCE],
        cwd=REPO,
        env={**base, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_no_chromium_and_no_apt_get_says_what_it_skips(tmp_path: Path) -> None:
    r = source_script(fake_path(tmp_path, ["id"]))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "skip=1"
    assert lines[0].startswith("make test: chromium is not installed") and "will be SKIPPED" in lines[0]


def test_no_chromium_on_ci_skips_nothing(tmp_path: Path) -> None:
    r = source_script(fake_path(tmp_path, ["id"]), CI="true")
    assert r.stdout.splitlines() == [
        "make test: chromium could not be installed: on CI the dashboard's browser tests will FAIL",
        "skip=",
    ]


def test_chromium_present_is_silent(tmp_path: Path) -> None:
    path = fake_path(tmp_path, ["id"])
    (Path(path) / "chromium").symlink_to(shutil.which("true"))
    r = source_script(path)
    assert r.stdout.splitlines() == ["skip="]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    assert "make test      #" in readme
    commands = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and line[0] not in "#"]
    assert commands[-1] == "make test"
    assert not any("pytest" in c or "apt-get" in c for c in commands)
    makefile = (REPO / "Makefile").read_text()
    assert "\t@. scripts/test-browser.sh && $(TEST_BIN)/python -m pytest -q\n" in makefile


def test_numpy_below_2_3_is_a_test_pin_only() -> None:
    """The engine runs on any NumPy from 1.26 (2.3+ included); only the Triton interpreter the tests use needs <2.3."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = [d for d in project["dependencies"] if d.startswith("numpy")]
    assert runtime == ["numpy>=1.26"]
    assert "numpy>=1.26,<2.3" in project["optional-dependencies"]["test"]


def fake_venv(tmp_path: Path, name: str) -> Path:
    """A virtual environment as the Makefile sees one: bin/python, bin/pip that logs its calls, and the stamp."""
    venv = tmp_path / name
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(shutil.which("true"))
    pip = venv / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\necho "$@" >> {venv / "pip.log"}\n')
    pip.chmod(0o755)
    return venv


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)


def test_train_and_test_have_their_own_environments_each_set_up_once(tmp_path: Path) -> None:
    """`make test` installs the test extra (NumPy < 2.3) in .venv-test, never into .venv, which `make train` and the
    README's later commands use; each is installed once, again only when pyproject.toml changes."""
    train, test = fake_venv(tmp_path, "train"), fake_venv(tmp_path, "test")
    flags = [f"VENV={train}", f"TEST_VENV={test}"]
    assert make("setup", *flags).returncode == 0 and make("setup-test", *flags).returncode == 0
    assert (train / "pip.log").read_text().splitlines() == ["install -q --upgrade pip", "install -q -e ."]
    assert (test / "pip.log").read_text().splitlines() == ["install -q --upgrade pip", "install -q -e .[test]"]
    assert make("-q", "setup", *flags).returncode == 0  # up to date: a second `make train` installs nothing
    assert make("-q", "setup-test", *flags).returncode == 0
    os.utime(train / ".installed", (0, 0))  # pyproject.toml is newer than the stamp: install again
    assert make("-q", "setup", *flags).returncode == 1


def test_make_train_is_the_modern_recipe_and_starts_as_the_readme_shows(tmp_path: Path) -> None:
    """`make train` as it is trains the modern recipe into runs/ANDREA-tiny-MODERN; its first step prints what the
    README's excerpt shows (the same built-in corpus, seed and 300-step schedule, stopped after 2 steps; another
    CPU's BLAS may round the norm's last digit, so the loss and lr are compared to the digit, the norm to 0.002)."""
    from tests.test_readme_flow import this_venv

    venv = this_venv(tmp_path)
    dry = subprocess.run(["make", "-n", "-C", str(REPO), "train", f"VENV={venv}"], capture_output=True, text=True)
    want = "microgpt train experiments/ANDREA-tiny-MODERN-TRAIN.json --out runs/ANDREA-tiny-MODERN --resume latest"
    assert dry.returncode == 0 and f"{venv}/bin/{want} \n" in dry.stdout, dry.stdout

    readme = (REPO / "README.md").read_text()
    shown = re.search(r"^step +1/300 \| loss ([\d.]+) \| lr (\S+) \| norm ([\d.]+) \|", readme, re.M)
    assert shown and "report card: runs/ANDREA-tiny-MODERN/report.md" in readme
    run = tmp_path / "runs" / "ANDREA-tiny-MODERN"
    flags = ["--steps", "2", "--set", "train.schedule_steps=300"]
    env = {**os.environ, "MICROGPT_DATA_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    made = subprocess.run(
        ["make", "-C", str(REPO), "train", f"VENV={venv}", f"RUN={run}", f"TRAIN_FLAGS={' '.join(flags)}",
         "SAMPLE_TOKENS=4"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    got = re.search(r"^step +1/2 \| loss ([\d.]+) \| lr (\S+) \| norm ([\d.]+) \|", made.stderr, re.M)
    assert got and got.groups()[:2] == shown.groups()[:2], (got and got[0], shown[0])
    assert abs(float(got[3]) - float(shown[3])) <= 0.002
