"""A data mixture under the proxy (docs/FIREHOSE-BANDIT.md): the run's .loss.json rows carry the per-source
losses and weights, .state.json the current weights, and the dashboard (headless Chromium, from the run's files)
draws one weight line per source. Screenshot: test-artifacts/dashboard-mixture.png."""

from __future__ import annotations

from pathlib import Path

from tests.data.test_mixing import SOURCES, write_sources
from tests.proxy._helpers import REPO, run_to_end, write_exp
from tests.proxy.test_dashboard_browser import ARTIFACTS, drawn


def test_mixture_weights_in_the_run_files_and_on_the_dashboard(tmp_path: Path, browser) -> None:  # noqa: F811
    root = write_sources(tmp_path / "src")
    data = {"source": "shards", "path": str(root), "tokenizer": "bytes"}
    mixing = {"policy": "firehose", "prior": "uniform", "warmup_steps": 5}
    exp = write_exp(tmp_path, train={"steps": 40, "n_micro": 2, "ckpt_every": 20}, data=data, mixing=mixing)
    run = run_to_end(exp, tmp_path / "run")
    loss, state = run.file("loss"), run.file("state")
    rows = loss["train"]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(list(r["mixture"]) == list(SOURCES) and r["source_loss"] for r in rows)
    assert state["mixture"] == rows[-1]["mixture"] and state["mixture"] != rows[0]["mixture"]
    assert all(set(v["source_val_loss"]) == set(SOURCES) for v in loss["val"])
    page = REPO / "scripts" / "live-loss-dashboard.html"
    browser.open(page.as_uri())
    browser.wait_dataset(lambda ds: ds.get("source") == "files", "file mode")
    browser.set_files("#files", [run.out / f"proxy-test.{k}.json" for k in ("loss", "state", "samples")])
    ds = browser.wait_dataset(lambda ds: drawn(loss)(ds) and ds.get("mixSources") == "3", "three mixture lines")
    assert ds["mixPoints"] == str(3 * len(rows))
    assert browser.eval("document.getElementById('mix-legend').textContent").split() == [
        "■",
        SOURCES[0],
        "■",
        SOURCES[1],
        "■",
        SOURCES[2],
    ]
    browser.screenshot(ARTIFACTS / "dashboard-mixture.png")
