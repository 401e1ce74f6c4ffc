"""The dashboard right on every path, server side: `/` keeps the URL's parameters, a folder `microgpt train` wrote
(train.jsonl only, live or finished) is a run with real times, a state made from its log (phase "train") and its
report card's samples, rows without a time are gaps (never the Unix epoch), and the standalone server is quiet."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

from microgpt.proxy.dashboard import DashboardServer
from microgpt.proxy.dashdata import columns, view
from microgpt.runlog import read_log
from tests.conftest import REPO, cli, write_experiment
from tests.proxy.test_dashboard import request


def test_the_root_keeps_the_urls_parameters(tmp_path: Path) -> None:
    (tmp_path / "r.loss.json").write_text('{"format": "microgpt-loss-1"}')
    server = DashboardServer(tmp_path, "r", 0)
    server.start()
    try:
        for path, want in (
            ("/?x=time", "?run=r&x=time"),
            ("/?x=time&interval=500", "?run=r&x=time&interval=500"),
            ("/?run=other&x=tokens", "?run=other&x=tokens"),
            ("/", "?run=r"),
        ):
            resp = request(server, "GET", path)
            assert resp.status == 302 and resp.getheader("Location") == f"/live-loss-dashboard.html{want}", path
    finally:
        server.close()


def test_a_folder_train_wrote_is_served_from_its_log(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path)
    out = tmp_path / "run"
    assert cli("train", str(exp), "--out", str(out)).returncode == 0
    log = read_log(out / "train.jsonl")
    server = DashboardServer(out, None, 0)
    server.start()
    try:
        runs = json.loads(request(server, "GET", "/api/runs").body)["runs"]
        assert runs == ["tiny-test"]
        ans = json.loads(request(server, "GET", "/api/loss?run=tiny-test&width=100").body)
        steps = [e for e in log if e["event"] == "step"]
        assert ans["series"]["loss"]["y"] == [e["loss"] for e in steps]
        assert ans["clock"]["time"] == [e["time"] for e in steps] and ans["first_time"] == steps[0]["time"]
        assert ans["clock"]["elapsed"] == [e["elapsed_s"] for e in steps]
        assert ans["meta"]["peak_flops"] is None and ans["meta"]["flops_per_token"] > 0
        first = request(server, "GET", "/api/state?run=tiny-test")
        state = json.loads(first.body)
        assert (state["status"], state["step"], state["target_step"], state["phase"]) == ("done", 6, 6, "train")
        again = request(server, "GET", "/api/state?run=tiny-test")
        assert again.getheader("ETag") == first.getheader("ETag")  # unchanged log: the same tag
        # its samples are its report card's: the final weights', at their step
        card = json.loads((out / "report.json").read_text())
        samples = json.loads(request(server, "GET", "/api/samples?run=tiny-test").body)
        assert samples["format"] == "microgpt-samples-1" and samples["phase"] == "train"
        assert [(s["step"], s["phase"], s["prompt"], s["text"]) for s in samples["samples"]] == [
            (6, "train", c["prompt"], c["text"]) for c in card["samples"]
        ] and len(card["samples"]) == 3
        (out / "report.json").write_text("{not json")  # a card being rewritten: no samples rather than an error
        assert request(server, "GET", "/api/samples?run=tiny-test").status == 404
    finally:
        server.close()


def test_a_log_with_unreadable_lines_is_served_from_the_rest(tmp_path: Path) -> None:
    """The dashboard reads a `train` folder's log with the log's one reader (runlog.parse_log): lines that are no
    record (a string step, NaN, a line cut short) are passed over, counted in the state, and the rest is served."""
    exp = write_experiment(tmp_path)
    out = tmp_path / "run"
    assert cli("train", str(exp), "--out", str(out)).returncode == 0
    steps = [e for e in read_log(out / "train.jsonl") if e["event"] == "step"]
    with open(out / "train.jsonl", "a") as f:
        f.write('{"event":"step","step":"7","loss":1.0}\n{"event":"step","step":7,"loss":NaN}\n{"event":"st')
    server = DashboardServer(out, None, 0)
    server.start()
    try:
        ans = json.loads(request(server, "GET", "/api/loss?run=tiny-test&width=100").body)
        assert ans["series"]["loss"]["y"] == [e["loss"] for e in steps]
        state = json.loads(request(server, "GET", "/api/state?run=tiny-test").body)
        assert (state["status"], state["step"], state["unreadable_lines"]) == ("done", 6, 3)
    finally:
        server.close()


def test_a_linked_log_is_no_run(tmp_path: Path) -> None:
    """A train.jsonl that is a symbolic link (to a log outside, in a folder or at the root) makes no run: it is read
    through the one resolver like every run file (dashdata.RunFolder.open), never followed."""
    exp = write_experiment(tmp_path)
    assert cli("train", str(exp), "--out", str(tmp_path / "real")).returncode == 0
    root = tmp_path / "runs"
    (root / "linked").mkdir(parents=True)
    (root / "linked" / "train.jsonl").symlink_to(tmp_path / "real" / "train.jsonl")
    (root / "train.jsonl").symlink_to(tmp_path / "real" / "train.jsonl")
    (root / "r.loss.json").write_text('{"format": "microgpt-loss-1"}')  # one real run, so the folder serves
    server = DashboardServer(root, None, 0)
    server.start()
    try:
        assert json.loads(request(server, "GET", "/api/runs").body)["runs"] == ["r"]
        for path in ("/api/loss?run=linked/tiny-test", "/api/state?run=linked/tiny-test", "/api/state?run=tiny-test"):
            assert request(server, "GET", path).status == 404, path
    finally:
        server.close()


def test_rows_without_a_time_are_gaps_not_the_epoch() -> None:
    """A log of an older version adopted by the proxy: its rows say no time; they stay unknown (null)."""
    rows = [
        {"step": 1, "loss": 3.0, "tokens": 8, "time": None},
        {"step": 2, "loss": 2.9, "tokens": 8},
        {"step": 3, "loss": 2.8, "tokens": 8, "time": 1.8e9, "elapsed_s": 4.5},
    ]
    ans = view(columns({"train": rows, "val": [], "marks": []}, "v1"), 100)
    assert ans["clock"]["time"] == [None, None, 1.8e9] and ans["clock"]["elapsed"] == [None, None, 4.5]
    assert ans["first_time"] == 1.8e9


def test_the_standalone_server_does_not_log_every_request(tmp_path: Path) -> None:
    (tmp_path / "r.loss.json").write_text('{"format": "microgpt-loss-1", "train": [], "val": [], "marks": []}')
    cmd = [sys.executable, "-m", "microgpt.proxy.dashboard", str(tmp_path), "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        first = proc.stderr.readline()
        port = int(re.search(r"127\.0\.0\.1:(\d+)/", first).group(1))
        server = type("S", (), {"httpd": type("H", (), {"port": port})()})()  # what request() reads
        for _ in range(5):
            assert request(server, "GET", "/api/loss?run=r&width=50").status == 200
        assert request(server, "GET", "/nope.json").status == 404
    finally:
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    assert first.startswith("dashboard: http://127.0.0.1:") and rest.strip() == "", rest
