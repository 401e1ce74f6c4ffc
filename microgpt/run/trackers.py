"""Trackers: a run's records sent to the tools people already watch. Optional (`pip install -e '.[trackers]'` for
TensorBoard and W&B, `pip install trackio`), off by default; `--track NAME` (repeatable, `train` and `run`) turns one
on:

    tensorboard   event files under <out>/tb/, written by TensorBoard's own writer (EventFileWriter); open them
                  with `tensorboard --logdir <out>/tb`
    wandb         Weights & Biases: wandb.init(project="microgpt", name=<run>, id=<the run folder's>, resume="allow",
                  dir=<out>), wandb.log(metrics, step=step); WANDB_MODE=offline needs no account (`wandb sync` later)
    trackio       the same calls on trackio (`import trackio as wandb`), which keeps runs on this machine

Each tracker gets the records the run's log holds (microgpt/runlog.py), in order, from the queue the run loop drains
between steps, and sends these scalars: train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/elapsed_s,
train/memory_peak (step records), val/loss and val/<source> (eval records), tagged by the global step. A resumed run
(a new process) appends to the same TensorBoard folder and the same W&B run id, so a tracker shows one run. A missing
package (config.check_flags, with the command that installs it), `<out>/tb` that is not a folder, W&B with neither an
API key nor an offline mode, or a tracker whose own start fails: one `error:` line naming the flag, before anything is
written (check, then make).
"""

from __future__ import annotations

import configparser
import hashlib
import importlib
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from microgpt.config import ConfigError, tracker_missing
from microgpt.fileio import folder_problem

STEP_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "memory_peak")


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The scalars of one record, by tag; {} for records that carry none (start, checkpoint, ...)."""
    if rec.get("event") == "step":
        return {f"train/{k}": float(rec[k]) for k in STEP_FIELDS if isinstance(rec.get(k), (int, float))}
    if rec.get("event") == "eval":  # the val loss, HellaSwag (train.hellaswag), or both
        out = {"val/loss": float(rec["val_loss"])} if "val_loss" in rec else {}
        out.update({f"val/{name}": float(v) for name, v in (rec.get("source_val_loss") or {}).items()})
        out.update({f"val/{k}": float(rec[k]) for k in ("hellaswag", "hellaswag_acc_norm") if k in rec})
        return out
    return {}


def _import(name: str, flag: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(tracker_missing(flag)) from None


WANDB_OFFLINE = ("offline", "disabled", "dryrun")  # WANDB_MODE values that need no account


def _wandb_settings_mode() -> str:
    """The mode `wandb offline` / `wandb disabled` left in W&B's settings files (this folder's, then the user's)."""
    config_dir = os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb"
    for path in (Path("wandb") / "settings", Path(config_dir) / "settings"):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        if parser.has_option("default", "mode"):
            return parser.get("default", "mode").strip().lower()
    return ""


def wandb_ready() -> bool:
    """Whether W&B can start here without asking: an offline mode (WANDB_MODE, or the settings `wandb offline`
    writes), or an API key (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc for the API's host)."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower() or _wandb_settings_mode()
    if mode in WANDB_OFFLINE or os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check(names: list[str], out: Path) -> None:
    """What `--track NAME` needs besides its package (config.check_flags found that), checked before anything is
    written: TensorBoard's folder `<out>/tb` a folder where it exists, W&B an API key or an offline mode.
    ConfigError naming the flag otherwise."""
    for name in dict.fromkeys(names):
        tb = out / "tb"
        if name == "tensorboard" and (what := folder_problem(tb)) is not None:
            raise ConfigError(
                f"--track tensorboard: {tb} is {what}; TensorBoard's event files are written there (move it away)"
            )
        if name == "wandb" and not wandb_ready():
            raise ConfigError(
                "--track wandb: no W&B API key and no offline mode here; set WANDB_API_KEY (or run "
                "`wandb login`), or WANDB_MODE=offline to keep the run on this machine (`wandb sync` "
                "uploads it later)"
            )


class TensorBoard:
    """Scalars as TensorBoard event files in `<out>/tb` (a new file per process; TensorBoard reads them as one run)."""

    def __init__(self, out: Path):
        writer = _import("tensorboard.summary.writer.event_file_writer", "tensorboard")
        self.pb = _import("tensorboard.compat.proto.summary_pb2", "tensorboard")
        self.event_pb = _import("tensorboard.compat.proto.event_pb2", "tensorboard")
        self.writer = writer.EventFileWriter(str(out / "tb"))

    def record(self, rec: dict[str, Any]) -> None:
        values = scalars(rec)
        if values:
            summary = self.pb.Summary(value=[self.pb.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
            self.writer.add_event(self.event_pb.Event(wall_time=rec["time"], step=rec["step"], summary=summary))

    def close(self) -> None:
        self.writer.close()


class WandbAPI:
    """W&B, or trackio (the same API): one run per run folder, resumed by every process of it."""

    def __init__(self, module: str, out: Path, run: str, config: dict[str, Any]):
        self.lib = _import(module, module)
        run_id = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]  # the same run for every resume
        try:
            if module == "wandb":
                self.run = self.lib.init(
                    project="microgpt", name=run, id=run_id, resume="allow", dir=str(out), config=config
                )
            else:
                self.run = self.lib.init(project="microgpt", name=run, config=config, resume="allow")
        except Exception as e:  # the tracker's own errors (login, network, its settings) have no common base
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"--track {module}: {module}.init failed ({first[:200]})") from None

    def record(self, rec: dict[str, Any]) -> None:
        values = scalars(rec)
        if values:
            self.lib.log(values, step=rec["step"])

    def close(self) -> None:
        self.lib.finish()


def make(names: list[str], out: Path, run: str, config: dict[str, Any]) -> list[Any]:
    """The trackers `--track` names (each once, in order; config.check_flags knows them: TRACKERS), once the caller
    has checked them (check, before the run folder is locked); ConfigError for a tracker whose start fails."""
    made = []
    for name in dict.fromkeys(names):
        made.append(TensorBoard(out) if name == "tensorboard" else WandbAPI(name, out, run, config))
    return made
