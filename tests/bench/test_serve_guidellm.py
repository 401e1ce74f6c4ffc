"""bench/serve_guidellm.py: guidellm (an outside load generator, not a project dependency) against a real CPU
`microgpt serve`, by hand (a running server, the run's tokenizer written for guidellm) and from bench/serve.py
--guidellm (beside the decode step). guidellm is found as $GUIDELLM (a command, e.g. "/venv/bin/guidellm") or
`guidellm` on PATH; where neither runs, those tests are skipped and say so (CI does not install it). Without
guidellm: a command that cannot run or writes no report is one error line, exit 1. No timing is asserted."""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, json_lines

GUIDELLM = os.environ.get("GUIDELLM") or shutil.which("guidellm") or ""
needs_guidellm = pytest.mark.skipif(
    not GUIDELLM or not shutil.which(shlex.split(GUIDELLM)[0]),
    reason="guidellm is not installed here (not a project dependency): set GUIDELLM=/path/to/guidellm to run",
)


def script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/serve_guidellm.py", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=os.environ | (env or {}),
    )


@pytest.fixture(scope="module")
def server(run_256: Path) -> Iterator[str]:
    """`microgpt serve` on the 3-step run, a free port; its root URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "microgpt.cli", "serve", str(run_256), "--port", "0", "--max-batch", "4"],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:
            if line.startswith("serve: http://"):
                yield line.split()[1].removesuffix("/v1")
                break
        else:
            raise AssertionError(f"serve exited {proc.wait()} without a URL")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def check_rows(rows: list[dict], streams: list[int], prompt_tokens: int, tokens: int) -> None:
    """Every row: guidellm's streams, each completed stream all of its tokens, prompts of the asked length, no
    failure, and figures that add up."""
    assert [r["streams"] for r in rows] == streams and all(r["client"] == "guidellm" for r in rows)
    for r in rows:
        assert r["failures"] == 0 and r["completed"] > 0 and r["prompt_tokens"] == prompt_tokens, r
        assert r["completion_tokens"] == tokens * r["completed"], r
        # guidellm's own rate: its tokens over time, near the completed streams' tokens over the seconds
        assert math.isclose(r["tokens_per_s"], r["completion_tokens"] / r["seconds"], rel_tol=0.1), r
        assert 0 < r["ttft_ms"]["median"] <= r["ttft_ms"]["p99"] and 0 <= r["itl_ms"]["median"] <= r["itl_ms"]["p99"]
        assert 1 <= r["tokens_per_event"] <= tokens


@needs_guidellm
def test_guidellm_against_a_running_server_gives_a_row_per_concurrency(server: str, run_256: Path) -> None:
    res = script(
        *("--url", server, "--checkpoint", str(run_256), "--streams", "1", "3"),
        *("--prompt-tokens", "12", "--tokens", "6", "--seconds", "2", "--guidellm", GUIDELLM),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    check_rows(json_lines(res.stdout), [1, 3], 12, 6)


@needs_guidellm
def test_bench_serve_runs_guidellm_beside_the_decode_step() -> None:
    res = subprocess.run(
        [sys.executable, "bench/serve.py", "--device", "cpu", "--streams", "1", "2", "--prompts", "20"]
        + ["--tokens", "5", "--chat", "0", "--repeats", "1", "--guidellm", GUIDELLM, "--guidellm-seconds", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in json_lines(res.stdout) if r.get("client") == "guidellm"]
    check_rows(rows, [1, 2], 20, 5)
    for r in rows:
        assert r["prompt"] == "20" and math.isclose(
            r["of_decode_step"], r["tokens_per_s"] / r["decode_step_tokens_per_s"]
        )
    assert "| guidellm streams | prompt | tokens/s |" in res.stdout


def test_a_guidellm_that_cannot_run_or_writes_no_report_is_one_error_line(tmp_path: Path) -> None:
    args = ("--url", "http://127.0.0.1:9", "--tokenizer", str(tmp_path), "--streams", "1", "--seconds", "1")
    res = script(*args, "--guidellm", str(tmp_path / "no-guidellm"))
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.startswith(f"error: guidellm cannot be run ({str(tmp_path / 'no-guidellm')!r}): ")
    assert len(res.stderr.splitlines()) == 1
    res = script(*args, env={"GUIDELLM": f"{sys.executable} -c 'print(\"no report\")'"})
    assert res.returncode == 1 and res.stdout == "" and len(res.stderr.splitlines()) == 1
    assert res.stderr.startswith("error: guidellm at streams [1] exited 0 without its report: no report")
