"""`microgpt eval`: the trainer's validation loss on the same windows, bits per byte, HellaSwag as llm.c scores it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine import backend
from microgpt.engine.trained import load_trained
from microgpt.use import sample
from tests.conftest import TINY, cli, json_lines, write_experiment

HELLASWAG = [
    {"ctx": "def add(a, b):", "endings": ["return a + b", "zzq qq", "import os", "class A:"], "label": 0},
    {"ctx": "The cat sat on the", "endings": ["mat.", "def", "}", "1234"], "label": 2},
    {"ctx": "for i in", "endings": ["range(10):", "the house", "x", "<|im_end|>"], "label": "1"},
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float]:
    """(run folder, shard folder, the trainer's last val_loss) of a tiny BPE run."""
    folder = tmp_path_factory.mktemp("eval")
    exp = write_experiment(folder, model={"vocab_size": 512}, data={"path": str(folder / "data")})
    res = cli("train", str(exp), "--out", str(folder / "run"), "--json")
    assert res.returncode == 0, res.stderr
    val = [r["val_loss"] for r in json_lines(res.stdout) if r.get("event") == "eval"][-1]
    return folder / "run", folder / "data", val


def run_eval(*args: str) -> dict:
    res = cli("eval", *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def one_error_line(res) -> str:
    assert res.returncode == 2 and res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1, res.stderr
    return res.stderr


def test_shard_eval_equals_trainer_val_loss(trained) -> None:
    run, data, val = trained
    windows = TINY["train"]["eval_batches"] * TINY["train"]["micro_batch"]
    got = run_eval(str(run), "--data", str(data), "--windows", str(windows))
    assert got["windows"] == windows and got["loss"] == pytest.approx(val, abs=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    whole = run_eval(str(run), "--data", str(data), "--split", "val")  # every window of the split
    assert whole["windows"] > windows and whole["tokens"] == whole["windows"] * TINY["model"]["seq_len"]


def test_text_bits_per_byte(trained, tmp_path: Path) -> None:
    run = trained[0]
    text = "def add(a, b):\n    return a + b  # héllo ✓\n" * 5
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    got = run_eval(str(run), "--text", str(path))
    n_bytes = len(text.encode("utf-8"))
    assert got["bytes"] == n_bytes and got["windows"] == math.ceil(got["tokens"] / 32)
    assert got["bits_per_byte"] == pytest.approx(got["loss"] * got["tokens"] / n_bytes / math.log(2), rel=1e-9)
    ld = load_trained(run)  # the same loss from the decode step, token by token after <|endoftext|>
    tok = load_tokenizer(ld.side["tokenizer"])
    ids = [tok.eot_id, *tok.encode(text)]
    losses = []
    for start in range(0, len(ids) - 1, 32):
        gen, w = sample.load(str(run))[0], ids[start : start + 33]
        for a, b in zip(w[:-1], w[1:]):
            z = gen.feed([a]).astype(np.float64)
            losses.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[b])
    assert got["tokens"] == len(losses) and got["loss"] == pytest.approx(np.mean(losses), abs=1e-5)
    _, counts = np.unique(ids[1:], return_counts=True)  # every token of the text is scored, once
    p = counts / counts.sum()
    assert got["unigram_loss"] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-12)


def test_the_text_line_puts_the_loss_beside_the_unigram_of_the_same_tokens(trained, tmp_path: Path) -> None:
    """Without --json, the loss comes with something to compare it to: the unigram loss of the same scored tokens,
    which no model that ignores context beats."""
    path = tmp_path / "t.txt"
    path.write_text("x = [1, 2, 3]\nprint(sorted(x))\n" * 40, encoding="utf-8")
    res = cli("eval", str(trained[0]), "--text", str(path))
    assert res.returncode == 0, res.stderr
    got = run_eval(str(trained[0]), "--text", str(path))
    line = res.stdout.strip()
    assert f"loss {got['loss']:.4f} |" in line
    assert f"| unigram {got['unigram_loss']:.4f} (the loss of these tokens' own frequencies) |" in line
    assert 0 < got["unigram_loss"] < math.log(512)


def test_hellaswag_matches_llmc_definitions(trained, tmp_path: Path) -> None:
    run = trained[0]
    path = tmp_path / "hs.jsonl"
    path.write_text("".join(json.dumps(ex) + "\n" for ex in HELLASWAG))
    got = run_eval(str(run), "--hellaswag", str(path))
    ld = load_trained(run)
    tok = load_tokenizer(ld.side["tokenizer"])
    correct = correct_norm = 0
    for ex in HELLASWAG:
        sums, means = [], []
        for ending in ex["endings"]:
            ctx, end = tok.encode(ex["ctx"]), tok.encode(" " + ending)
            gen, seq, ls = sample.load(str(run))[0], ctx + end, []
            for i in range(len(seq) - 1):
                z = gen.feed([seq[i]]).astype(np.float64)
                if i + 1 >= len(ctx):
                    ls.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[seq[i + 1]])
            sums.append(sum(ls))
            means.append(sum(ls) / len(ls))
        correct += int(np.argmin(sums) == int(ex["label"]))
        correct_norm += int(np.argmin(means) == int(ex["label"]))
    assert got["examples"] == 3 and got["correct"] == correct and got["correct_norm"] == correct_norm
    assert got["acc"] == correct / 3 and got["acc_norm"] == correct_norm / 3


ENDS = '"endings": ["b", "c", "d", "e"]'


