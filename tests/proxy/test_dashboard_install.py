"""A non-editable `pip install .` into a fresh venv serves the dashboard page: the page is package data.

The install is built from a copy of the tree (so nothing of the checkout leaks in) and run from a folder outside
it with no PYTHONPATH, and the test checks that `microgpt` is the venv's. No network: the wheel is built with this
interpreter's setuptools (--no-build-isolation; a fresh venv's bundled setuptools is too old for pyproject.toml)
and installed with --no-deps --no-index (the dashboard server needs nothing beyond the standard library).
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from microgpt.proxy.dashboard import PAGE, PAGE_NAME
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # a wheel build and a venv: 3.5 s on a 2-core machine

ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
ENV.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONUNBUFFERED="1")


def sh(*cmd: str | Path, cwd: Path) -> str:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{cmd}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def install(tmp_path: Path) -> Path:
    """pip install the tree's copy into a fresh venv (non-editable); the venv's python."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "microgpt", src / "microgpt", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    sh(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        tmp_path / "dist",
        src,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("microgpt-*.whl")
    sh(sys.executable, "-m", "venv", "--without-pip", tmp_path / "venv", cwd=tmp_path)
    python = tmp_path / "venv" / "bin" / "python"
    sh(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel, cwd=tmp_path)
    return python


def test_a_pip_installed_package_serves_the_dashboard_page(tmp_path: Path) -> None:
    python = install(tmp_path)
    elsewhere = tmp_path / "elsewhere"  # cwd outside the checkout and the copy: only the venv can provide microgpt
    run_dir = elsewhere / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "r.loss.json").write_text('{"format": "microgpt-loss-1"}')
    where = sh(python, "-c", "import microgpt.proxy.dashboard as d; print(d.__file__); print(d.PAGE)", cwd=elsewhere)
    module, page = (Path(line) for line in where.splitlines())
    venv = (tmp_path / "venv").resolve()
    assert module.is_relative_to(venv) and page.is_relative_to(venv) and page.name == PAGE_NAME, where
    proc = subprocess.Popen(
        [str(python), "-m", "microgpt.proxy.dashboard", str(run_dir), "--port", "0"],
        cwd=elsewhere,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        match = re.match(r"dashboard: http://127\.0\.0\.1:(\d+)/", line)
        assert match, line + proc.stderr.read()
        conn = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=10)
        conn.request("GET", f"/{PAGE_NAME}?run=r")
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        assert resp.status == 200 and resp.getheader("Content-Type") == "text/html; charset=utf-8"
        assert body == PAGE.read_bytes()
        for name in ("uPlot.iife.min.js", "uPlot.min.css"):  # the chart library is package data too
            conn = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=10)
            conn.request("GET", f"/vendor/uplot/{name}")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read() == (PAGE.parent / "vendor" / "uplot" / name).read_bytes()
            conn.close()
    finally:
        proc.send_signal(signal.SIGINT)  # the standalone server's Ctrl-C: close and exit 0
        assert proc.wait(timeout=10) == 0
        proc.stderr.close()
