"""Data recipes (microgpt/data/recipe.py): each experiment names data that exist after one `microgpt prep
--experiment FILE`, at its own tokenizer size; `train` and `run` refuse data that do not fit the model in one line
that gives that command; `--data DIR` trains on one's own shards; `prep --builtin-chats N` makes a chat set offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from microgpt import config
from microgpt.config import ConfigError
from microgpt.data import corpus, prep, recipe, shards
from microgpt.data.chatml import render
from microgpt.data.tokenizer import load_tokenizer
from tests.conftest import REPO, TINY, cli, json_lines, write_experiment

EXPERIMENTS = sorted((REPO / "experiments").glob("*.json"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_every_experiment_names_data_one_prep_command_makes(path: Path) -> None:
    """Built-in data (made by train itself), or shards at data.path whose recipe parses as prep's arguments at the
    experiment's own vocabulary; two experiments of different vocabularies never share a folder."""
    exp = config.load(path)
    if exp.data.source == "builtin":
        return
    argv = recipe.expand(["--experiment", str(path)])
    args = prep.parser().parse_args(argv)
    assert str(args.out) == exp.data.path and args.experiment == str(path)
    assert args.builtin or args.builtin_chats or args.source
    s, _ = prep.resolve(args) if not args.tokenizer else (None, None)
    assert s is None or s.vocab_size == exp.model.vocab_size
    others = [config.load(p) for p in EXPERIMENTS if p != path]
    assert all(o.data.path != exp.data.path or o.model.vocab_size == exp.model.vocab_size for o in others)


