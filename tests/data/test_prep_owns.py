"""prep owns its outputs by manifest (issue 49 class 1): an existing --out is replaced only when it holds exactly
what a prep wrote there, as its manifest.json lists it (the manifest, tokenizer.json, each shard and its loss mask,
the --per-source folders); anything else there is one `error:` line, exit 2, and every file is left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microgpt.data import prep
from tests.conftest import cli
from tests.test_hostile_input import refused, snapshot


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for sub in ("a", "b"):
        (src / sub).mkdir(parents=True)
        for i in range(3):
            (src / sub / f"{i}.txt").write_text(f"document {sub}{i} " * 40)
    return src


def run_prep(texts: Path, out: Path, *extra: str) -> None:
    argv = ["prep", "--source", str(texts / "a"), "--source", str(texts / "b"), "--out", str(out), "--quiet"]
    r = cli(*argv, *extra)
    assert r.returncode == 0 and r.stderr == "", r.stderr


LAYOUTS = {
    "bytes": ["--tokenizer", "bytes"],
    "bpe, masks": ["--vocab-size", "300", "--loss-mask"],
    "per source": ["--vocab-size", "300", "--loss-mask", "--per-source"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_corpus_prep_wrote_is_replaced_whole(texts: Path, tmp_path: Path, layout: str) -> None:
    """Every file a prep writes is one its manifest lists (so the next prep may replace it), in each layout."""
    out = tmp_path / "corpus"
    run_prep(texts, out, *LAYOUTS[layout])
    assert prep.foreign_entry(out) is None
    first = snapshot(out)
    run_prep(texts, out, *LAYOUTS[layout])
    assert snapshot(out).keys() == first.keys()


FOREIGN = {
    "a stray manifest beside other files": None,  # the case: {} as manifest.json and a file of the user's
    "a file of the user's in a corpus": "notes.txt",
    "a folder of the user's in a corpus": "mine/keep.txt",
    "a file in a per-source folder": "a/keep.txt",
    "a link named like a shard": "train_000009.bin",
    "another tool's manifest": "manifest.json",
}


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_prep_never_deletes_what_it_did_not_write(texts: Path, tmp_path: Path, kind: str) -> None:
    out = tmp_path / "corpus"
    (tmp_path / "elsewhere.txt").write_text("the user's")
    if kind == "a stray manifest beside other files":
        out.mkdir()
        (out / "manifest.json").write_text("{}")
        (out / "thesis.tex").write_text("the user's")
    else:
        run_prep(texts, out, *LAYOUTS["per source"])
        foreign = out / FOREIGN[kind]
        foreign.parent.mkdir(exist_ok=True)
        if kind == "a link named like a shard":
            foreign.symlink_to(tmp_path / "elsewhere.txt")
        elif kind == "another tool's manifest":
            foreign.write_text(json.dumps({"format": "other-tool-1", "splits": {}}))
        else:
            foreign.write_text("the user's")
    before = snapshot(tmp_path)
    r = cli("prep", "--source", str(texts / "a"), "--out", str(out), "--tokenizer", "bytes", "--quiet")
    if kind in ("a stray manifest beside other files", "another tool's manifest"):
        refused(r, f"--out {out}: a folder that holds no prepared corpus (no manifest.json of prep's)")
    else:
        named = FOREIGN[kind].split("/")[0] if kind == "a folder of the user's in a corpus" else FOREIGN[kind]
        refused(r, f"--out {out}: holds {named}, which its manifest.json does not list")  # the first such entry
    assert snapshot(tmp_path) == before


def test_a_manifest_listing_files_outside_its_folder_deletes_nothing_there(texts: Path, tmp_path: Path) -> None:
    """The manifest only says which files in the folder are prep's: a name like ../x never reaches a deletion."""
    out = tmp_path / "corpus"
    run_prep(texts, out, "--tokenizer", "bytes")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"].append("../elsewhere.bin")
    (out / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "elsewhere.bin").write_text("the user's")
    run_prep(texts, out, "--tokenizer", "bytes")
    assert (tmp_path / "elsewhere.bin").read_text() == "the user's"
