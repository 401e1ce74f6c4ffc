"""prep never writes a folder `train` refuses: a source of one document is split into train and val text, and a
corpus whose splits cannot hold one training window of the experiment's is refused before anything is written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from microgpt.data import prep
from microgpt.data.chatml import render
from microgpt.data.sources import Doc
from tests.conftest import cli, write_experiment

PARAGRAPHS = [f"Paragraph {i}: " + "the quick brown fox jumps over the lazy dog. " * 6 for i in range(40)]


def test_one_large_document_is_split_so_val_is_never_empty_and_train_accepts_it(tmp_path: Path) -> None:
    """The README's user: `prep --source one.txt` then `train` on it (before: val 0, and train refused)."""
    one = tmp_path / "one.txt"
    one.write_text("\n\n".join(PARAGRAPHS), encoding="utf-8")
    r = cli("prep", "--source", str(one), "--out", str(tmp_path / "d"), "--vocab-size", "300", "--val-fraction", "0.1")
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert train["documents"] == val["documents"] == 1 and val["tokens"] > 0 and train["tokens"] > 5 * val["tokens"]
    exp = write_experiment(
        tmp_path,
        model={"vocab_size": 300, "seq_len": 16},
        train={"steps": 2, "eval_every": 2},
        data={"source": "shards", "path": str(tmp_path / "d")},
    )
    t = cli("train", str(exp), "--out", str(tmp_path / "run"))
    assert t.returncode == 0, t.stderr


def test_the_split_falls_on_a_paragraph_and_keeps_every_character() -> None:
    text = "\n\n".join(PARAGRAPHS)
    head, tail = prep.split_document(Doc(text), 0.1, "one.txt")
    assert head.text + tail.text == text and head.text.endswith("\n\n") and tail.text.startswith("Paragraph ")
    assert abs(len(tail.text) - 0.1 * len(text)) <= len(PARAGRAPHS[-1]) / 2  # the paragraph break nearest to 10%
    lines = prep.split_document(Doc("a\nb\nc\nd\ne\nf\ng\nh\ni\nj"), 0.2, "x")  # no blank line: at a line break
    assert [d.text for d in lines] == ["a\nb\nc\nd\ne\nf\ng\nh\n", "i\nj"]
    assert [d.text for d in prep.split_document(Doc("abcdefghij"), 0.3, "x")] == ["abcdefg", "hij"]


def test_a_chat_documents_assistant_spans_are_cut_with_it() -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there.\nHow can I help?"}]
    text, spans = render(msgs)
    head, tail = prep.split_document(Doc(text, spans), 0.2, "chat.jsonl")
    assert head.text + tail.text == text
    ((a, b),) = spans
    assert head.spans == [(a, min(b, len(head.text)))]
    assert tail.spans == [(max(a, len(head.text)) - len(head.text), b - len(head.text))]
    assert text[a:b] == (head.text + tail.text)[a:b]


def test_too_little_text_is_refused_with_one_line_and_nothing_written(tmp_path: Path) -> None:
    one = tmp_path / "one.txt"
    one.write_text("x", encoding="utf-8")
    out = tmp_path / "d"
    r = cli("prep", "--source", str(one), "--out", str(out), "--vocab-size", "300")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: --source {one}: a single document of 1 characters cannot be split into train and val text; give "
        "the source more text (or more documents)"
    ], r.stderr
    assert not out.exists()


def test_splits_shorter_than_the_experiments_window_are_refused_and_an_old_corpus_kept(tmp_path: Path) -> None:
    """With --experiment prep knows model.seq_len: a val split shorter than one window is refused, the folder (an
    earlier corpus) left as it was."""
    one = tmp_path / "one.txt"
    one.write_text("\n\n".join(PARAGRAPHS[:12]), encoding="utf-8")
    out = tmp_path / "d"
    assert cli("prep", "--source", str(one), "--out", str(out), "--vocab-size", "300").returncode == 0
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    exp = write_experiment(tmp_path, model={"vocab_size": 300, "seq_len": 400})
    r = cli("prep", "--source", str(one), "--out", str(out), "--experiment", str(exp), "--vocab-size", "300", "--quiet")
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: val split: "), r.stderr
    assert f"fewer than one window of 401 ({exp}: model.seq_len + 1)" in lines[0] and "--val-fraction" in lines[0]
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == before
