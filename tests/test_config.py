"""Experiment files: every shipped experiment loads; bad fields are one line naming file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microgpt import config, memory
from microgpt.config import ConfigError
from tests.conftest import REPO


@pytest.mark.parametrize("path", sorted((REPO / "experiments").glob("ANDREA-*-TRAIN.json")), ids=lambda p: p.name)
def test_shipped_experiments_load(path: Path) -> None:
    exp = config.load(path)
    assert exp.name == path.name.removesuffix("-TRAIN.json")
    assert config.from_dict(exp.to_dict()).to_dict() == exp.to_dict()


def test_family_sizes() -> None:
    n = {name: memory.n_params(config.load(REPO / f"experiments/ANDREA-{name}-TRAIN.json").model)
         for name in ("tiny", "12M", "120M")}  # fmt: skip
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
        ({"train": {"precision": "fp8"}}, "train.precision must be one of fp32, bf16, fp16"),
        ({"train": {"beta2": 1.0}}, "train.beta1 and train.beta2"),
        ({"model": {"vocab_size": 70000}}, "uint16"),
        ({"model": []}, "model: must be a JSON object"),
    ],
)
def test_bad_values(tmp_path: Path, raw: dict, needle: str) -> None:
    path = tmp_path / "exp.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        config.load(path)
    msg = str(err.value)
    assert needle in msg and str(path) in msg and "\n" not in msg


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
