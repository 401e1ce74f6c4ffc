"""Experiment files: every shipped experiment loads; bad fields are one line naming file and field."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from microgpt import cli, config
from microgpt.config import ConfigError
from microgpt.engine import params
from microgpt.proxy import supervisor
from tests.conftest import REPO, write_experiment
from tests.conftest import cli as cli_run


@pytest.mark.parametrize("path", sorted((REPO / "experiments").glob("ANDREA-*-TRAIN.json")), ids=lambda p: p.name)
def test_shipped_experiments_load(path: Path) -> None:
    exp = config.load(path)
    assert exp.name == path.name.removesuffix("-TRAIN.json")
    assert config.from_dict(exp.to_dict()).to_dict() == exp.to_dict()


def test_family_sizes() -> None:
    n = {
        name: params.n_params(config.load(REPO / f"experiments/ANDREA-{name}-TRAIN.json").model)
        for name in ("tiny", "12M", "120M")
    }
    assert 1e6 <= n["tiny"] <= 3e6 and 11e6 <= n["12M"] <= 14e6 and 120e6 <= n["120M"] <= 128e6
    big = config.load(REPO / "experiments/ANDREA-120M-TRAIN.json")
    m = big.model
    assert (m.d_model, m.n_layer, m.n_head, m.seq_len, big.train.micro_batch) == (768, 12, 12, 1024, 8)


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"modle": {}}, "unknown field 'modle'"),
        ({"model": {"n_head": 5}}, "model.d_model (192) must be divisible by model.n_head (5)"),
        ({"model": {"n_layer": 0}}, "model.n_layer must be > 0"),
        ({"model": {"n_layer": 2.5}}, "field 'n_layer' must be int"),
        ({"model": {"n_layer": True}}, "field 'n_layer' must be int"),
        ({"train": {"lr": "fast"}}, "field 'lr' must be float"),
        ({"train": {"backend": "cuda"}}, "train.backend must be one of"),
        ({"train": {"precision": "bf16"}}, "needs train.backend 'triton'"),
        ({"train": {"precision": "fp4"}}, "train.precision must be one of fp32, bf16, fp16, fp8"),
        ({"train": {"beta2": 1.0}}, "train.beta1 and train.beta2"),
        ({"model": {"vocab_size": 70000}}, "uint16"),
        ({"model": {"d_model": 200, "n_head": 5}, "train": {"precision": "fp8"}}, "multiple of 16 for train.precision"),
        ({"model": []}, "model: must be a JSON object"),
        ({"model": {"value_embeds": 1}}, "model.value_embeds needs model.block 'modern'"),
        ({"model": {"block": "modern", "n_layer": 4, "value_embeds": 3}}, "2 x value_embeds <= model.n_layer (4)"),
        ({"model": {"block": "modern", "value_embeds": -1}}, "got -1"),
        (
            {"train": {"batch_warmup_steps": -1}},
            "train.batch_warmup_steps must be in [0, 2147483647] (0: none), got -1",
        ),
        ({"train": {"batch_warmup_steps": 1.5}}, "field 'batch_warmup_steps' must be int"),
        (
            {"train": {"n_micro": 4, "batch_warmup_start": 5}},
            "train.batch_warmup_start must be in [1, train.n_micro (4)]",
        ),
        (
            {"train": {"batch_warmup_steps": 10, "batch_warmup_start": 0}},
            "batch_warmup_start must be in [1, train.n_mi",
        ),
        ({"train": {"muon_ns_steps": 0}}, "train.muon_ns_steps must be in [1, 10], got 0"),
        ({"train": {"muon_ns_steps": 11}}, "train.muon_ns_steps must be in [1, 10], got 11"),
        ({"train": {"muon_ns_steps": 4.0}}, "field 'muon_ns_steps' must be int"),
        ({"model": {"skips": 1}}, "model.skips needs model.block 'modern'"),
        ({"model": {"block": "modern", "n_layer": 5, "skips": 3}}, "2 x skips <= model.n_layer (5), got 3"),
        ({"model": {"block": "modern", "skips": -2}}, "got -2 on block 'modern'"),
        ({"model": {"attn_window": 64}}, "model.attn_window needs model.block 'modern'"),
        (
            {"model": {"block": "modern", "attn_window": 129}},
            "model.attn_window needs model.block 'modern' and must be",
        ),
        ({"model": {"block": "modern", "attn_window": -1}}, "[0, model.seq_len (128)] (0: the whole sequence), got -1"),
        ({"model": {"doc_mask": 0}}, "model.doc_mask needs model.block 'modern'"),
        ({"model": {"block": "modern", "doc_mask": 2048}}, "the <|endoftext|> id in [0, model.vocab_size (2048)), got"),
        ({"model": {"block": "modern", "doc_mask": -2}}, "model.doc_mask needs"),
        (
            {
                "model": {"block": "modern", "attn_window": 64},
                "train": {"attn_window_start": 64, "attn_window_every": 9},
            },
            "train.attn_window_start needs model.block 'modern' and must be 0 (no schedule) or in (0, 64)",
        ),
        ({"model": {"block": "modern"}, "train": {"attn_window_start": 128, "attn_window_every": 9}}, "in (0, 128)"),
        (
            {"model": {"block": "modern"}, "train": {"attn_window_start": 40, "attn_window_every": 9}},
            "train.attn_window_start must be a multiple of 16",
        ),
        ({"model": {"block": "modern"}, "train": {"attn_window_start": 32}}, "train.attn_window_every must be in [1"),
        ({"model": {"block": "modern"}, "train": {"attn_window_every": 5}}, "and 0 without, got 5"),
        ({"train": {"attn_window_start": 32, "attn_window_every": 5}}, "train.attn_window_start needs model.block"),
        ({"model": {"head_dim": 16}}, "model.head_dim (16) x model.n_head (6) must be model.d_model (192)"),
        ({"model": {"head_dim": -32}}, "model.head_dim (-32) x model.n_head (6) must be model.d_model (192)"),
        ({"model": {"head_dim": "32"}}, "field 'head_dim' must be int"),
        ({"model": {"d_model": 60, "n_head": 4, "block": "modern"}}, "model.head_dim (d_model / n_head) must be even"),
    ],
)
def test_bad_values(tmp_path: Path, raw: dict, needle: str) -> None:
    path = tmp_path / "exp.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        config.load(path)
    msg = str(err.value)
    assert needle in msg and str(path) in msg and "\n" not in msg


def test_head_dim_is_derived_and_may_still_be_named(tmp_path: Path) -> None:
    """model.head_dim is d_model / n_head: a file (or an older checkpoint's sidecar config) naming it, as that or 0,
    loads to the same model; an override naming another value is one line naming the flag."""
    plain = config.from_dict({"model": {"d_model": 64, "n_head": 4}})
    for named in (16, 0):
        exp = config.from_dict({"model": {"d_model": 64, "n_head": 4, "head_dim": named}})
        assert exp.model == plain.model and exp.model.head_dim == 16 and "head_dim" not in exp.to_dict()["model"]
    assert config.build_section(config.ModelConfig, {"head_dim": 0, "n_head": 4}, "side") == config.ModelConfig(
        n_head=4
    )
    path = write_experiment(tmp_path, model={"d_model": 64, "n_head": 4, "head_dim": 16})
    assert config.load(path, ["model.n_head=2", "model.head_dim=32"]).model.head_dim == 32
    with pytest.raises(ConfigError) as err:
        config.load(path, ["model.n_head=2"])
    assert str(err.value) == (
        f"{path} with --set model.n_head: model.head_dim (16) x model.n_head (2) must be model.d_model (64); "
        "leave it out (or 0): d_model / n_head"
    )


def test_invalid_json_names_line(tmp_path: Path) -> None:
    path = tmp_path / "exp.json"
    path.write_text('{"model": {\n  "d_model": 64,\n}')
    with pytest.raises(ConfigError, match=r"invalid JSON at line 3"):
        config.load(path)


def test_override() -> None:
    exp = config.override(config.Experiment(), "train.lr=0.01")
    assert exp.train.lr == 0.01
    with pytest.raises(ConfigError, match="--set train.lrr: train: unknown field 'lrr'"):
        config.override(exp, "train.lrr=1")
    with pytest.raises(ConfigError, match="section.field=value"):
        config.override(exp, "lr=1")


def test_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "exp.json"
    path.write_bytes(b'\xff\xfe{"model": {}}')
    with pytest.raises(ConfigError, match=r"exp.json: not UTF-8 text"):
        config.load(path)


# The flags `microgpt train` and `microgpt run` share: declared once (config.add_experiment_flags), read by one
# loader (config.apply_overrides), so the same bad input gets the same line from both.
SHARED_FLAGS = {"experiment", "out", "steps", "seed", "backend", "precision", "micro_batch", "memory_margin", "set",
                "track", "init", "procs", "data"}  # fmt: skip


def flag_table(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    return {
        a.dest: (tuple(a.option_strings), a.type, a.choices, a.nargs, a.default, a.metavar, a.help)
        for a in parser._actions
        if a.dest != "help"
    }


def test_train_and_run_take_the_shared_flags_as_declared_once() -> None:
    declared = argparse.ArgumentParser()
    config.add_experiment_flags(declared)
    shared = flag_table(declared)
    train, run = flag_table(cli.train_parser()), flag_table(supervisor.run_parser())
    assert set(shared) == SHARED_FLAGS
    assert {k: train[k] for k in shared} == shared and {k: run[k] for k in shared} == shared
    assert set(train) - SHARED_FLAGS == {"resume", "json", "check"}
    assert set(run) - SHARED_FLAGS == {"dashboard", "hang_timeout", "max_restarts"}


def error_line(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """cli.main(argv) in this process: its exit code must be 2 and its stderr one `error:` line."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, rc, lines)
    return lines[0].replace(f"microgpt {argv[0]}:", "microgpt CMD:")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "nope"], "--set 'nope': expected section.field=value"),
        (["--set", "train.lrr=1"], "--set train.lrr: train: unknown field 'lrr'"),
        (["--set", "train.lr=fast"], "--set train.lr: train: field 'lr' must be float"),
        (["--set", "model.d_model=33"], "with --set model.d_model: model.d_model (33) must be divisible"),
        (["--set", "train.lr=0.01", "--precision", "bf16"], "with --set train.lr --precision: train.precision 'bf16'"),
        (["--steps", "0"], "--steps must be an integer in [1, 2147483647], got 0"),
        (["--procs", "0"], "--procs must be an integer in [1, 2147483647], got 0"),
        (["--procs", "1" + "0" * 20], "--procs must be an integer in [1, 2147483647], got 100000000000000000000"),
        (["--seed", "x"], "microgpt CMD: argument --seed: invalid int value: 'x'"),
        (["--backend", "cuda"], "microgpt CMD: argument --backend: invalid choice: 'cuda'"),
        (["--micro-batch", "big"], "microgpt CMD: argument --micro-batch: must be an integer or 'auto', got 'big'"),
        (["--micro-batch", "0"], "with --micro-batch: train.micro_batch must be > 0, got 0"),
        (
            ["--set", 'train.micro_batch="max"'],
            "--set train.micro_batch: train: field 'micro_batch' must be an int or 'auto', got str 'max'",
        ),
        (["--memory-margin", "-1"], "with --memory-margin: train.memory_margin must be in [0, 2**20] GiB, got -1.0"),
        (["--memory-margin", "nan"], "--memory-margin: train: field 'memory_margin' must be a finite number"),
    ],
)
def test_bad_shared_flags_give_the_same_line_from_train_and_run(tmp_path: Path, capsys, args, needle) -> None:
    exp, out = write_experiment(tmp_path), tmp_path / "out"
    train = error_line(["train", str(exp), "--out", str(out), *args], capsys)
    run = error_line(["run", str(exp), "--out", str(out), *args], capsys)
    assert train == run and needle in train, (train, run)
    assert not out.exists()


