"""The triton backend on cards it has not been run on: each precision refused or admitted by the card's compute
capability (docs/ANDREA.md's table of generations).

No such GPU here: what is replaced is what torch.cuda reports (the card's capability and name); the checks and the
command line are the real ones."""

from __future__ import annotations

import pytest
import torch

from microgpt import cli, config
from microgpt.engine import backend
from microgpt.kernels import fp8 as k8
from microgpt.kernels import linear as klinear
from tests.conftest import write_experiment

# (compute capability, name) of cards the engine is meant for, and one older
CARDS = {"T4": ((7, 5), "Tesla T4"), "3060": ((8, 6), "NVIDIA GeForce RTX 3060"),
         "A100": ((8, 0), "NVIDIA A100-SXM4-40GB"), "4090": ((8, 9), "NVIDIA GeForce RTX 4090"),
         "H200": ((9, 0), "NVIDIA H200")}  # fmt: skip


@pytest.fixture
def card(monkeypatch: pytest.MonkeyPatch):
    """card(name): torch.cuda reports that card, and the precisions' checks run as on a GPU."""

    def stand_in(name: str) -> None:
        cc, device = CARDS[name]
        monkeypatch.setattr(klinear, "INTERPRET", False)
        monkeypatch.setattr(k8, "INTERPRET", False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: device)

    return stand_in


@pytest.mark.parametrize(
    "name, precision, refusal",
    [
        (
            "T4",
            "bf16",
            r"^train.precision 'bf16' needs bfloat16 tensor cores \(compute capability >= 8\.0\); Tesla T4 "
            r"is 7\.5: train.precision 'fp16' runs here \(with its dynamic loss scale\)$",
        ),
        (
            "T4",
            "fp8",
            r"^train.precision 'fp8' needs FP8 tensor cores \(compute capability >= 8\.9\); Tesla T4 is "
            r"7\.5: train.precision 'fp16' runs here",
        ),
        (
            "3060",
            "fp8",
            r"^train.precision 'fp8' needs FP8 tensor cores \(compute capability >= 8\.9\); NVIDIA "
            r"GeForce RTX 3060 is 8\.6: train.precision 'bf16' runs here \(or 'fp16'\)$",
        ),
        ("A100", "fp8", r"A100-SXM4-40GB is 8\.0: train.precision 'bf16' runs here"),
    ],
)
def test_a_precision_the_card_lacks_is_refused_naming_the_field(card, name, precision, refusal) -> None:
    card(name)
    with pytest.raises(config.ConfigError, match=refusal):
        backend.get_backend("triton", precision)


@pytest.mark.parametrize("name", list(CARDS))
def test_what_each_card_generation_gets(card, name) -> None:
    """fp32 and fp16 everywhere; bf16 from Ampere (8.0) on; fp8 from Ada (8.9) on (docs/ANDREA.md's table)."""
    card(name)
    cc = CARDS[name][0]
    admitted = {p for p in ("fp32", "fp16", "bf16") if klinear.Matmul.unsupported(p) is None}
    admitted |= {"fp8"} if k8.Matmul.unsupported("fp8") is None else set()
    assert admitted == {"fp32", "fp16"} | ({"bf16"} if cc >= (8, 0) else set()) | ({"fp8"} if cc >= (8, 9) else set())


def one_error_line(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    rc = cli.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, lines)
    return lines[0]


def test_fp8_on_an_rtx_3060_is_one_line_and_exit_2(tmp_path, card, capsys) -> None:
    card("3060")
    exp = write_experiment(tmp_path, train={"backend": "triton", "precision": "bf16"})
    line = one_error_line(["train", str(exp), "--out", str(tmp_path / "run"), "--precision", "fp8"], capsys)
    assert line.startswith("error: train.precision 'fp8' needs FP8 tensor cores") and " is 8.6: " in line
    assert not list((tmp_path / "run").glob("ckpt/*"))
