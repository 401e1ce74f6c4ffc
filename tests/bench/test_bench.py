"""bench/bench.py on the CPU: the whole command on the tiny shape (PyTorch eager on the CPU, microgpt under the Triton
interpreter), a row that fails kept as a row, and the energy columns from a counter and from power x time. No
timing is asserted: these check that the GPU run's table comes out whole and says what it measured."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import bench
from tests.conftest import REPO


def run_bench(tmp_path: Path, *args: str, interpret: bool) -> tuple[subprocess.CompletedProcess, list[dict], list]:
    """(the process, its JSON rows, the table's lines as lists of cells) of bench.py --shape tiny ARGS."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (
        {"TRITON_INTERPRET": "1"} if interpret else {}
    )
    rows = tmp_path / "rows.jsonl"
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "bench.py"),
            "--shape",
            "tiny",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--jsonl",
            str(rows),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    table = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in res.stdout.splitlines()
        if line.startswith("|")
    ]
    return res, [json.loads(line) for line in rows.read_text().splitlines()], table


@pytest.mark.slow
def test_tiny_shape_runs_both_engines_on_the_cpu(tmp_path: Path) -> None:
    res, rows, table = run_bench(
        tmp_path, "--impls", "eager", "microgpt", "--precision", "fp32", "--steps", "1", interpret=True
    )
    assert res.returncode == 0, res.stderr
    assert [r["impl"] for r in rows] == ["eager", "microgpt"] and not any(r["error"] for r in rows), rows
    eager, mine = rows
    assert eager["n_micro"] == mine["n_micro"] == 2 and eager["device"] == mine["device"] == "cpu"
    # the same model from the same init on the same batches: microgpt fp32 against torch's bf16 autocast
    assert mine["loss_first"] == pytest.approx(eager["loss_first"], abs=2e-2)
    assert mine["planned"] > 0 and all(r["tokens_per_s"] > 0 for r in rows)
    header, sep, *body = table
    assert header == bench.COLUMNS and len(sep) == len(header) and len(body) == 2
    for cells, r in zip(body, rows):
        got = dict(zip(header, cells))
        assert len(cells) == len(header) and got["impl"] == r["impl"] and got["micro-batch"] == "2 x 2"
        assert got["tokens/J"] == got["J/step"] == got["energy"] == "-"  # no GPU: nothing measured, and no 0 shown


@pytest.mark.slow
def test_the_modern_row_trains_the_modern_block_with_muon(tmp_path: Path) -> None:
    """microgpt-modern: the shape's modern twin (bench.MODERN) under Muon, through the interpreter here; its FLOPs a
    token leave out the untied embedding's lookup."""
    res, rows, _ = run_bench(
        tmp_path, "--impls", "microgpt-modern", "--precision", "fp32", "--steps", "1", interpret=True
    )
    assert res.returncode == 0, res.stderr
    (row,) = rows
    assert not row["error"] and row["planned"] > 0 and row["tokens_per_s"] > 0, row
    m = bench.MODERN["tiny"]
    assert row["loss_first"] == pytest.approx(math.log(m.vocab_size), abs=1e-3)  # the zero head: a uniform prediction
    assert bench.flops_per_token(m) == 6 * 12 * m.n_layer * m.d_model**2 + 6 * m.vocab_size * m.d_model + 12 * (
        m.n_layer * m.seq_len * m.d_model
    )


def test_a_failed_row_stays_a_row(tmp_path: Path) -> None:
    res, rows, table = run_bench(tmp_path, "--impls", "microgpt", "eager", "--n-micro", "1", interpret=False)
    assert res.returncode == 0, res.stderr
    assert "needs a CUDA GPU" in rows[0]["error"] and not rows[1]["error"]
    header, _, failed, measured = table
    assert len(failed) == len(measured) == len(header)
    assert failed[0] == "microgpt" and failed[3].startswith("failed: ") and "CUDA" in failed[3]
    assert measured[0] == "eager" and measured[2] == "2" and float(measured[3].replace(",", "")) > 0


def sampled(clocks: bench.Clocks) -> None:
    """Wait for the sampler thread's first reading (every 50 ms), however busy the machine."""
    deadline = time.monotonic() + 60
    while not clocks.samples and time.monotonic() < deadline:
        time.sleep(0.01)


def test_energy_from_the_counter_and_from_power_x_time() -> None:
    readings = iter([1000.0, 1042.5])
    with bench.Clocks(lambda: next(readings), read=lambda: (1500.0, 400.0)) as clocks:
        clocks.start()
        sampled(clocks)
    got = clocks.means()
    assert got["energy"] == "counter" and got["joules"] == 42.5 and got["watts"] == 400.0
    assert got["joules_power"] == pytest.approx(400.0 * got["window_s"])
    assert bench.per_joule(got, 1000, 5) == {"joules_per_step": 8.5, "tokens_per_j": 5000 / 42.5}

    def broken() -> float:  # a counter that fails at the end of the window
        raise RuntimeError("NVML: unknown error")

    for counter in (None, iter([1000.0]).__next__, broken):
        with bench.Clocks(counter, read=lambda: (1500.0, 400.0)) as clocks:
            clocks.start()
            sampled(clocks)
        got = clocks.means()
        assert got["energy"] == "power x time" and got["joules"] == pytest.approx(400.0 * got["window_s"]), counter


def test_no_nvml_measures_nothing() -> None:
    def missing() -> tuple[float, float]:
        raise ModuleNotFoundError("No module named 'pynvml'")

    with bench.Clocks(None, read=missing) as clocks:
        clocks.start()
    got = clocks.means()
    assert set(got) == {"window_s"} and bench.per_joule(got, 1000, 5) == {}


def test_table_shows_the_energy_columns() -> None:
    row = {
        "impl": "microgpt",
        "mb": 16,
        "n_micro": 4,
        "precision": "bf16",
        "tokens_per_s": 600_000.0,
        "tokens_per_j": 1234.4,
        "joules_per_step": 35.25,
        "mfu": 0.5,
        "step_ms": 55.0,
        "sm_mhz": 1600.0,
        "watts": 650.0,
        "peak": 2**30,
        "planned": 2**30,
        "peak_first": 2**30,
        "peak_steady": 2**30,
        "energy": "counter",
    }
    header, _, cells = (line.strip("|").split(" | ") for line in bench.table([row]).splitlines())
    got = dict(zip([h.strip() for h in header], [c.strip() for c in cells]))
    assert got["micro-batch"] == "16 x 4" and got["tokens/s"] == "600,000" and got["tokens/J"] == "1,234"
    assert got["J/step"] == "35.25" and got["W"] == "650" and got["energy"] == "counter"
    assert got["vs microgpt bf16"] == "1.00x" and got["steady vs plan"] == "+0.0%"


def test_table_says_when_the_energy_window_was_too_short() -> None:
    """A row timed over less than COARSE_S reads the energy counter coarsely: its energy cell says so, with the
    window; a longer one, or one without a window, is just where the joules came from."""
    row = {
        "impl": "microgpt",
        "mb": 8,
        "tokens_per_s": 500_000.0,
        "tokens_per_j": 700.0,
        "joules_per_step": 11.7,
        "mfu": 0.45,
        "step_ms": 16.4,
        "energy": "counter",
    }
    for window, want in ((0.44, "counter, coarse (0.44 s)"), (2.36, "counter"), (None, "counter")):
        r = row if window is None else {**row, "window_s": window}
        header, _, cells = (line.strip("|").split(" | ") for line in bench.table([r]).splitlines())
        assert dict(zip([h.strip() for h in header], [c.strip() for c in cells]))["energy"] == want
