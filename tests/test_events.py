"""The engine's event lines (microgpt/events.py): the heartbeat among them, every line whole."""

from __future__ import annotations

from pathlib import Path

from microgpt.events import HEARTBEAT_ENV
from tests.conftest import cli, json_lines, write_experiment


def test_the_engine_beats_and_every_line_stays_whole(tmp_path: Path) -> None:
    """With a heartbeat every 10 ms the beats land among the step, eval and checkpoint lines (whose start line is
    kilobytes long): every stdout line is one JSON object, the run's own lines all there, in order."""
    exp = write_experiment(tmp_path, train={"steps": 30, "eval_every": 10, "ckpt_every": 10})
    res = cli("train", str(exp), "--out", str(tmp_path / "run"), "--json", env={HEARTBEAT_ENV: "0.01"})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    events = json_lines(res.stdout, beats=True)
    assert len(events) == len(lines)  # nothing torn, nothing interleaved inside a line
    beats = [e for e in events if e["event"] == "heartbeat"]
    rest = [e for e in events if e["event"] != "heartbeat"]
    assert beats and all(set(e) == {"event", "uptime_s"} for e in beats)
    assert [e["step"] for e in rest if e["event"] == "step"] == list(range(1, 31))
    assert rest[0]["event"] == "start" and [e["step"] for e in rest if e["event"] == "done"] == [30]


def test_a_bad_heartbeat_interval_is_one_line(tmp_path: Path) -> None:
    res = cli("train", str(write_experiment(tmp_path)), "--out", str(tmp_path / "run"), env={HEARTBEAT_ENV: "nan"})
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"error: {HEARTBEAT_ENV} must be a finite number in [0.01, 3600], got 'nan'"
    ], res.stderr
