"""Shared test helpers: a tiny experiment file and a way to run the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

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
    return subprocess.run([sys.executable, "-m", "microgpt.cli", *args], capture_output=True, text=True, env=env,
                          cwd=kw.pop("cwd", REPO), timeout=kw.pop("timeout", 300), **kw)  # fmt: skip


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def tiny_exp(tmp_path: Path) -> Path:
    return write_experiment(tmp_path)
