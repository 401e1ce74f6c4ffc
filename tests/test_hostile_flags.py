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
@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_init_is_refused(tmp_path: Path, command: str, value: str) -> None:
    exp = write_experiment(tmp_path)
    refused(
        cli(command, str(exp), "--out", str(tmp_path / "run"), "--init", value),
        "--init: an empty path; give a checkpoint or a run folder",
    )
    assert not (tmp_path / "run").exists()


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
