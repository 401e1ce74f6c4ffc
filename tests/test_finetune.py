"""Fine-tuning as a named path: pretrain, `prep --loss-mask` on chat data with the run's tokenizer, `train --init`
(another run's weights, a fresh optimizer, step 0, its own schedule), then `chat` with the result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint, config, runlog
from microgpt.data import corpus
from microgpt.engine.trained import load_trained
from microgpt.run import checkpoints, trainer
from tests.conftest import TINY, cli, write_experiment


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the pretraining run folder, a chat JSONL of synthetic conversations in OpenAI-messages form)."""
    tmp = tmp_path_factory.mktemp("ft")
    exp = write_experiment(tmp, model={"vocab_size": 384}, data={"max_bytes": 100000})
    assert cli("train", str(exp), "--out", str(tmp / "pre")).returncode == 0
    chats = tmp / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in corpus.synthetic_conversations(200, 5)))
    return tmp / "pre", chats


def finetune_exp(tmp: Path, data: Path) -> Path:
    return write_experiment(
        tmp,
        model={"vocab_size": 384},
        train={"steps": 4, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "eval_every": 2},
        data={"source": "shards", "path": str(data), "loss_mask": True},
    )


def test_pretrain_prep_loss_mask_finetune_then_chat(pretrained: tuple[Path, Path], tmp_path: Path) -> None:
    pre, chats = pretrained
    data = tmp_path / "chat-data"
    p = cli(
        "prep",
        "--source",
        str(chats),
        "--loss-mask",
        "--tokenizer",
        str(pre / "tokenizer.json"),
        "--out",
        str(data),
        "--quiet",
    )
    assert p.returncode == 0, p.stderr
    out = tmp_path / "ft"
    r = cli("train", str(finetune_exp(tmp_path, data)), "--init", str(pre), "--out", str(out))
    assert r.returncode == 0, r.stderr
    log = runlog.read_log(out / "train.jsonl")
    start, first = log[0], next(e for e in log if e["event"] == "step")
    newest = checkpoint.list_checkpoints(pre / "ckpt")[0]
    assert start["step"] == 0 and start["init"]["path"] == str(newest) and start["init"]["step"] == 6
    assert first["step"] == 1 and first["lr"] == 1e-3 / 2  # its own warmup, not the pretraining's last lr
    said = (
        f"init: the weights of {newest} (tiny-test, step 6); Adam moments zero, step 0, this experiment's own schedule"
    )
    assert said in r.stderr.splitlines()
    assert checkpoint.read_sidecar(out / "ckpt" / "step-00000004.bin")["init"]["path"] == str(newest)
    assert "weights of" in (out / "report.md").read_text()
    c = cli("chat", str(out), "--tokens", "8", input="hello\n")
    assert c.returncode == 0, c.stderr


def test_init_takes_the_weights_and_nothing_else(pretrained: tuple[Path, Path], tmp_path: Path) -> None:
    """In process: the masters are the other run's final weights; Adam m and v are zero and the step is 0."""
    pre, _ = pretrained
    exp = config.from_dict(
        {**TINY, "model": {**TINY["model"], "vocab_size": 384}, "data": {**TINY["data"], "max_bytes": 100000}}
    )
    tr = trainer.Trainer(exp, tmp_path / "ft")
    tr.init_from(checkpoints.read_init(str(pre), exp.model))
    want = load_trained(pre).weights
    np.testing.assert_array_equal(tr.K.to_numpy(tr.S.p), want)
    assert not tr.K.to_numpy(tr.S.adam_m).any() and not tr.K.to_numpy(tr.S.adam_v).any() and tr.step == 0


def test_init_reads_its_checkpoint_once(
    pretrained: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train --init RUN` in process: the newest checkpoint is opened once, for the pre-flight check and the weights
    alike (read_init's Trained is handed to the trainer, not the path read again)."""
    from microgpt import cli as main_cli

    pre, _ = pretrained
    opened: list[Path] = []
    real = checkpoint.open_input

    def counting(path, *a, **kw):
        opened.append(Path(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(checkpoint, "open_input", counting)
    exp = write_experiment(
        tmp_path, model={"vocab_size": 384}, data={"max_bytes": 100000}, train={"steps": 2, "warmup_steps": 1}
    )
    assert main_cli.main(["train", str(exp), "--init", str(pre), "--out", str(tmp_path / "ft")]) == 0
    newest = checkpoint.list_checkpoints(pre / "ckpt")[0]
    assert opened.count(newest) == 1, opened


def test_init_refuses_another_model_or_another_tokenizer(pretrained: tuple[Path, Path], tmp_path: Path) -> None:
    pre, chats = pretrained
    other = write_experiment(tmp_path, model={"vocab_size": 384, "d_model": 64})
    r = cli("train", str(other), "--init", str(pre), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith(f"error: --init {pre}: "), r.stderr
    assert "model.d_model" in r.stderr and not (tmp_path / "x" / "ckpt").exists()
    data = tmp_path / "own-bpe"  # the chats tokenized with a BPE of their own, not the pretraining run's
    assert (
        cli(
            "prep", "--source", str(chats), "--loss-mask", "--vocab-size", "384", "--out", str(data), "--quiet"
        ).returncode
        == 0
    )
    r = cli("train", str(finetune_exp(tmp_path, data)), "--init", str(pre), "--out", str(tmp_path / "y"))
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and lines[-1].startswith(f"error: --init {pre}: its tokenizer"), r.stderr
    assert f"--tokenizer {pre / 'tokenizer.json'}" in lines[-1] and not (tmp_path / "y" / "ckpt").exists()


def test_init_from_the_other_block_family_says_so(pretrained: tuple[Path, Path], tmp_path: Path) -> None:
    """A modern-block experiment (with its own n_head) from a GPT-2-block checkpoint was refused as "another
    model.n_head" (issue 57): the family is compared first, and the line says the families differ."""
    pre, _ = pretrained
    other = write_experiment(tmp_path, model={"vocab_size": 384, "block": "modern", "n_head": 2})
    r = cli("train", str(other), "--init", str(pre), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: --init {pre}: ") and "n_head" not in r.stderr, r.stderr
    assert "of the 'gpt2' block family (model.block), this experiment's is 'modern'" in r.stderr
    assert not (tmp_path / "x").exists()


def test_the_readmes_finetune_experiment_fits_make_trains_weights() -> None:
    """experiments/ANDREA-tiny-CHAT.json: ANDREA-tiny's model (so `--init runs/ANDREA-tiny` takes its weights), the
    loss on assistant tokens only, an lr below pretraining's."""
    from tests.conftest import REPO

    chat, tiny = (config.load(REPO / "experiments" / f"ANDREA-tiny-{n}.json") for n in ("CHAT", "TRAIN"))
    assert chat.model == tiny.model and chat.data.loss_mask and chat.data.source == "shards"
    assert chat.train.lr < tiny.train.min_lr * 2 and chat.name != tiny.name