def test_a_bad_set_exits_2_with_one_line_from_both_commands(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path)
    res = [
        cli_run(cmd, str(exp), "--out", str(tmp_path / "out"), "--set", "model.n_layer=0") for cmd in ("train", "run")
    ]
    assert [r.returncode for r in res] == [2, 2] and res[0].stderr == res[1].stderr, res
    assert res[0].stderr == f"error: {exp} with --set model.n_layer: model.n_layer must be > 0, got 0\n"


def test_micro_batch_auto_keeps_the_step_s_sequences(tmp_path: Path) -> None:
    """ "auto" replaces a number and keeps micro_batch x n_micro: n_micro then counts the step's sequences (the
    memory plan splits them: microgpt/engine/state.py); a file that says "auto" itself gives them as n_micro. Anything
    else but an int is refused naming the field."""
    exp = write_experiment(tmp_path, train={"micro_batch": 8, "n_micro": 16})
    for sets, flags in (([], {"micro_batch": "auto"}), (["train.micro_batch=auto"], {})):
        raw, e = config.apply_overrides(config.read_raw(exp), str(exp), sets, **flags)
        assert (e.train.micro_batch, e.train.n_micro) == ("auto", 128)
    assert config.apply_overrides(config.read_raw(exp), str(exp), [], micro_batch=4)[1].train.n_micro == 16
    e = config.from_dict({**config.read_raw(exp), "train": {"micro_batch": "auto", "n_micro": 64}})
    assert (e.train.micro_batch, e.train.n_micro) == ("auto", 64)
    with pytest.raises(ConfigError, match=r"^x.json: train: field 'micro_batch' must be an int or 'auto', got bool"):
        config.from_dict({"train": {"micro_batch": True}}, "x.json")
