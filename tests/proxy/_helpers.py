"""Helpers for the proxy tests: a tiny experiment, and a real `microgpt run` subprocess to watch and signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]

# About 5 ms a step on one core: a 300-step run takes a few seconds, so a test that signals at step 50
# keeps a wide margin before the run would end on its own.
# One BLAS thread: with a tiny model, OpenBLAS threads on a busy 2-core machine made steps 10x slower.
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
EXP: dict[str, Any] = {
    "name": "proxy-test",
    "model": {"vocab_size": 256, "d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 32},
    "train": {"micro_batch": 4, "steps": 300, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5, "eval_every": 20,
              "eval_batches": 2, "ckpt_every": 20, "seed": 11},
    "data": {"source": "builtin", "max_bytes": 400000, "val_fraction": 0.3},
    "proxy": {"sample_every": 0, "flush_s": 0.05, "backoff_s": 0.05, "hang_timeout_s": 60, "startup_timeout_s": 60},
}  # fmt: skip
# MICROGPT_PROXY_BACKEND=triton runs the same tests over the triton engine (on the GPU machine: bf16, the step as one
# CUDA graph). Its steps take a few milliseconds, so the run is longer, to keep the margin after a signal at step 50.
if os.environ.get("MICROGPT_PROXY_BACKEND") == "triton":
    EXP["train"].update(backend="triton", precision="bf16", steps=1000)


def write_exp(folder: Path, name: str = "exp.json", **sections: Any) -> Path:
    """EXP with sections merged field by field (a non-dict value replaces the section)."""
    raw = json.loads(json.dumps(EXP))
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key].update(value)
        else:
            raw[key] = value
    path = folder / name
    path.write_text(json.dumps(raw))
    return path


def read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


class ProxyRun:
    """`python -m microgpt.cli run EXP --out OUT ARGS` in the background; output goes to files in OUT's parent."""

    def __init__(self, exp: Path, out: Path, *args: str, run: str = "proxy-test"):
        self.out, self.run = out, run
        self.log = out.parent / f"{out.name}.proxy.log"
        cmd = [sys.executable, "-m", "microgpt.cli", "run", str(exp), "--out", str(out), *args]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=ENV
            )

    def file(self, kind: str) -> dict[str, Any] | None:
        return read(self.out / f"{self.run}.{kind}.json")

    def steps(self) -> list[int]:
        loss = self.file("loss")
        return [r["step"] for r in loss["train"]] if loss else []

    def wait_for(self, pred: Callable[[], Any], what: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = pred()
            except (ValueError, KeyError, TypeError):  # a file between two states of the run
                got = None
            if got:
                return got
            if self.proc.poll() is not None:
                raise AssertionError(f"proxy exited ({self.proc.returncode}) waiting for {what}:\n{self.output()}")
            time.sleep(0.01)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{self.output()}")

    def engine_pid(self) -> int:
        return self.wait_for(lambda: (self.file("state") or {}).get("engine_pid"), "an engine pid")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"proxy did not finish in {timeout} s:\n{self.output()}") from None

    def output(self) -> str:
        text = self.log.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if not ln.startswith("step ")]  # the engine's per-step progress
        return "\n".join(lines[-60:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def run_to_end(exp: Path, out: Path, *args: str, timeout: float = 120) -> ProxyRun:
    run = ProxyRun(exp, out, *args)
    rc = run.wait(timeout)
    assert rc == 0, f"proxy exit code {rc}:\n{run.output()}"
    return run


def ckpt_bytes(out: Path, step: int) -> bytes:
    return (out / "ckpt" / f"step-{step:08d}.bin").read_bytes()


def assert_every_step_once(steps: list[int], last: int) -> None:
    assert steps == list(range(1, last + 1)), f"history steps are not 1..{last} once each: {steps}"
