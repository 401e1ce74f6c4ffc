"""Flags that named something unusable (issue 49 class 5): each is one `error:` line, exit 2, before anything is
written: `--init ''` (it would silently train from the seed), `--track tensorboard` where <out>/tb is not a folder,
`--track wandb` with neither an API key nor an offline mode (W&B would stop the run with its own traceback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from microgpt.run import trackers
from tests.conftest import cli, write_experiment
from tests.test_hostile_input import refused, snapshot


@pytest.mark.parametrize("command", ["train", "run"])
@pytest.mark.parametrize("flag", ["--init", "--data", "--out", "--set", "--track"])
@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_flag_value_is_refused(tmp_path: Path, command: str, flag: str, value: str) -> None:
    """`--data ''` trained on the built-in corpus and `--init ''` from the seed, silently (issue 57): every flag's
    empty value is refused by the one parser, before anything is written."""
    exp = write_experiment(tmp_path)
    out = ["--out", str(tmp_path / "run")] if flag != "--out" else []
    refused(cli(command, str(exp), *out, flag, value), f"argument {flag}: an empty value is not allowed")
    assert not (tmp_path / "run").exists() and sorted(os.listdir(tmp_path)) == [exp.name]


@pytest.mark.parametrize(
    "argv",
    [
        ["train", ""],
        ["prep", "--builtin", "--out", ""],
        ["prep", "--source", ""],
        ["prep", "--tokenizer", "", "--builtin"],
        ["pull-hermes3", "--from", ""],
        ["pull-hermes3", "--from", "x.jsonl", "--out", ""],
        ["eval", "RUN", "--hellaswag", ""],
        ["eval", ""],
        ["serve", "RUN", "--host", ""],
        ["export", "RUN", "--out", ""],
        ["sample", "RUN", "--prompt", "x", "--top-k", ""],
    ],
)
def test_every_command_refuses_an_empty_value(tmp_path: Path, argv: list[str]) -> None:
    flag = next((a for a, b in zip(argv, argv[1:]) if b == "" and a.startswith("--")), None)
    line = refused(cli(*argv, cwd=tmp_path), "an empty value is not allowed")
    assert f"argument {flag}:" in line if flag else "argument " in line
    assert os.listdir(tmp_path) == []


def test_an_empty_prompt_is_still_a_prompt() -> None:
    """A flag whose default is "" takes "" (an empty prompt, no system prompt): the parser refuses only where an
    empty value would silently mean something else."""
    from microgpt.errors import ArgParser

    p = ArgParser(prog="t")
    p.add_argument("--prompt", default="")
    p.add_argument("--data")
    assert p.parse_args(["--prompt", ""]).prompt == ""
    with pytest.raises(SystemExit):
        p.parse_args(["--data", ""])


@pytest.mark.parametrize("tb", ["a file", "a dangling link"])
def test_tensorboard_where_its_folder_cannot_be(tmp_path: Path, tb: str) -> None:
    pytest.importorskip("tensorboard")
    exp, out = write_experiment(tmp_path), tmp_path / "run"
    out.mkdir()
    if tb == "a file":
        (out / "tb").write_text("the user's")
    else:
        (out / "tb").symlink_to(tmp_path / "nowhere")
    before = snapshot(tmp_path)
    what = "not a folder" if tb == "a file" else "a link to nothing"
    refused(
        cli("train", str(exp), "--out", str(out), "--track", "tensorboard"),
        f"--track tensorboard: {out / 'tb'} is {what}; TensorBoard's event files are written there",
    )
    assert snapshot(tmp_path) == before and sorted(p.name for p in out.iterdir()) == ["tb"]
    assert not (tmp_path / "nowhere").exists()


@pytest.fixture
def no_wandb_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An environment with no W&B key, mode, netrc or settings: a fresh HOME, this test's folder as the cwd."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_wandb_without_a_key_or_an_offline_mode_is_not_ready(no_wandb_account: Path) -> None:
    assert not trackers.wandb_ready()


@pytest.mark.parametrize(
    "how",
    [
        "WANDB_MODE=offline",
        "WANDB_MODE=disabled",
        "WANDB_API_KEY",
        "netrc",
        "netrc of WANDB_BASE_URL",
        "NETRC",
        "`wandb offline` here",
        "`wandb offline` for the user",
    ],
)
def test_wandb_is_ready_with_a_key_or_an_offline_mode(
    no_wandb_account: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    home = no_wandb_account
    entry = "machine {} login user password {}\n"
    if how.startswith("WANDB_MODE="):
        monkeypatch.setenv("WANDB_MODE", how.split("=")[1])
    elif how == "WANDB_API_KEY":
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    elif how == "netrc":
        (home / ".netrc").write_text(entry.format("api.wandb.ai", "k" * 40))
        os.chmod(home / ".netrc", 0o600)
    elif how == "netrc of WANDB_BASE_URL":
        monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org:8443")
        (home / ".netrc").write_text(entry.format("wandb.example.org", "k" * 40))
        os.chmod(home / ".netrc", 0o600)
    elif how == "NETRC":
        (home / "my.netrc").write_text(entry.format("api.wandb.ai", "k" * 40))
        os.chmod(home / "my.netrc", 0o600)
        monkeypatch.setenv("NETRC", str(home / "my.netrc"))
    else:
        folder = home / "wandb" if how == "`wandb offline` here" else home / ".config" / "wandb"
        folder.mkdir(parents=True)
        (folder / "settings").write_text("[default]\nmode = offline\n")
    assert trackers.wandb_ready()


def test_wandb_settings_that_are_not_an_ini_file_are_no_mode(no_wandb_account: Path) -> None:
    folder = no_wandb_account / "wandb"
    folder.mkdir()
    (folder / "settings").write_bytes(b"\xff\xfe not ini [")
    (no_wandb_account / ".netrc").write_text("machine\n")  # a netrc that does not parse
    assert not trackers.wandb_ready()