@pytest.mark.parametrize(
    "line",
    [
        '{"ctx": "a", "endings": ["b", "c", "d"], "label": 0}',
        '{"ctx": "a", "endings": ["b", "c", "d", "e"]}',
        "not json",
        '{"endings": ["b", "c", "d", "e"], "label": 1}',
        "[" * 100_000 + "]" * 100_000,
        '{"ctx": "a", ' + ENDS + ', "label": ' + "1" * 5000 + "}",
        '{"ctx": "a", ' + ENDS + ', "label": "' + "0" * 4999 + '1"}',
        '{"ctx": "a", ' + ENDS + ', "label": true}',
        '{"ctx": "a", ' + ENDS + ', "label": 1.0}',
        '{"ctx": "a", ' + ENDS + ', "label": NaN}',
        '{"ctx": "a", "ctx": "b", ' + ENDS + ', "label": 1}',
        '{"ctx": "a", ' + ENDS + ', "label": "-0"}',
        '{"ctx": "a \\ud800 b", ' + ENDS + ', "label": 1}',  # a lone surrogate: no tokenizer encodes it
        '{"ctx": "a", "endings": ["b", "c", "d", "\\udfff"], "label": 1}',
    ],
)
def test_malformed_hellaswag_line(trained, tmp_path: Path, line: str) -> None:
    """Every line read by the strict reader (nesting, duplicate keys, NaN, 5,000-digit numbers) and checked before
    anything is scored: one line naming the file and the line."""
    path = tmp_path / "hs.jsonl"
    path.write_text(json.dumps(HELLASWAG[0]) + "\n" + line + "\n")
    assert f"{path}:2:" in one_error_line(cli("eval", str(trained[0]), "--hellaswag", str(path)))


def test_an_example_with_nothing_to_score_is_not_correct(trained, tmp_path: Path) -> None:
    """An empty context and one-token endings: each ending's only token starts the sequence and nothing predicts
    it. Such an example counts among the examples, never as correct (label 0 used to win every tie of zeros)."""
    tok = load_tokenizer(load_trained(trained[0]).side["tokenizer"])
    words = [
        w
        for w in ("def", "return", "self", "import", "class", "if", "in", "for", "not", "is", "None")
        if len(tok.encode(" " + w)) == 1
    ][:4]
    assert len(words) == 4, words
    path = tmp_path / "hs.jsonl"
    path.write_text(json.dumps({"ctx": "", "endings": words, "label": 0}) + "\n" + json.dumps(HELLASWAG[0]) + "\n")
    got = run_eval(str(trained[0]), "--hellaswag", str(path))
    alone = run_eval(str(trained[0]), "--hellaswag", str(path), "--windows", "1")
    assert alone["examples"] == 1 and alone["unscored"] == 1 and alone["correct"] == alone["correct_norm"] == 0
    assert got["examples"] == 2 and got["unscored"] == 1 and got["correct"] <= 1


def test_checkpoint_for_another_model(trained, tmp_path: Path) -> None:
    ck = sorted((trained[0] / "ckpt").glob("step-*.bin"))[-1]
    shutil.copy(ck, tmp_path / ck.name)
    side = json.loads(ck.with_name(ck.name.replace(".bin", ".state.json")).read_text())
    side["config"]["model"]["n_layer"] = 3
    (tmp_path / ck.name.replace(".bin", ".state.json")).write_text(json.dumps(side))
    err = one_error_line(cli("eval", str(tmp_path / ck.name), "--data", str(trained[1])))
    assert "another model" in err


def test_needs_one_source(trained) -> None:
    one_error_line(cli("eval", str(trained[0])))


@pytest.mark.skipif(backend.cuda_available(), reason="a CUDA GPU runs the triton backend here")
def test_a_backend_or_precision_this_machine_cannot_run_is_one_line(trained) -> None:
    """No CUDA GPU and no interpreter: --backend triton is one line naming the flag, exit 2, and auto picks numpy in
    fp32; bf16 on numpy, and fp8 for a checkpoint trained in fp32, are one line naming --precision."""
    run, data = str(trained[0]), str(trained[1])
    res = cli("eval", run, "--data", data, "--backend", "triton", env={"TRITON_INTERPRET": "0"})
    assert "--backend 'triton'" in one_error_line(res) and "CUDA GPU" in res.stderr
    err = one_error_line(cli("eval", run, "--data", data, "--backend", "numpy", "--precision", "bf16"))
    assert err.startswith("error: --precision bf16: the numpy backend runs fp32, fp8"), err
    err = one_error_line(cli("eval", run, "--data", data, "--precision", "fp8"))
    assert err.startswith("error: --precision fp8: ") and "trained in fp32" in err, err
    got = run_eval(run, "--data", data, "--windows", "2")
    assert (got["backend"], got["precision"]) == ("numpy", "fp32")


def test_fp8_checkpoint_scores_as_its_trainer(tmp_path: Path) -> None:
    """A run trained in fp8 (the NumPy reference's E4M3 linears): `eval --precision fp8` scales by the amax histories
    of its sidecar, so its loss on the trainer's windows is the trainer's fp8 val_loss; fp32 scores it too."""
    exp = write_experiment(
        tmp_path, train={"precision": "fp8", "steps": 3, "eval_every": 3}, data={"path": str(tmp_path / "data")}
    )
    res = cli("train", str(exp), "--out", str(tmp_path / "run"), "--json")
    assert res.returncode == 0, res.stderr
    val = [r["val_loss"] for r in json_lines(res.stdout) if r.get("event") == "eval"][-1]
    windows = str(TINY["train"]["eval_batches"] * TINY["train"]["micro_batch"])
    args = (str(tmp_path / "run"), "--data", str(tmp_path / "data"), "--windows", windows)
    got = run_eval(*args, "--precision", "fp8")
    assert got["precision"] == "fp8" and got["loss"] == pytest.approx(val, abs=1e-6)
    assert run_eval(*args)["precision"] == "fp32"
