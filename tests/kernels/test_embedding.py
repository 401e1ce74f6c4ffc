"""embedding kernels (k_embedding_fwd, k_embedding_sort, k_embedding_bwd) against the NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import embedding as ke
from microgpt.ops import embedding as ref

from ._kutil import DEVICE, DTYPES, TUNER, compare, h, rounded, t

# (B, T, C, V, Tmax): V far below B*T gives runs of one token longer than the kernel's SEG rows
SHAPES = [(3, 7, 12, 5, 11), (1, 1, 5, 3, 1), (4, 16, 37, 2, 16), (2, 24, 8, 97, 32)]


def run_kernels(tokens, wte, wpe, dout, dwte0, dwpe0, dtype, chunk=ke.CHUNK):
    B, T = tokens.shape
    out = torch.empty(B, T, wte.shape[1], dtype=dtype, device=DEVICE)
    ke.embedding_forward(out, t(tokens), t(wte, dtype), t(wpe, dtype))
    dwte, dwpe = t(dwte0, torch.float32), t(dwpe0, torch.float32)
    order = torch.empty(B * T, dtype=torch.int32, device=DEVICE)
    ke.embedding_backward(dwte, dwpe, t(dout, dtype), t(tokens), order=order, chunk=chunk, tuner=TUNER)
    return out, dwte, dwpe


@pytest.mark.parametrize("chunk", [ke.CHUNK, 1], ids=["one-chunk", "chunk-per-sequence"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_embedding(B: int, T: int, C: int, V: int, Tmax: int, dtype: torch.dtype, chunk: int) -> None:
    """chunk=1 rounds up to one sequence per sort chunk: dwte sums then span several chunks."""
    rng = np.random.default_rng(B * T * C + V)
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
    wte, wpe = rounded(rng.standard_normal((V, C)), dtype), rounded(rng.standard_normal((Tmax, C)), dtype)
    dout = rounded(rng.standard_normal((B, T, C)), dtype)
    dwte0, dwpe0 = rng.standard_normal((V, C)), rng.standard_normal((Tmax, C))
    out = np.empty((B, T, C))
    ref.embedding_forward(out, tokens, wte, wpe)
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    ref.embedding_backward(dwte, dwpe, dout, tokens)
    gout, gdwte, gdwpe = run_kernels(tokens, wte, wpe, dout, dwte0, dwpe0, dtype, chunk)
    compare("out", gout, out, dtype)
    compare("dwte", gdwte, dwte, dtype)
    compare("dwpe", gdwpe, dwpe, dtype)
    np.testing.assert_array_equal(h(gdwpe)[T:], dwpe0[T:].astype(np.float32))  # rows past T untouched


@pytest.mark.parametrize("chunk", [ke.CHUNK, 1], ids=["one-chunk", "chunk-per-sequence"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_embedding_without_positions(B: int, T: int, C: int, V: int, Tmax: int, dtype: torch.dtype, chunk: int) -> None:
    """wpe None (the modern block): the token rows alone forward, dwte alone backward, against the NumPy pair; and the
    same dwte bits as with a position table (the sort and the runs are the same)."""
    rng = np.random.default_rng(B * T * C + V + 1)
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
    wte, dout = rounded(rng.standard_normal((V, C)), dtype), rounded(rng.standard_normal((B, T, C)), dtype)
    dwte0 = rng.standard_normal((V, C))
    out, dwte = np.empty((B, T, C)), dwte0.copy()
    ref.embedding_forward(out, tokens, wte)
    ref.embedding_backward(dwte, None, dout, tokens)
    gout = t(rng.standard_normal((B, T, C)), dtype)  # noise the forward overwrites
    ke.embedding_forward(gout, t(tokens), t(wte, dtype))
    gdwte = t(dwte0, torch.float32)
    order = torch.empty(B * T, dtype=torch.int32, device=DEVICE)
    ke.embedding_backward(gdwte, None, t(dout, dtype), t(tokens), order=order, chunk=chunk, tuner=TUNER)
    compare("out", gout, out, dtype)
    compare("dwte", gdwte, dwte, dtype)
    with_pos = run_kernels(tokens, wte, rng.standard_normal((Tmax, C)), dout, dwte0, np.zeros((Tmax, C)), dtype, chunk)
    assert torch.equal(gdwte, with_pos[1]), "dwte differs from the run with a position table"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_embedding_add(B: int, T: int, C: int, V: int, Tmax: int, dtype: torch.dtype) -> None:
    """The value embeddings' forward: out (N, C) += table[tokens], N ids from (B, T) or flat (the decode step's),
    against the NumPy pair (its backward is test_embedding_without_positions' dwte)."""
    rng = np.random.default_rng(B * T * C + V + 2)
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
    table, v0 = rounded(rng.standard_normal((V, C)), dtype), rounded(rng.standard_normal((B * T, C)), dtype)
    want = v0.copy()
    ref.embedding_add_forward(want, tokens, table)
    for ids in (tokens, tokens.reshape(-1)):
        got = t(v0, dtype)
        ke.embedding_add_forward(got, t(ids), t(table, dtype))
        compare("out", got, want, dtype)


def test_embedding_backward_is_deterministic() -> None:
    """Long runs of repeated tokens: two runs give bitwise-equal dwte (no float atomics)."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 3, size=(4, 40)).astype(np.int32)
    wte, wpe, dout = rng.standard_normal((3, 16)), rng.standard_normal((40, 16)), rng.standard_normal((4, 40, 16))
    for chunk in (ke.CHUNK, 80):  # one chunk; two sequences per chunk
        runs = [
            run_kernels(tokens, wte, wpe, dout, np.zeros_like(wte), np.zeros_like(wpe), torch.float32, chunk)
            for _ in "ab"
        ]
        np.testing.assert_array_equal(h(runs[0][1]), h(runs[1][1]))


def test_a_later_backward_of_the_same_tokens_reads_the_first_ones_sort() -> None:
    """The value embeddings' backwards and the embedding's, one micro-batch: the first sorts the tokens into `order`,
    each later one (sorted_before) skips the sort and scatters what it would have, bit for bit."""
    rng = np.random.default_rng(6)
    tokens = t(rng.integers(0, 5, size=(3, 40)).astype(np.int32))
    douts = [t(rng.standard_normal((3, 40, 16))) for _ in range(2)]
    order = torch.empty(3 * 40, dtype=torch.int32, device=DEVICE)
    for chunk in (ke.CHUNK, 80):
        alone = torch.zeros(5, 16, device=DEVICE)
        ke.embedding_backward(alone, None, douts[1], tokens, order=order, chunk=chunk, tuner=TUNER)
        order.fill_(-1)  # whatever the buffer held before this micro-batch's first call
        first, later = torch.zeros(5, 16, device=DEVICE), torch.zeros(5, 16, device=DEVICE)
        ke.embedding_backward(first, None, douts[0], tokens, order=order, chunk=chunk, tuner=TUNER)
        ke.embedding_backward(later, None, douts[1], tokens, sorted_before=True, order=order, chunk=chunk, tuner=TUNER)
        assert torch.equal(later, alone), chunk


@pytest.mark.parametrize("vocab", [97, 2**30], ids=["int32-keys", "int64-keys"])
def test_sort_is_the_stable_order_per_chunk(vocab: int) -> None:
    """k_embedding_sort against NumPy's stable argsort, chunk by chunk (the last one short), with keys token * S +
    position in 32 bits and, where vocab * S may pass 2^31, in 64."""
    rng = np.random.default_rng(vocab)
    S, N = 48, 130
    values = rng.choice(vocab, size=7, replace=False)  # few distinct tokens (long runs), spread over the vocabulary
    tokens = values[rng.integers(0, 7, size=N)].astype(np.int32)
    order = torch.empty(N, dtype=torch.int32, device=DEVICE)
    ke.sort_tokens(order, t(tokens), S, vocab, tuner=TUNER)
    want = np.concatenate([np.argsort(tokens[c : c + S], kind="stable") for c in range(0, N, S)])
    np.testing.assert_array_equal(h(order), want)
