"""The decode step's kernels (kernels/decode.py) against their NumPy twins (ops/decode.py): random rows at ragged
positions of permuted cache rows, noise wherever a row must not read, and the attention under several split plans;
then the whole decode step of the triton backend against the NumPy backend's (logits and greedy tokens)."""

import numpy as np
import pytest
import torch

from microgpt.config import ModelConfig
from microgpt.engine import params
from microgpt.engine.backend import numpy_backend, triton_backend
from microgpt.engine.infer import make_infer_state
from microgpt.kernels import decode as kd
from microgpt.kernels import qkrope as qkrope_kernels
from microgpt.ops import decode as ref
from microgpt.ops import qkrope as qkrope_ref

from ._kutil import DEVICE, DTYPES, ON_GPU, check, compare, h, rounded, t

# (B, T, C, NH, positions, slots): ragged rows over several tiles of keys, one at the cache's last position, one at 0;
# one row at position 0; hs 12 (not a power of two) and hs 4; hs 128 (the modern block's)
CASES = [(4, 70, 24, 2, [69, 3, 40], [1, 3, 0]), (1, 9, 8, 2, [0], [0]), (3, 37, 16, 4, [17, 0, 36], [2, 0, 1]),
         (2, 40, 256, 2, [39, 20], [1, 0])]  # fmt: skip
SMS = [1, 4, 64]  # one split, a few, the most the cache's length allows


def _inputs(rng: np.random.Generator, B: int, T: int, C: int, b: int, dtype: torch.dtype):
    q = rounded(rng.standard_normal((b, C)), dtype)
    kc, vc = (rounded(rng.standard_normal((B, T, C)), dtype) for _ in range(2))
    return q, kc, vc


