"""A run's checkpoints: the run folder checked before anything is trained, the checkpoint written (with the sidecar
that says everything the seed's format has no room for), a resume's state read back, and `--init`'s weights taken
from another run.

Data parallel: every rank comes to a save after the same step; the replicas are checked to agree and rank 0 alone
writes. A checkpoint that cannot be written (a full disk) is a WriteError (exit 4, microgpt/errors.py), the temp
file removed and the previous checkpoints intact.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from microgpt import checkpoint
from microgpt.config import ConfigError, ModelConfig
from microgpt.engine.optim import keep_schedule
from microgpt.engine.trained import Trained, load_trained
from microgpt.errors import WriteError
from microgpt.fileio import file_kind, folder_problem
from microgpt.run import report
from microgpt.runlog import LOG_NAME

# The run folder's own files besides the checkpoints, and what each holds (for the error line).
RUN_FILES = {LOG_NAME: "log", report.JSON_NAME: "report card", report.MD_NAME: "report card"}


def check_out_dir(out: Path) -> None:
    """--out can hold the run before anything is built or trained: a folder (made if missing) whose ckpt, if there,
    is a folder (or a link to one), and whose log and report card, if there, are regular files: a file or a
    dangling link as ckpt would fail the first checkpoint write only after training, a named pipe as the log would
    hang its open, a folder as report.md would fail the card. ConfigError naming it otherwise."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the output folder ({e.strerror})") from None
    ckpt = out / "ckpt"
    if (what := folder_problem(ckpt)) is not None:
        raise ConfigError(f"--out {out}: {ckpt} is {what}; checkpoints are written there (move it away)")
    for name, holds in RUN_FILES.items():
        try:
            mode = os.lstat(out / name).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot use {out / name} ({e.strerror or e})") from None
        if not stat.S_ISREG(mode):
            raise ConfigError(
                f"--out {out}: {out / name} is {file_kind(mode)}, not a regular file; the run's {holds} is "
                "written there (move it away)"
            )


def sidecar_meta(tr: Any, reason: str) -> dict[str, Any]:
    """What trainer `tr`'s checkpoint of its last completed step carries besides the weights, m and v: the config,
    the seed, tokenizer, data, backend and precision, why it was written, the training seconds, the latest
    evaluation, --init's provenance and a mixture's state (FIREHOSE's weights, rewards, draws: a bit-exact resume)."""
    meta = {
        "config": tr.exp.to_dict(),
        "seed": tr.t.seed,
        "tokenizer": tr.tokenizer_info,
        "data": tr.data_info,
        "backend": tr.t.backend,
        "precision": tr.t.precision,
        "reason": reason,
        "elapsed_s": round(tr.elapsed(), 3),
        **tr.evals.last,
    }
    if tr.init:
        meta["init"] = tr.init
    mix = tr.train_data.state()  # plain data: None
    if mix is not None:
        meta["mixing"] = mix
    return meta


def save(tr: Any, reason: str) -> Path | None:
    """Checkpoint trainer `tr`'s last completed step under <out>/ckpt and announce it (data parallel: rank 0 only);
    the write is a critical section (a signal during it is acted on after it)."""
    S = tr.S
    if tr.dp is not None:  # every rank comes here after the same step; the replicas must agree
        tr.dp.check_replicas(tr.step, (S.p, S.adam_m, S.adam_v))
        if tr.rank != 0:
            return None
    was_critical, tr.signals.critical = tr.signals.critical, True
    meta = sidecar_meta(tr, reason)
    target = tr.out / "ckpt" / checkpoint.ckpt_name(tr.step)
    tr.log.check_folder()  # the folder moved aside (another writer may hold its new one): written nowhere
    try:
        path = S.save_checkpoint(target, meta, tr.log.anchor)  # into the folder checked, wherever it is
    except OSError as e:  # a full disk, a read-only folder: fileio removed its temp file, older ones are intact
        tr.log.check_folder()  # or the folder moved away during the write: that is then what happened
        raise WriteError(
            f"{target}: cannot write the checkpoint ({e.strerror or e}); the previous checkpoints are intact"
        ) from None
    tr.last_checkpoint = path
    tr.log.emit({"event": "checkpoint", "step": tr.step, "path": str(path), "reason": reason})
    tr.log.say(f"checkpoint step {tr.step} written ({reason}): {path}")
    tr.signals.critical = was_critical
    return path


def load(tr: Any, path: str | Path) -> None:
    """Resume trainer `tr` from the checkpoint at path: the state, the latest evaluation until the next one, a
    mixture where it left off, the training seconds, --init's provenance and the lr schedule (keep_schedule)."""
    side = tr.S.load_checkpoint(path)
    tr.evals.last = {k: side[k] for k in ("val_loss", "val_step") if k in side}
    tr.train_data.load_state(side.get("mixing"), tr.step, str(path))
    tr.elapsed0 = float(side.get("elapsed_s", 0.0))
    tr.init = side.get("init") or {}
    keep_schedule(tr.t, side.get("config", {}).get("train", {}))


def read_init(where: str, model: ModelConfig) -> Trained:
    """--init's checkpoint (a step-*.bin, or a run folder's newest), read once, before anything is built: the weights
    init_from takes, after a check that they are the `model` this experiment trains (CheckpointError naming it)."""
    ld = load_trained(where)
    fields = sorted(vars(model), key=lambda k: k != "block")  # the family first: its fields follow from it
    diff = next((k for k in fields if vars(model)[k] != vars(ld.exp.model)[k]), None)
    if diff == "block":  # not "another n_head": another architecture, whose weights no setting makes fit
        raise checkpoint.CheckpointError(
            f"--init {where}: {ld.path} is a model of the {ld.exp.model.block!r} block family (model.block), this "
            f"experiment's is {model.block!r}: one family's weights do not fit the other's; --init from a "
            f"{model.block!r} checkpoint"
        )
    if diff is not None:
        raise checkpoint.CheckpointError(
            f"--init {where}: {ld.path} is a model with another model.{diff} "
            f"({getattr(ld.exp.model, diff)}, this experiment's is "
            f"{getattr(model, diff)})"
        )
    return ld


def init_from(tr: Any, ld: Trained) -> None:
    """--init: a new run from another run's weights (read_init's): the same model, fresh Adam moments, step 0, this
    experiment's own schedule. The provenance rides in every sidecar."""
    tr.S.set_weights(ld.weights)
    tok = ld.side.get("tokenizer", {})
    tr.init = {
        "path": str(ld.path),
        "step": ld.step,
        "run": ld.exp.name,
        "sha256": ld.side.get("sha256"),
        "tokenizer": {k: tok[k] for k in ("kind", "sha256") if k in tok},
    }