def test_prep_experiment_makes_the_data_train_then_reads(tmp_path: Path) -> None:
    data = tmp_path / "data" / "mine"
    recipe_data = {"source": "shards", "path": str(data), "prep": "--builtin", "max_bytes": 100000}
    exp = write_experiment(tmp_path, model={"vocab_size": 384}, data=recipe_data)
    r = cli("train", str(exp), "--steps", "1", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {exp}: data.path {data} does not exist (a folder of token shards); make them with "
        f"`microgpt prep --experiment {exp}`"
    ]
    assert not (tmp_path / "run").exists()
    p = cli("prep", "--experiment", str(exp), "--quiet")
    assert p.returncode == 0, p.stderr
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["vocab_size"] == 384 and manifest["build"]["max_bytes"] == 100000 and manifest["loss_mask"]
    r = cli("train", str(exp), "--steps", "2", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def shards_512(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("d512") / "d512"
    p = cli(
        "prep",
        "--builtin",
        "--vocab-size",
        "512",
        "--max-bytes",
        "100000",
        "--val-fraction",
        "0.3",
        "--out",
        str(out),
        "--quiet",
    )
    assert p.returncode == 0, p.stderr
    return out


@pytest.mark.parametrize("vocab, word", [(384, "more than"), (640, "far fewer than"), (256, "more than")])
def test_train_refuses_data_of_another_tokenizer_size(shards_512: Path, tmp_path: Path, vocab: int, word: str) -> None:
    """Fewer ids than the tokenizer (ids past the table) or 128 or more beyond it (data for another model): one line
    with the prep command that makes this model's data from one's own text, nothing written."""
    exp = write_experiment(tmp_path, model={"vocab_size": vocab})
    r = cli("train", str(exp), "--data", str(shards_512), "--out", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    make = f"make them with `microgpt prep --source YOUR_TEXT --experiment {exp} --out {shards_512}`"
    why = (
        f"prepared for another model; {make}"
        if word == "more than"
        else f"prepared for another model, or from too little text to learn {vocab:,}; {make} from more text, or "
        "set model.vocab_size 512"
    )
    assert r.stderr.splitlines() == [
        f"error: {exp}: data.path {shards_512}: its tokenizer ({shards_512 / 'tokenizer.json'}) has 512 entries, "
        f"{word} model.vocab_size {vocab}: {why}"
    ]
    assert not (tmp_path / "run").exists()


def test_prep_refuses_text_too_small_for_the_vocabulary(tmp_path: Path) -> None:
    """Too little text to learn model.vocab_size entries: prep wrote a corpus train then refused, and train's hint
    was that same prep command (issue 57). prep refuses it, naming the field, and writes nothing."""
    (tmp_path / "small.txt").write_text(" ".join(f"w{i % 50}" for i in range(3000)))
    exp = write_experiment(
        tmp_path,
        model={"vocab_size": 2048},
        data={"source": "shards", "path": str(tmp_path / "d"), "prep": f"--source {tmp_path / 'small.txt'}"},
    )
    r = cli("prep", "--experiment", str(exp), "--quiet")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {exp}: model.vocab_size 2048: the text (7,979 characters of the train split) holds only enough "
        "to learn 301 tokenizer entries; add text, or use a vocabulary of 301"
    ], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.json", "small.txt"]


def test_run_refuses_them_too_before_anything_is_written(shards_512: Path, tmp_path: Path) -> None:
    exp = write_experiment(tmp_path, model={"vocab_size": 640})
    r = cli("run", str(exp), "--data", str(shards_512), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "has 512 entries, far fewer than model.vocab_size 640" in r.stderr and "microgpt prep --source" in r.stderr
    assert not (tmp_path / "run").exists()


def test_data_flag_is_the_two_fields_and_a_padded_table_trains(shards_512: Path, tmp_path: Path) -> None:
    """--data DIR sets data.source "shards" and data.path DIR (the report card's recipe says --data); a model with up
    to 127 ids beyond its tokenizer's (a table padded for speed) trains on the data."""
    exp = write_experiment(tmp_path, model={"vocab_size": 512 + 127})
    r = cli("train", str(exp), "--data", str(shards_512), "--steps", "1", "--out", str(tmp_path / "run"), "--json")
    assert r.returncode == 0, r.stderr
    start = next(e for e in json_lines(r.stdout) if e["event"] == "start")
    assert start["config"]["data"]["source"] == "shards" and start["config"]["data"]["path"] == str(shards_512)
    assert f"--data {shards_512}" in start["recipe"]["overrides"]


def test_builtin_chats_are_a_chat_set_of_their_own(tmp_path: Path) -> None:
    """`prep --builtin-chats N`: N synthetic conversations, loss masks on the assistant's tokens, deterministic, and
    not the built-in corpus's chats (another seed)."""
    out = tmp_path / "chats"
    p = cli("prep", "--builtin-chats", "300", "--loss-mask", "--vocab-size", "320", "--out", str(out), "--quiet")
    assert p.returncode == 0, p.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 300
    assert m["build"]["builtin_chats"] == 300 and m["sources"][0]["kind"] == "synthetic-chat"
    ids = shards.open_shard(out / "train_000000.bin")
    mask = shards.open_mask(out / "train_000000.bin", len(ids))
    tok = load_tokenizer(out / "tokenizer.json")
    assert 0.1 < mask.mean() < 0.9 and tok.im_end_id in np.asarray(ids)[mask == 1]
    src, docs = corpus.chat_set(300, corpus.CORPUS_SEED)
    assert [d.text for d in docs] == [d.text for d in corpus.chat_set(300, corpus.CORPUS_SEED)[1]]
    pretraining = corpus.synthetic_conversations(300, corpus.CORPUS_SEED)
    assert [render(c)[0] for c in pretraining] != [d.text for d in docs]


def test_expand_leaves_other_command_lines_alone_and_names_a_missing_recipe(tmp_path: Path) -> None:
    assert recipe.expand(["--builtin", "--experiment", "x.json"]) == ["--builtin", "--experiment", "x.json"]
    exp = write_experiment(tmp_path)  # TINY: the built-in source, made by train itself
    with pytest.raises(ConfigError, match="no data.prep to run"):
        recipe.expand(["--experiment", str(exp)])
    bad = write_experiment(tmp_path, data={"source": "shards", "path": "d", "prep": "--out elsewhere"})
    with pytest.raises(ConfigError, match="data.prep must not give --out"):
        recipe.expand(["--experiment", str(bad)])
    assert TINY["data"]["source"] == "builtin"


@pytest.mark.parametrize("command", ["train", "run"])
def test_an_empty_data_folder_is_refused_before_anything_is_written(tmp_path: Path, command: str) -> None:
    """`run --data` on an empty folder started the proxy, wrote the run folder, and printed the engine's error twice,
    its last stderr line a `proxy:` line (issue 57): check_data now finds no shards, one line, nothing written."""
    exp = write_experiment(tmp_path)
    (tmp_path / "empty").mkdir()
    r = cli(command, str(exp), "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {exp}: data.path {tmp_path / 'empty'} holds no train shards (train_000000.bin); make them with "
        f"`microgpt prep --source YOUR_TEXT --experiment {exp} --out {tmp_path / 'empty'}`"
    ], r.stderr
    assert not (tmp_path / "run").exists()
