"""pull-hermes3 on generated Hermes-format files: exact kept/skipped counts, locations, normalized output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from microgpt.data import pull
from microgpt.data.chatml import parse_record, render
from microgpt.data.sources import SourceError
from tests.conftest import cli
from tests.data.fixtures import GOOD_JSONL, normalized, write_hermes_folder, write_jsonl, write_parquet


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_jsonl_counts_lines_and_normalized_output(tmp_path: Path) -> None:
    where = write_jsonl(tmp_path / "in.jsonl")
    assert pull.main(["--from", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl")]) == 0
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert report["kept"] == len(GOOD_JSONL)
    assert report["skipped"] == sum(len(v) for v in where.values()) == 9
    assert report["skipped_by_reason"] == {k: len(v) for k, v in sorted(where.items())}
    assert report["where"] == {k: [f"{tmp_path / 'in.jsonl'}:{n}" for n in v] for k, v in sorted(where.items())}
    assert read_jsonl(tmp_path / "out.jsonl") == [normalized(r) for r in GOOD_JSONL]


def test_folder_of_every_format_with_a_truncated_parquet(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    expected = write_hermes_folder(tmp_path / "in")
    out = tmp_path / "out.jsonl"
    with pytest.raises(SourceError, match="1 input file.s. unreadable"):
        pull.main(["--from", str(tmp_path / "in"), "--out", str(out)])
    err = capsys.readouterr().err
    bad = [line for line in err.splitlines() if "d.parquet" in line]
    assert len(bad) == 1 and bad[0].startswith("  unreadable: ") and "unreadable Parquet" in bad[0]
    assert "error: " not in err  # the one error line is the SourceError's, printed by the entry point
    # the run went on: every other record was validated and kept or counted
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert report["kept"] == expected["kept"] == 9
    assert report["skipped_by_reason"] == expected["skipped_by_reason"]
    assert report["skipped"] == 11
    assert len(report["unreadable_files"]) == 1 and "d.parquet" in report["unreadable_files"][0]
    assert read_jsonl(out) == [normalized(r) for r in expected["good"]]
    assert report["where"]["unknown role"][-1] == f"{tmp_path / 'in' / 'b.json'}#2"
    assert report["where"]["empty conversations"][-1] == f"{tmp_path / 'in' / 'c.parquet'}#3"


def test_cli_entry_exit_status_and_one_line_per_reason(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "in.jsonl")
    write_parquet(tmp_path / "ok.parquet", GOOD_JSONL[:2])
    r = cli("pull-hermes3", "--from", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 0, r.stderr
    assert "kept 4 conversations, skipped 9" in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("  skipped 1 ")]) == 9
    r = cli("pull-hermes3", "--from", str(tmp_path / "missing"), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and r.stderr.splitlines() == [f"error: {tmp_path / 'missing'}: no such file or folder"]
    (tmp_path / "empty").mkdir()
    r = cli("pull-hermes3", "--from", str(tmp_path / "empty"), "--out", str(tmp_path / "bad.jsonl"))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {tmp_path / 'empty'}: no .jsonl/.json/.parquet files found"
    ]
    assert not (tmp_path / "bad.jsonl").exists()
    (tmp_path / "t.parquet").write_bytes((tmp_path / "ok.parquet").read_bytes()[:-20])
    r = cli("pull-hermes3", "--from", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "new.jsonl"))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr  # one error line, not two (issue 57)
    assert r.stderr.startswith(f"error: {tmp_path / 't.parquet'}: unreadable Parquet")
    assert r.stderr.rstrip().endswith(f"; nothing written to {tmp_path / 'new.jsonl'}")
    r = cli("pull-hermes3", "--from", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and r.stderr.rstrip().endswith(f"; {tmp_path / 'o.jsonl'} was left as it was")
    (tmp_path / "d.json").write_text('{"conversations": 5}')
    r = cli("pull-hermes3", "--from", str(tmp_path / "d.json"), "--out", str(tmp_path / "new.jsonl"))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {tmp_path / 'd.json'}: expected a JSON list of records (or JSON Lines), got dict; nothing written to "
        f"{tmp_path / 'new.jsonl'}"
    ]
    assert not (tmp_path / "new.jsonl").exists()


def test_openai_messages_and_chatml_spans() -> None:
    msgs = parse_record({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})
    assert msgs == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    text, spans = render(msgs)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
    assert [text[a:b] for a, b in spans] == ["Yo<|im_end|>"]
    assert parse_record({"messages": [{"role": "human", "content": "x"}]}) == "unknown role"


def test_download_without_network_or_library_is_one_line(tmp_path: Path) -> None:
    """The hub path itself cannot be tested here (no network). Offline mode and a dead endpoint make sure
    this test never downloads anything, even on a machine that has a network."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    argv = ["-m", "microgpt.cli", "pull-hermes3", "--out", str(tmp_path / "o.jsonl"), "--cache-dir", str(tmp_path)]
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: cannot download NousResearch/Hermes-3-Dataset")
    code = "import sys; sys.modules['huggingface_hub'] = None; from microgpt.cli import main; "
    code += "sys.exit(main(['pull-hermes3', '--out', 'x']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: downloading needs huggingface_hub (pip install 'microgpt[data]'); or pass --from PATH"
    ]
