"""HellaSwag during training (train.hellaswag): eval records in train.jsonl that `microgpt eval --hellaswag` on the
checkpoint of that step reproduces, over the training arena without disturbing the run, and a bad file refused
before anything is written. The scorer itself against llm.c's definitions: tests/test_evaluate.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from microgpt import config
from microgpt.data import hellaswag_file, shards
from microgpt.data.tokenizer import ByteTokenizer
from microgpt.engine import params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.infer import make_infer_state, training_infer_state
from microgpt.engine.state import make_state
from microgpt.run import trackers
from microgpt.use import hellaswag
from tests.conftest import cli, json_lines, one_error, write_experiment
from tests.test_hostile_input import snapshot

EXAMPLES = [
    {"ctx": "def add(a, b):", "endings": ["return a + b", "zzq qq", "import os", "class A:"], "label": 0},
    {"ctx": "The cat sat on the", "endings": ["mat.", "def", "}", "1234"], "label": 2},
    {"ctx": "for i in", "endings": ["range(10):", "the house", "x", "self"], "label": "1"},
    {"ctx": "import numpy as np\n" * 3, "endings": ["np.zeros(3)", "if", "else", "pass"], "label": 0},  # cut to fit
    {"ctx": "x", "endings": ["y" * 40, "z", "w", "v"], "label": 3},  # an ending past seq_len: unscored
    {"ctx": "class Foo:", "endings": ["def __init__(self):", "0", "1", "2"], "label": 0},
]


def write_examples(path: Path, examples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(ex) + "\n" for ex in examples))
    return path


def train(folder: Path, *sets: str) -> list[dict]:
    """A TINY run (6 steps, val loss every 3) in folder/run with `--set` overrides; its train.jsonl records."""
    exp = write_experiment(folder, data={"path": str(folder.parent / "data")})
    res = cli("train", str(exp), "--out", str(folder / "run"), *[a for s in sets for a in ("--set", s)])
    assert res.returncode == 0, res.stderr
    return json_lines((folder / "run" / "train.jsonl").read_text())


def test_scored_during_training_as_eval_scores_its_checkpoint(tmp_path: Path) -> None:
    """hellaswag_every 2 and eval_every 3 over 6 steps: HellaSwag at 2, 4 and 6, the val loss at 3 and 6, one eval
    record a step (step 6 has both). At step 6 the accuracy is what `eval --hellaswag` gives on the step-6 checkpoint
    (the same weights and micro_batch: the same batches), and every step and val loss is the run's without
    HellaSwag, bit for bit: scoring in the training arena between steps leaves the run as it was."""
    hs = write_examples(tmp_path / "hs.jsonl", EXAMPLES)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    recs = train(tmp_path / "a", f"train.hellaswag={hs}", "train.hellaswag_every=2", "train.hellaswag_examples=5")
    plain = train(tmp_path / "b")
    evals = [r for r in recs if r["event"] == "eval"]
    assert [(r["step"], "val_loss" in r, "hellaswag" in r) for r in evals] == [
        (2, False, True),
        (3, True, False),
        (4, False, True),
        (6, True, True),
    ]
    assert all(r["hellaswag_examples"] == 5 and r["hellaswag_seconds"] >= 0 for r in evals if "hellaswag" in r)
    got = cli("eval", str(tmp_path / "a" / "run"), "--hellaswag", str(hs), "--windows", "5", "--json")
    assert got.returncode == 0, got.stderr
    res = json.loads(got.stdout)
    assert (res["step"], res["unscored"], res["truncated"]) == (6, 1, 1)
    assert (evals[-1]["hellaswag"], evals[-1]["hellaswag_acc_norm"]) == (res["acc"], res["acc_norm"])
    card = json.loads((tmp_path / "a" / "run" / "report.json").read_text())  # the report card, the trackers' tags
    assert card["hellaswag"] == {
        "acc": res["acc"],
        "acc_norm": res["acc_norm"],
        "examples": 5,
        "step": 6,
        "file": str(hs),
    }
    assert f"acc {res['acc']:.4f}, acc_norm" in (tmp_path / "a" / "run" / "report.md").read_text()
    assert trackers.scalars(evals[0]) == {
        "val/hellaswag": evals[0]["hellaswag"],
        "val/hellaswag_acc_norm": evals[0]["hellaswag_acc_norm"],
    }

    def losses(rs: list[dict]) -> list:
        return [
            (r["event"], r["step"], r.get("loss"), r.get("val_loss"))
            for r in rs
            if r["event"] in ("step", "eval") and ("loss" in r or "val_loss" in r)
        ]

    assert losses(recs) == losses(plain)


@pytest.mark.parametrize("skips", [0, 2], ids=["gpt2", "modern-skips"])
def test_the_training_arena_scores_as_an_inference_plan(skips: int) -> None:
    """training_infer_state: views of the training arena only (no allocation beyond the training plan), whose ending
    losses are an inference plan's of the same weights, the plan's rows packed to their own length; the modern block
    with skips keeps its streams in the saved inputs of layers 1 .. k."""
    m = config.ModelConfig(vocab_size=256, d_model=32, n_layer=2, n_head=4, seq_len=32)
    if skips:
        m = dataclasses.replace(m, block="modern", n_layer=5, skips=skips)
    t = config.TrainConfig(micro_batch=3, n_micro=2)
    S = make_state(m, t, numpy_backend())
    w = params.init_weights(m, 5) + np.random.default_rng(0).standard_normal(params.n_params(m)).astype(np.float32) / 9
    S.set_weights(w)
    view = training_infer_state(S)
    assert all(np.shares_memory(v, S.arena.pool) for v in view.arena.values())  # the one allocation
    items = hellaswag_file.tokenize([{**ex, "label": int(ex["label"])} for ex in EXAMPLES], ByteTokenizer(), m.seq_len)
    assert max(len(b) for b in hellaswag.batches(items, 3 * 32)) * 2 <= 3 * 32  # short rows: several a batch
    got = hellaswag.ending_losses(view, items)
    want = hellaswag.ending_losses(make_infer_state(m, numpy_backend(), 3, w, cache=False), items)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "case, needles",
    [
        ("missing", ["train.hellaswag", "cannot read"]),
        ("empty", ["train.hellaswag", "no examples"]),
        ("bad line", ["train.hellaswag", "hs.jsonl:2: field 'endings'"]),
        ("every", ["train.hellaswag_every must be in [0, 2147483647] (0: with every evaluation), got -1"]),
    ],
)
def test_a_bad_hellaswag_setting_is_one_line_and_writes_nothing(tmp_path: Path, case: str, needles: list[str]) -> None:
    """Refused at the start with one `error:` line, exit 2: a new run folder is never made, an existing run's files
    keep their sha256."""
    hs = tmp_path / "hs.jsonl"
    if case == "empty":
        hs.write_text("\n")
    elif case == "bad line":
        write_examples(hs, EXAMPLES[:1])
        hs.write_text(hs.read_text() + '{"ctx": "a", "endings": ["b"], "label": 0}\n')
    elif case == "every":
        write_examples(hs, EXAMPLES)
    sets = [f"train.hellaswag={hs}"] + (["train.hellaswag_every=-1"] if case == "every" else [])
    exp = write_experiment(tmp_path, data={"path": str(tmp_path / "data")})
    flags = [a for s in sets for a in ("--set", s)]
    one_error(cli("train", str(exp), "--out", str(tmp_path / "new"), *flags), 2, *needles)
    assert not (tmp_path / "new").exists()
    res = cli("train", str(exp), "--out", str(tmp_path / "run"), "--steps", "2")
    assert res.returncode == 0, res.stderr
    before = snapshot(tmp_path / "run")
    one_error(cli("train", str(exp), "--out", str(tmp_path / "run"), "--resume", "latest", *flags), 2, *needles)
    assert snapshot(tmp_path / "run") == before


def test_shards_without_a_tokenizer_cannot_tokenize_it(tmp_path: Path) -> None:
    """llm.c-style shards (token ids, no tokenizer.json) give nothing to tokenize the examples with: refused at the
    start, naming train.hellaswag and data.tokenizer, before the run folder exists."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        shards.write_shard(tmp_path / "shards" / f"{split}_000000.bin", rng.integers(0, 512, 4096).astype(np.uint16))
    exp = write_experiment(
        tmp_path, model={"vocab_size": 512}, data={"source": "shards", "path": str(tmp_path / "shards")}
    )
    hs = write_examples(tmp_path / "hs.jsonl", EXAMPLES)
    res = cli("train", str(exp), "--out", str(tmp_path / "new"), "--set", f"train.hellaswag={hs}")
    one_error(res, 2, "train.hellaswag", "no tokenizer.json (set data.tokenizer)")
    assert not (tmp_path / "new").exists()
