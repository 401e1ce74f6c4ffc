"""`microgpt eval` on the triton backend against the NumPy backend, the same checkpoint through the same inference
state: val windows, a text file and HellaSwag (picks and each ending's loss sum), fp32 to 1e-5 (the interpreter in
CI, the device on the GPU machine); bf16 to bf16 rounding on the GPU (the interpreter's bf16 loads are broken)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from microgpt import checkpoint, config
from microgpt.data import hellaswag_file, shards
from microgpt.data.tokenizer import ByteTokenizer
from microgpt.engine import params
from microgpt.engine.backend import numpy_backend, triton_backend
from microgpt.engine.infer import training_infer_state
from microgpt.engine.state import make_state
from microgpt.engine.trained import load_trained
from microgpt.use import evaluate, hellaswag
from tests.conftest import TINY, cli, json_lines, write_experiment

from ._kutil import ON_GPU

MODEL = {"vocab_size": 256, "d_model": 16, "n_layer": 2, "n_head": 2, "seq_len": 16}
EXAMPLES = [
    {"ctx": "a+b", "endings": ["=c", "-d", "*e", "/f"], "label": 0},
    {"ctx": "The cat sat", "endings": ["on it", "def", "}", "12"], "label": 2},
    {"ctx": "for key, value in sorted(", "endings": ["d.items()):", "the house", "x", "yz"], "label": 1},
    {"ctx": "a", "endings": ["an ending longer than seq_len", "b", "c", "d"], "label": 1},
]  # the third's context is cut to fit seq_len + 1 tokens; the fourth cannot be judged (an ending past seq_len)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A byte-tokenizer checkpoint of a tiny model (weights off their init: LayerNorms off 1/0), a val shard of 6
    windows, a text file and a HellaSwag file."""
    folder = tmp_path_factory.mktemp("eval-backends")
    exp = config.from_dict({"name": "k", "model": MODEL, "train": {"micro_batch": 2}})
    w = params.init_weights(exp.model, 3)
    w += np.random.default_rng(4).standard_normal(w.shape).astype(np.float32) * 0.1
    zeros = np.zeros_like(w)
    meta = {
        "config": exp.to_dict(),
        "tokenizer": ByteTokenizer().describe(),
        "precision": "fp32",
        "params": [[n, list(s)] for n, s in params.param_shapes(exp.model)],
    }
    path = checkpoint.write_checkpoint(folder / "step-00000005.bin", 5, w, zeros, zeros, meta)
    text = "def f(x):\n    return x * 2  # héllo\n"
    shards.write_shard(folder / "data" / "val_000000.bin", np.frombuffer((text * 3).encode()[:97], np.uint8))
    (folder / "t.txt").write_text(text, encoding="utf-8")
    (folder / "hs.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES))
    return {"ckpt": path, "data": folder / "data", "text": folder / "t.txt", "hs": folder / "hs.jsonl"}


def run_eval(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    assert evaluate.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_val_text_and_hellaswag_equal_numpy(ckpt: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    """fp32: the same windows, tokens and bytes, losses to 1e-5; HellaSwag's ending loss sums to 1e-5 and the same
    picks (an ending cut to its last seq_len + 1 tokens included)."""
    ld = load_trained(ckpt["ckpt"])
    items = hellaswag_file.tokenize(hellaswag_file.read(ckpt["hs"], "--hellaswag"), ByteTokenizer(), MODEL["seq_len"])
    got: dict[str, dict] = {}
    for name in ("numpy", "triton"):
        out = got[name] = {}
        for what in ("data", "text"):
            out[what] = run_eval(
                capsys, str(ckpt["ckpt"]), f"--{what}", str(ckpt[what]), "--backend", name, "--precision", "fp32"
            )
        out["sums"] = hellaswag.ending_losses(evaluate.scorer(ld, evaluate.eval_backend(ld, name, "fp32")), items)
    cpu, gpu = got["numpy"], got["triton"]
    for what in ("data", "text"):
        assert gpu[what]["backend"] == "triton" and gpu[what]["precision"] == "fp32", gpu[what]
        for key in ("tokens", "windows", "bytes"):
            assert gpu[what][key] == cpu[what][key], (what, key)
        assert gpu[what]["loss"] == pytest.approx(cpu[what]["loss"], rel=1e-5), what
    assert cpu["data"]["windows"] == 6 and cpu["text"]["windows"] == 3
    assert [it.truncated for it in items] == [False, False, True, False] and not items[3].judged
    assert max(len(s) for it in items[:3] for s in it.seqs) == MODEL["seq_len"] + 1
    assert np.isnan(cpu["sums"][3]).all() and np.isfinite(cpu["sums"][:3]).all()
    np.testing.assert_allclose(gpu["sums"][:3], cpu["sums"][:3], rtol=1e-5)
    assert (np.argmin(gpu["sums"][:3], axis=1) == np.argmin(cpu["sums"][:3], axis=1)).all()
    assert hellaswag.counts(items, gpu["sums"]) == hellaswag.counts(items, cpu["sums"])


def test_hellaswag_on_triton_through_the_cli(ckpt: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    """`eval --hellaswag --backend triton` reports what the scorer's sums give, on the precision asked for."""
    res = run_eval(
        capsys, str(ckpt["ckpt"]), "--hellaswag", str(ckpt["hs"]), "--backend", "triton", "--precision", "fp32"
    )
    ld = load_trained(ckpt["ckpt"])
    items = hellaswag_file.tokenize(hellaswag_file.read(ckpt["hs"], "--hellaswag"), ByteTokenizer(), MODEL["seq_len"])
    sums = hellaswag.ending_losses(evaluate.scorer(ld, evaluate.eval_backend(ld, "numpy", "fp32")), items)
    assert res == {
        "step": 5,
        **hellaswag.accuracy(hellaswag.counts(items, sums)),
        "backend": "triton",
        "precision": "fp32",
    }
    assert (res["examples"], res["unscored"], res["truncated"]) == (4, 1, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs CUDA")
def test_bf16_on_the_gpu_is_numpy_to_bf16_rounding(ckpt: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    cpu = run_eval(capsys, str(ckpt["ckpt"]), "--data", str(ckpt["data"]), "--backend", "numpy")
    gpu = run_eval(capsys, str(ckpt["ckpt"]), "--data", str(ckpt["data"]))  # auto: triton here, bf16 its default
    assert (gpu["backend"], gpu["precision"]) == ("triton", "bf16") and gpu["tokens"] == cpu["tokens"]
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_eval_data_on_the_gpu_equals_the_trainers_val_loss(tmp_path: Path, precision: str) -> None:
    """A tiny run trained on the GPU, then `eval --data` of its last checkpoint on the windows its val_loss scored:
    the same kernels on the same shapes (the GEMM choices the run's tuning recorded), so the same loss."""
    exp = write_experiment(
        tmp_path, train={"backend": "triton", "precision": precision}, data={"path": str(tmp_path / "data")}
    )
    res = cli("train", str(exp), "--out", str(tmp_path / "run"), "--json")
    assert res.returncode == 0, res.stderr
    val = [r["val_loss"] for r in json_lines(res.stdout) if r.get("event") == "eval"][-1]
    windows = TINY["train"]["eval_batches"] * TINY["train"]["micro_batch"]
    res = cli(
        "eval",
        str(tmp_path / "run"),
        "--data",
        str(tmp_path / "data"),
        "--windows",
        str(windows),
        "--precision",
        precision,
        "--json",
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert (got["backend"], got["precision"], got["windows"]) == ("triton", precision, windows)
    assert got["loss"] == pytest.approx(val, rel=1e-6)


def test_training_arena_scores_hellaswag_on_triton_as_numpy(ckpt: dict[str, Path]) -> None:
    """train.hellaswag's scorer on the triton kernels (fp32): the training arena's layer-0 buffers, with the
    launchers' scratch planned for training micro-batches, score the packed rows as a NumPy inference plan does."""
    ld = load_trained(ckpt["ckpt"])
    items = hellaswag_file.tokenize(hellaswag_file.read(ckpt["hs"], "--hellaswag"), ByteTokenizer(), MODEL["seq_len"])
    S = make_state(ld.exp.model, ld.exp.train, triton_backend("fp32"))
    S.set_weights(ld.weights)
    got = hellaswag.ending_losses(training_infer_state(S), items)
    want = hellaswag.ending_losses(evaluate.scorer(ld, numpy_backend()), items)
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-5)
    assert np.isnan(got[3]).all()
