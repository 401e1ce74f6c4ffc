"""The dashboard in a real headless Chromium: loaded from the proxy's server during a real run, it draws as
many points as .loss.json holds and draws new ones as the run advances, without a reload; opened from disk
with the run's files chosen in its file input, it draws them too. Screenshots go to test-artifacts/.

Needs Debian's `chromium` (CI: `apt-get install -y chromium`). Set MICROGPT_SKIP_BROWSER=1 to skip on a
machine without it; otherwise a missing browser is a failure, so CI cannot pass without this check.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from microgpt.runlog import LOG_NAME, read_log
from tests.proxy._cdp import Chromium
from tests.proxy._helpers import REPO, ProxyRun, write_exp
from tests.test_hellaswag import EXAMPLES as HELLASWAG

ARTIFACTS = REPO / "test-artifacts"


def freeze(run: ProxyRun, pid: int) -> dict:
    """Stop the engine (SIGSTOP) and wait until the proxy has written everything it printed: as many train and val
    rows as the engine's own log (train.jsonl) has step and eval records, unchanged for 0.5 s. Unchanged alone is
    not enough: the proxy's unforced flushes wait 10x its last write, so a busy machine's slow writes hold rows it
    has read for longer than that. The engine appends a record to its log before it prints it: stopped between the
    two, its log stays one record ahead, which 3 s unchanged settles."""
    os.kill(pid, signal.SIGSTOP)
    last, stable_since = None, time.monotonic()
    while True:
        loss = run.file("loss")
        sig = (len(loss["train"]), len(loss["val"]), len(loss["marks"]))
        if sig != last:
            last, stable_since = sig, time.monotonic()
        still = time.monotonic() - stable_since
        if still >= 3 or (still >= 0.5 and sig[:2] == logged(run.out / LOG_NAME)):
            return loss
        time.sleep(0.02)


def logged(path: Path) -> tuple[int, int]:
    """The step and eval records in an engine's log."""
    recs = read_log(path)
    return sum(r["event"] == "step" for r in recs), sum(r["event"] == "eval" for r in recs)


def drawn(loss: dict):
    """Every train row, every val loss and every HellaSwag accuracy of the eval rows (one row may hold both)."""
    n_train = len(loss["train"])
    n_val, n_hs = (sum(key in r for r in loss["val"]) for key in ("val_loss", "hellaswag"))
    return lambda ds: (
        ds.get("trainPoints") == str(n_train)
        and ds.get("lossRows") == str(n_train)
        and ds.get("valPoints") == str(n_val)
        and ds.get("hellaswagPoints") == ds.get("hellaswagNormPoints") == ds.get("hellaswagRows") == str(n_hs)
    )


def test_live_dashboard_draws_every_point_and_follows_the_run(tmp_path: Path, browser: Chromium) -> None:
    proxy = {"sample_every": 20, "prompts": ["def "], "sample_tokens": 24}
    hs = tmp_path / "hs.jsonl"  # HellaSwag every 15 steps, the val loss every 10: rows of one, the other, or both
    hs.write_text("".join(json.dumps(ex) + "\n" for ex in HELLASWAG))
    train = {"steps": 400, "eval_every": 10, "hellaswag": str(hs), "hellaswag_every": 15}
    exp = write_exp(tmp_path, train=train, proxy=proxy)
    run = ProxyRun(exp, tmp_path / "run", "--dashboard", "0")
    try:
        url = run.wait_for(lambda: run.file("state")["dashboard"], "the dashboard URL")
        pid = run.engine_pid()
        run.wait_for(lambda: len(run.steps()) >= 25, "25 steps")
        loss1 = freeze(run, pid)
        assert any("hellaswag" in r and "val_loss" not in r for r in loss1["val"])
        browser.open(f"{url}live-loss-dashboard.html?run=proxy-test&interval=200")
        ds = browser.wait_dataset(drawn(loss1), f"{len(loss1['train'])} train points")
        assert ds["source"] == "http" and ds["lastStep"] == str(loss1["train"][-1]["step"])
        assert ds["status"] == "running" and int(ds["marks"]) == len(loss1["marks"])
        browser.eval("window.sameDocument = 1")
        os.kill(pid, signal.SIGCONT)
        run.wait_for(lambda: len(run.steps()) >= len(loss1["train"]) + 40, "40 more steps")
        loss2 = freeze(run, pid)
        ds = browser.wait_dataset(drawn(loss2), f"{len(loss2['train'])} train points after the run advanced")
        assert int(ds["trainPoints"]) > len(loss1["train"]) and browser.eval("window.sameDocument") == 1
        assert int(ds["hellaswagPoints"]) > sum("hellaswag" in r for r in loss1["val"])  # new ones, by the poll
        assert browser.eval("document.getElementById('hs-card').hidden") is False
        assert browser.eval("document.getElementById('step').textContent").startswith(str(loss2["train"][-1]["step"]))
        browser.screenshot(ARTIFACTS / "dashboard-live.png")
        os.kill(pid, signal.SIGCONT)
        run.signal(signal.SIGTERM)
        assert run.wait() == 0, run.output()
    finally:
        run.kill()
    # The same page from disk, fed the run's files through its file input: a snapshot of the stopped run.
    loss = run.file("loss")
    page = REPO / "scripts" / "live-loss-dashboard.html"
    browser.open(page.as_uri())
    browser.wait_dataset(lambda ds: ds.get("source") == "files", "file mode")
    browser.set_files("#files", [run.out / f"proxy-test.{k}.json" for k in ("loss", "state", "samples")])
    ds = browser.wait_dataset(drawn(loss), f"{len(loss['train'])} points from the files")
    assert ds["status"] == "stopped" and ds["samples"] == str(len(run.file("samples")["samples"]))
    browser.screenshot(ARTIFACTS / "dashboard-files.png")
