"""Data parallel (microgpt/distributed.py): N processes on the CPU with gloo and the NumPy engine."""

from __future__ import annotations

import numpy as np

from microgpt import config, data
from tests.conftest import TINY


def test_loader_shards_are_the_rows_of_the_global_batch() -> None:
    exp = config.from_dict(TINY)
    b, world = 3, 2
    whole_train, whole_val = data.make_loaders(exp, world * b)
    for rank in range(world):
        train, val = data.make_loaders(exp, b, shard=(rank, world))
        rows = slice(rank * b, (rank + 1) * b)
        for step, micro in ((0, 0), (0, 1), (5, 1), (10_000, 0)):  # 10_000: a later epoch
            for got, want in zip(train.batch(step, micro), whole_train.batch(step, micro)):
                np.testing.assert_array_equal(got, want[rows])
        for i in (0, 3):
            for got, want in zip(val.val_batch(i), whole_val.val_batch(i)):
                np.testing.assert_array_equal(got, want[rows])
