"""The data mixture on the triton backend: the step reports each micro-batch's loss, so the bandit sees the
same per-source losses (and moves the same way) as on the NumPy backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from microgpt import config
from microgpt.run import trainer
from tests.data.test_mixing import FIREHOSE, experiment, write_sources


def test_mixture_on_triton_follows_numpy(tmp_path: Path) -> None:
    root = write_sources(tmp_path / "src", n_train=4000, n_val=400)
    raw = experiment(root, {**FIREHOSE, "warmup_steps": 1})
    raw["model"] = {"vocab_size": 256, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16}  # the interpreter
    raw["train"].update({"micro_batch": 2, "n_micro": 3})
    recs = {}
    for backend in ("numpy", "triton"):
        tr = trainer.Trainer(
            config.from_dict({**raw, "train": {**raw["train"], "backend": backend}}), tmp_path / backend
        )
        recs[backend] = [tr.train_step() for _ in range(3)]
    for a, b in zip(recs["numpy"], recs["triton"]):
        assert list(a["source_loss"]) == list(b["source_loss"])
        for key in ("source_loss", "mixture"):
            np.testing.assert_allclose(list(b[key].values()), list(a[key].values()), rtol=2e-4, err_msg=key)
