"""A trained model read back: a checkpoint with the experiment of its sidecar, checked against the parameter table.

sample, chat, eval, export, serve, the report card and `--init` start from here (microgpt/checkpoint.py reads and
writes the seed's file format; this module knows what model the file holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import checkpoint, config
from microgpt.checkpoint import CheckpointError
from microgpt.engine import params
from microgpt.engine.precision import check_sidecar


@dataclass
class Trained:
    """A checkpoint read back with everything needed to use its model elsewhere (sample, chat, export, eval)."""

    path: Path
    exp: config.Experiment
    step: int
    weights: np.ndarray  # (n_params,) float32, canonical order
    side: dict[str, Any]

    def params(self) -> dict[str, np.ndarray]:
        """Named views of the weights, in the canonical order (microgpt/engine/params.py)."""
        return params.named(self.weights, self.exp.model)

    @property
    def precision(self) -> str:
        """The precision the run trained in (its sidecar's, else its experiment's)."""
        return self.side.get("precision", self.exp.train.precision)


def load_trained(where: str | Path) -> Trained:
    """A step-*.bin or a run folder (its newest valid checkpoint), read once, checked against its sidecar's model."""
    ck, side = checkpoint.resolve_loaded(where)
    path, sidecar = ck.path, checkpoint.sidecar_path(ck.path)
    check_sidecar(side, str(sidecar))
    if "config" not in side:
        what = "has no field 'config'" if sidecar.exists() else "is missing"
        raise CheckpointError(f"{sidecar}: the checkpoint's sidecar {what}: cannot rebuild the model")
    exp = config.from_dict(side["config"], f"{sidecar}: field 'config'")
    saved = side.get("params")
    if saved is not None and [(k, tuple(v)) for k, v in saved] != params.param_shapes(exp.model):
        raise CheckpointError(
            f"{sidecar}: field 'params' does not match its 'config.model'; checkpoint is for another model"
        )
    if ck.weights.size != params.n_params(exp.model):
        raise CheckpointError(
            f"{path}: checkpoint holds {ck.weights.size} parameters but the sidecar's model has "
            f"{params.n_params(exp.model)}; checkpoint is for another model"
        )
    return Trained(path, exp, ck.step, ck.weights, side)
