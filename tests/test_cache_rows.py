"""serve's cache-row bookkeeping (microgpt/use/cache_rows.py) on a real inference plan of the NumPy backend: a prompt
takes the free row that holds the most of it (its last token never), or the least recently used free row with a busy
row's longer prefix copied into it (the keys and values too); tokens read back extend what a row holds."""

from __future__ import annotations

import numpy as np

from microgpt.config import ModelConfig
from microgpt.engine import params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.infer import make_infer_state
from microgpt.use.cache_rows import CacheRows

M = ModelConfig(vocab_size=64, d_model=16, n_layer=1, n_head=2, seq_len=24)


def rows(reuse: bool = True) -> CacheRows:
    S = make_infer_state(M, numpy_backend(), 3, params.init_weights(M, 0))
    kv = S.arena["kv"]
    kv[...] = np.random.default_rng(0).standard_normal(kv.shape)  # each cache row's keys and values its own
    return CacheRows(S, M.seq_len, reuse)


def test_a_prompt_takes_the_row_holding_most_of_it_and_never_its_last_token() -> None:
    c = rows()
    p = np.arange(10, 20, dtype=np.int32)
    assert c.take(p) == (0, 0, 0) and c.free == [1, 2]  # nothing held: the least recently used row
    c.fed[0] = 9  # all but the last prompt token written
    c.release(0)
    assert c.free == [1, 2, 0]
    assert c.take(p) == (0, 9, 0)  # the same prompt again: all but its last token
    c.fed[0] = 10
    c.drawn(np.array([0]), np.array([9]), np.array([42]))  # the first token drawn, read back
    c.release(0)
    turn = np.array([*p, 42, 7], np.int32)  # a next turn: the prompt, the reply, more
    assert c.take(turn) == (0, 10, 0)  # 42 is known but not in the cache yet
    c.fed[0] = 11  # a step fed it
    c.release(0)
    assert c.take(turn) == (0, 11, 0)
    c.release(0)
    assert c.take(p, reuse=False)[1:] == (0, 0) and rows(reuse=False).take(p)[1:] == (0, 0)


def test_a_busy_rows_longer_prefix_is_copied_into_the_least_recently_used_free_row() -> None:
    c = rows()
    system = np.arange(30, 45, dtype=np.int32)
    donor, _, _ = c.take(np.array([*system, 1, 2], np.int32))
    c.fed[donor] = 17  # busy: it decodes
    kv = c.S.arena["kv"]
    want = kv[:, :, donor, :15].copy()
    slot, held, copied = c.take(np.array([*system, 3], np.int32))
    assert (slot, held, copied) == (1, 15, 15) and c.free == [2]
    np.testing.assert_array_equal(kv[:, :, slot, :15], want)
    assert c.fed[slot] == 15 and c.known[slot] == 16