@pytest.mark.parametrize("sm_count", SMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,NH,positions,slots", CASES)
def test_decode_attention(B, T, C, NH, positions, slots, dtype, sm_count) -> None:
    rng = np.random.default_rng(T + sm_count)
    b = len(positions)
    q, kc, vc = _inputs(rng, B, T, C, b, dtype)
    pos, sl = np.array(positions, np.int32), np.array(slots, np.int32)
    want = np.empty((b, C))
    ref.decode_attention(want, q, kc, vc, pos, sl, NH)
    gk, gv = t(kc, dtype), t(vc, dtype)
    for p, s in zip(positions, slots):
        gk[s, p + 1 :], gv[s, p + 1 :] = 1e4, -1e4  # past the row's position: never read
    S, chunk = kd.split_plan(b, T, NH, sm_count)
    assert S * chunk >= T and (S - 1) * chunk < T and chunk % kd.BN == 0
    n = kd.partials_numel(B, T, C, NH, sm_count)
    partials = torch.full((n,), float("nan"), device=DEVICE)  # a split the combine reads was written first
    out = torch.full((b, C), float("nan"), dtype=dtype, device=DEVICE)
    kd.decode_attention(out, t(q, dtype), gk, gv, t(pos), t(sl), NH, partials=partials, sm_count=sm_count)
    compare("out", out, want, dtype)
    again = torch.full_like(out, float("nan"))
    kd.decode_attention(again, t(q, dtype), gk, gv, t(pos), t(sl), NH, partials=partials, sm_count=sm_count)
    assert torch.equal(out, again), "the splits are combined in a fixed order"


@pytest.mark.parametrize("sm_count", [1, 64])
@pytest.mark.parametrize("window,docs", [(5, False), (20, False), (None, True), (17, True), (1, True)])
def test_decode_attention_window_and_documents(window, docs, sm_count: int) -> None:
    """The split attention with each row's first key from a window and document starts (splits wholly before it
    idle, the combine skipping them) against the NumPy twin; keys before the first hold noise it must not read."""
    rng = np.random.default_rng(sm_count + (window or 0))
    B, T, C, NH, dtype = 4, 70, 24, 2, torch.float32
    positions, slots = [69, 3, 40], [1, 3, 0]
    q, kc, vc = _inputs(rng, B, T, C, 3, dtype)
    pos, sl = np.array(positions, np.int32), np.array(slots, np.int32)
    doc = np.array([50, 0, 33], np.int32) if docs else None
    win = None if window is None else np.array([window], np.int32)
    want = np.empty((3, C))
    ref.decode_attention(want, q, kc, vc, pos, sl, NH, window=win, doc_start=doc)
    gk, gv = t(kc, dtype), t(vc, dtype)
    for i, (p, s) in enumerate(zip(positions, slots)):
        first = max(p - (window or T) + 1, 0 if doc is None else int(doc[i]))
        gk[s, :first], gv[s, :first] = 1e4, -1e4
    partials = torch.full((kd.partials_numel(B, T, C, NH, sm_count),), float("nan"), device=DEVICE)
    out = torch.full((3, C), float("nan"), dtype=dtype, device=DEVICE)
    mask = {"window": None if win is None else t(win), "doc_start": None if doc is None else t(doc)}
    kd.decode_attention(out, t(q, dtype), gk, gv, t(pos), t(sl), NH, partials=partials, sm_count=sm_count, **mask)
    compare("out", out, want, dtype)


def test_decode_doc_starts() -> None:
    """The token writes, then each row's scan of its cache row (over several blocks of positions), against the NumPy
    twin: rows of one cache row read each other's tokens."""
    rng = np.random.default_rng(9)
    tc = rng.integers(0, 4, (3, 40)).astype(np.int32)
    tokens, positions, slots = (np.array(a, np.int32) for a in ([0, 2, 0, 1], [39, 17, 16, 2], [0, 1, 1, 2]))
    want_tc, want = tc.copy(), np.empty(4, np.int32)
    ref.decode_doc_starts(want, want_tc, tokens, positions, slots, 0)
    gtc, doc = t(tc), torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    kd.decode_doc_starts(doc, gtc, t(tokens), t(positions), t(slots), 0)
    assert gtc.cpu().numpy().tolist() == want_tc.tolist()
    assert doc.cpu().numpy().tolist() == want.tolist()


def test_the_split_plan_fills_the_device_at_batch_1() -> None:
    """ANDREA-120M's shape on 132 multiprocessors: small batches split the 1024 keys until the programs fill the
    device (at most one split a tile of keys), a batch whose (row, head) programs fill it alone does not split; no
    plan has an empty split."""
    for b, sms in ((1, 132), (2, 132), (8, 132), (32, 132), (128, 132), (1, 4), (64, 8)):
        S, chunk = kd.split_plan(b, 1024, 12, sms)
        assert 1 <= S <= kd.MAX_SPLITS and (S - 1) * chunk < 1024 <= S * chunk and chunk % kd.BN == 0
        # whole tiles a split: rounding the split's keys up to them can halve the splits, never more
        assert 2 * b * 12 * S >= min(kd.WAVES * sms, b * 12 * 1024 // kd.BN) or S == kd.MAX_SPLITS
    assert kd.split_plan(1, 1024, 12, 132) == (1024 // kd.BN, kd.BN)  # batch 1: every tile its own program
    assert kd.split_plan(128, 1024, 12, 132) == (1, 1024)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,NH,positions,slots", CASES)
def test_decode_kv_write_and_embedding(B, T, C, NH, positions, slots, dtype) -> None:
    """The key and value of each row at (its slot, its position) of the caches, as views of one (3, b, C)
    projection (the decode step's k and v); nothing else of the caches changes; the embedding at each row's own
    position."""
    rng = np.random.default_rng(B * T)
    b, V = len(positions), 13
    qkv = rounded(rng.standard_normal((3, b, C)), dtype)
    kc, vc = (rounded(rng.standard_normal((B, T, C)), dtype) for _ in range(2))
    pos, sl = np.array(positions, np.int32), np.array(slots, np.int32)
    gqkv, gk, gv = t(qkv, dtype), t(kc, dtype), t(vc, dtype)
    ref.decode_kv_write(kc, vc, qkv[1], qkv[2], pos, sl)
    kd.decode_kv_write(gk, gv, gqkv[1], gqkv[2], t(pos), t(sl))
    np.testing.assert_array_equal(h(gk), kc)
    np.testing.assert_array_equal(h(gv), vc)
    wte, wpe = rounded(rng.standard_normal((V, C)), dtype), rounded(rng.standard_normal((T, C)), dtype)
    tokens = rng.integers(0, V, b).astype(np.int32)
    want = np.empty((b, C))
    ref.decode_embedding(want, tokens, pos, wte, wpe)
    out = torch.full((b, C), float("nan"), dtype=dtype, device=DEVICE)
    kd.decode_embedding(out, t(tokens), t(pos), t(wte, dtype), t(wpe, dtype))
    compare("embedding", out, want, dtype)
    ref.decode_embedding(want, tokens, pos, wte)  # no position table (the modern block's)
    out = torch.full((b, C), float("nan"), dtype=dtype, device=DEVICE)
    kd.decode_embedding(out, t(tokens), t(pos), t(wte, dtype))
    np.testing.assert_array_equal(h(out), want)


M = ModelConfig(vocab_size=61, d_model=16, n_layer=2, n_head=2, seq_len=40)


def decode_run(S, ids: np.ndarray, steps: int, forced: list[list[int]] | None = None) -> tuple[list, list]:
    """A prefill of two prompts into cache rows 0 and 1, one decode step of row 0 alone (batch 1), then `steps`
    steps of both rows at their own positions, in swapped order (batch 2): each step's logits, and each row's
    tokens, greedy or `forced` (another run's, so that both runs see the same inputs). The step's own greedy pick
    (next_ids, InferState.greedy) is each of its rows' argmax."""
    tokens, _ = S.inputs(*ids.shape)
    S.K.copy_in(tokens, ids)
    S.run(tokens, 0)
    seqs = [[int(z)] for z in S.K.to_numpy(S.arena["next_logits"][:2]).argmax(axis=1)]
    if forced is not None:
        seqs = [f[:1] for f in forced]
    logits, t0 = [], ids.shape[1]
    for rows in [[0]] + [[1, 0]] * steps:
        pos = [t0 + len(seqs[i]) - 1 for i in rows]
        z = S.K.to_numpy(S.decode([seqs[i][-1] for i in rows], pos, rows)).copy()
        assert S.greedy(len(rows)) == z.argmax(axis=1).tolist()
        logits.append(z)
        for r, i in enumerate(rows):
            seqs[i].append(int(z[r].argmax()) if forced is None else forced[i][len(seqs[i])])
    return logits, seqs


# logits against the NumPy step. fp32 only rounds differently, and so does fp8 over fp32 activations in the interpreter
# (the same E4M3 operands at the same scales, summed in fp32). bf16 rounds every activation on the GPU side, and the
# FP8 tensor cores' sums differ from fp32's: either moves an operand to a neighbouring E4M3 value now and then (a step
# of 1/8), which the next casts magnify (tests/kernels/test_gpu_decode.py holds the GPU's fp8 decode step to its own
# forward instead).
TOL_STEP = {("fp32", None): 1e-5, ("fp8", "fp32"): 5e-2 if ON_GPU else 1e-5, ("bf16", None): 2e-2,
            ("fp8", None): 5e-2}  # fmt: skip


@pytest.mark.parametrize(
    "precision,compute", [("fp32", None), ("fp8", "fp32")] + ([("bf16", None), ("fp8", None)] if ON_GPU else [])
)
def test_the_decode_step_matches_numpy(precision: str, compute: str | None) -> None:
    """The same weights on both backends, the same prompts and decode steps (decode_run: rows at different
    positions, batches of 1 and 2; on a GPU each step a replay of its batch's CUDA graph): every step's logits
    agree (fp32, and fp8 between fp32 activations: to float32's rounding; bf16 and fp8, on the GPU only, whose
    activations are bf16: to bf16's rounding). The triton run is fed the NumPy run's greedy tokens; in fp32, and in
    fp8 over fp32 in the interpreter, its own greedy tokens are those."""
    w = params.init_weights(M, 3)
    w += np.random.default_rng(4).standard_normal(w.shape).astype(np.float32) * 0.05
    ids = np.random.default_rng(5).integers(0, M.vocab_size, (2, 11)).astype(np.int32)
    want, seqs = decode_run(make_infer_state(M, numpy_backend(precision_name=precision), 3, w), ids, 6)
    K = triton_backend(precision, compute=compute)
    got, _ = decode_run(make_infer_state(M, K, 3, w), ids, 6, forced=seqs)
    for step, (a, b) in enumerate(zip(got, want)):
        check(f"step {step}", a, b, TOL_STEP[(precision, compute)])
    if precision == "fp32" or (compute == "fp32" and not ON_GPU):
        _, own = decode_run(make_infer_state(M, triton_backend(precision, compute=compute), 3, w), ids, 6)
        assert own == seqs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,D", [(1, 2), (3, 8), (6, 128), (3, 12)])
def test_decode_qkrope(H: int, D: int, dtype: torch.dtype) -> None:
    """The modern block's QK-norm and rotary embedding of the decode step's rows (q, k views of one (3, b, C)
    projection) at ragged positions, against the NumPy twin; v untouched. In fp32, each row equals the training
    forward's kernel (k_qkrope_fwd) on a one-row window at that position bit for bit."""
    rng = np.random.default_rng(H + D)
    positions = np.array([7, 0, 30, 7, 2], np.int32)
    b, C = len(positions), H * D
    rope = qkrope_ref.rope_tables(33, D)
    qkv = rounded(rng.standard_normal((3, b, C)) * 1.3 - 0.2, dtype)
    gqkv, grope = t(qkv, dtype), t(rope)
    ref.decode_qkrope(qkv[0], qkv[1], positions, rope, n_head=H)
    kd.decode_qkrope(gqkv[0], gqkv[1], t(positions), grope, n_head=H)
    compare("q", gqkv[0], qkv[0], dtype)
    compare("k", gqkv[1], qkv[1], dtype)
    np.testing.assert_array_equal(h(gqkv[2]), qkv[2])
    if dtype == torch.float32:
        want = t(rounded(rng.standard_normal((3, b, C)), dtype), dtype)
        got = want.clone()
        rstd = torch.empty(2, 1, H, device=DEVICE)
        for i, p in enumerate(positions.tolist()):
            qkrope_kernels.qkrope_forward(
                want[0, i : i + 1, None], want[1, i : i + 1, None], rstd, grope, n_head=H, pos=p
            )
        kd.decode_qkrope(got[0], got[1], t(positions), grope, n_head=H)
        assert torch.equal(got, want), "a decode row is the training forward at its position, bit for bit"
