"""bench/hellaswag.py on the CPU: a tiny model at init on 20 examples drawn in the real file's layout, scored by
`microgpt eval` and by transformers on the exported folder: both pick the same endings. Then a file written in the
real layout by hand through --file and --ckpt, and bad input refused before anything is made. No timing asserted."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, tmpfs

pytest.importorskip("transformers")

# the fields of a line of the real validation file (rowanz/hellaswag data/hellaswag_val.jsonl)
REAL_FIELDS = {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "split", "split_type", "label", "endings", "source_id"}
REAL_LINES = [
    {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
     "ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain", "label": 3,
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
     "source_id": "activitynet~v_-JhWjGDPHMY"},
    {"ind": 92, "activity_label": "Clean and jerk", "ctx_a": "A lady walks to a barbell. She bends down and grabs "
     "the pole.", "ctx_b": "the lady", "ctx": "A lady walks to a barbell. She bends down and grabs the pole. the lady",
     "split": "val", "split_type": "zeroshot", "label": 3,
     "endings": ["swings and lands in her arms.", "pulls the barbell forward.", "pulls a rope attached to the barbell.",
                 "stands and lifts the weight over her head."], "source_id": "activitynet~v_-lJS58hyo1c"},
]  # fmt: skip


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "bench" / "hellaswag.py"), "--shape", "tiny", "--corpus-bytes", "300000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def sides(res: subprocess.CompletedProcess) -> dict[str, dict]:
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["side"] for r in lines] == ["microgpt", "transformers"] and not any("error" in r for r in lines), lines
    return {r["side"]: r for r in lines}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    work = tmp_path_factory.mktemp("hs") / "work"
    return work, sides(bench("--examples", "20", "--work", str(work)))


@pytest.mark.slow
def test_both_sides_pick_the_same_endings(made) -> None:
    _, got = made
    mine, theirs = got["microgpt"], got["transformers"]
    assert mine["examples"] == theirs["examples"] == 20 and mine["agree"] == theirs["agree"] == 20
    assert (mine["correct"], mine["correct_norm"]) == (theirs["correct"], theirs["correct_norm"])
    assert theirs["device"] == "cpu" and theirs["dtype"] == "float32"
    assert all(r["seconds"] > 0 and r["examples_per_s"] > 0 for r in got.values()) and mine["seconds_again"] > 0


@pytest.mark.slow
def test_the_file_has_the_real_layout_and_lengths(made) -> None:
    work, got = made
    lines = [json.loads(line) for line in (work / "hellaswag.jsonl").read_text().splitlines()]
    assert [ex["ind"] for ex in lines] == list(range(20))
    for ex in lines:
        assert set(ex) == REAL_FIELDS and ex["ctx"] == f"{ex['ctx_a']} {ex['ctx_b']}" and ex["split"] == "val"
        assert ex["label"] in range(4) and len(ex["endings"]) == 4 and all(e and e == e.strip() for e in ex["endings"])
    lo, _, hi = got["microgpt"]["ctx_tokens"]  # a span ends at the word that reaches its drawn length
    assert 40 <= lo and hi <= 160
    lo, _, hi = got["microgpt"]["ending_tokens"]
    assert 10 <= lo and hi <= 80


@pytest.mark.slow
def test_a_given_file_and_checkpoint(made, tmp_path: Path) -> None:
    work, first = made
    real = tmp_path / "hellaswag_val.jsonl"
    real.write_text("".join(json.dumps(ex) + "\n" for ex in REAL_LINES))
    got = sides(bench("--ckpt", str(work / "ckpt"), "--file", str(real)))
    assert got["microgpt"]["examples"] == 2 and got["microgpt"]["agree"] == 2 and got["microgpt"]["step"] == 0
    assert got["microgpt"]["ckpt"] == first["microgpt"]["ckpt"]


def sha(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("case", ["work not empty", "file missing", "bad line", "examples 0"])
def test_bad_input_is_one_error_line(tmp_path: Path, case: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(REAL_LINES[0]) + "\n" + json.dumps({**REAL_LINES[1], "endings": ["a"]}) + "\n")
    args, says = {
        "work not empty": (["--work", str(work)], "--work"),
        "file missing": (["--file", str(tmp_path / "nope.jsonl")], "nope.jsonl"),
        "bad line": (["--file", str(bad)], f"{bad}:2"),
        "examples 0": (["--examples", "0"], "--examples"),
    }[case]
    before = sha(work)
    res = bench(*args)
    assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
    assert res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1 and says in res.stderr, res.stderr
    assert sha(work) == before


def test_a_full_disk_is_exit_4(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", 256 * 1024) as small:  # room for the tokenizer, not for the checkpoint
        res = bench("--examples", "2", "--work", str(small / "work"))
        assert res.returncode == 4 and res.stdout == "", (res.stdout, res.stderr)
        assert res.stderr.startswith("error: --work ") and len(res.stderr.splitlines()) == 1, res.stderr
        assert not list((small / "work").rglob("*.tmp*"))  # the checkpoint's temp file went with the failed write
