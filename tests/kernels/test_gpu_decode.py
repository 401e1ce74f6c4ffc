"""On the GPU: the decode step's kernels at ANDREA-120M's shape against float64 torch, and the decode step as a CUDA
graph per batch size: each replay equals the eager step over the same inputs, the graphs' results equal the NumPy
backend's, and the peak memory stays within the inference plan.

Run on the GPU machine: MICROGPT_TEST_GPU=1 python3 -m pytest -m gpu tests/kernels/test_gpu_decode.py
(tests/kernels/test_decode.py runs on the GPU too under MICROGPT_TEST_GPU=1, with bf16 and fp8 steps.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from microgpt.config import ModelConfig
from microgpt.engine import memory, model, params
from microgpt.engine.backend import numpy_backend, triton_backend
from microgpt.engine.infer import make_infer_state
from microgpt.kernels import decode as kd

from ._kutil import ON_GPU, SMS, check

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs CUDA")]

B, T, C, NH, V = 32, 1024, 768, 12, 50304
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rows_at(b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """b rows' positions (0 and T - 1 among them where b > 1) and distinct cache rows, int32 on the GPU."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, T, (b,), generator=g)
    if b > 1:
        pos[0], pos[1] = 0, T - 1
    return pos.int().cuda(), torch.randperm(B, generator=g)[:b].int().cuda()


def attention_reference(q, kc, vc, pos, slots) -> torch.Tensor:
    """float64: each row's query over its cache row's positions 0 .. pos[i]."""
    hs, out = C // NH, []
    for i, (p, s) in enumerate(zip(pos.tolist(), slots.tolist())):
        k, v = (z[s, : p + 1].double().view(p + 1, NH, hs).transpose(0, 1) for z in (kc, vc))
        att = torch.softmax(q[i].double().view(NH, 1, hs) @ k.transpose(1, 2) / math.sqrt(hs), dim=-1)
        out.append((att @ v).reshape(C))
    return torch.stack(out)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("b", [1, 7, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernels_gpu(dtype: torch.dtype, b: int) -> None:
    torch.manual_seed(b)
    pos, slots = rows_at(b, b)
    kc, vc = (torch.randn(B, T, C, device="cuda", dtype=dtype) for _ in range(2))
    qkv = torch.randn(3, b, C, device="cuda", dtype=dtype)
    want_k, want_v = kc.clone(), vc.clone()
    want_k[slots.long(), pos.long()], want_v[slots.long(), pos.long()] = qkv[1], qkv[2]
    kd.decode_kv_write(kc, vc, qkv[1], qkv[2], pos, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    partials = torch.full((kd.partials_numel(B, T, C, NH, SMS),), float("nan"), device="cuda")
    out = torch.full((b, C), float("nan"), device="cuda", dtype=dtype)
    kd.decode_attention(out, qkv[0], kc, vc, pos, slots, NH, partials=partials, sm_count=SMS)
    err = rel(out, attention_reference(qkv[0], kc, vc, pos, slots))
    assert err < TOL[dtype], f"attention: rel err {err:.2e} (splits {kd.split_plan(b, T, NH, SMS)})"
    again = torch.empty_like(out)
    kd.decode_attention(again, qkv[0], kc, vc, pos, slots, NH, partials=partials, sm_count=SMS)
    assert torch.equal(out, again), "the splits are combined in a fixed order"
    wte, wpe = torch.randn(V, C, device="cuda", dtype=dtype), torch.randn(T, C, device="cuda", dtype=dtype)
    tokens = torch.randint(0, V, (b,), device="cuda", dtype=torch.int32)
    emb = torch.empty(b, C, device="cuda", dtype=dtype)
    kd.decode_embedding(emb, tokens, pos, wte, wpe)
    err = rel(emb, wte[tokens.long()].double() + wpe[pos.long()].double())
    assert err < TOL[dtype], f"embedding: rel err {err:.2e}"


# a model big enough for the attention to split over a 1024-position cache, small enough for the NumPy reference
MID = ModelConfig(vocab_size=512, d_model=128, n_layer=2, n_head=4, seq_len=1024)


def weights(m: ModelConfig) -> np.ndarray:
    w = params.init_weights(m, 0)
    return w + np.random.default_rng(1).standard_normal(w.shape).astype(np.float32) * 0.05


# two 600-token prompts in cache rows 0 and 1, then (cache rows, tokens) of each decode step: rows at positions from 0
# (row 2 starts there) to past 600, in batches of 1, 2 and 3 (three graphs, each replayed several times)
MID_PROMPT = np.random.default_rng(2).integers(0, MID.vocab_size, (2, 600)).astype(np.int32)
MID_STEPS = [step for i in range(4) for step in (([1], [3 + i]), ([0, 2], [5, 6 + i]), ([2, 1, 0], [7, 8, 9 + i]))]


def decode_steps(S, prompt: np.ndarray, steps: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """A prefill of prompt (b0, t) into cache rows 0 .. b0-1, then each step's rows (slots) with its tokens, each at
    the position after what its cache row holds (the same inputs on every backend): the prefill's next-token logits
    (b0, V), then each step's logits."""
    tokens, _ = S.inputs(*prompt.shape)
    S.K.copy_in(tokens, prompt)
    S.run(tokens, 0)
    out = [S.K.to_numpy(S.arena["next_logits"][: prompt.shape[0]]).copy()]
    held = [prompt.shape[1]] * prompt.shape[0] + [0] * (S.B - prompt.shape[0])
    for slots, toks in steps:
        out.append(S.K.to_numpy(S.decode(toks, [held[s] for s in slots], slots)).copy())
        for s in slots:
            held[s] += 1
    return out


def mid_run(precision: str) -> tuple[list, list]:
    """MID's prefill of two 600-token prompts, then rows at positions from 0 to past 600 in batches of 1, 2 and 3
    (three graphs, each replayed several times), on the triton backend and on the NumPy backend: each one's
    decode_steps."""
    prompt, steps, w = MID_PROMPT, MID_STEPS, weights(MID)
    runs = []
    for K in (triton_backend(precision), numpy_backend(precision_name=precision)):
        runs.append(decode_steps(make_infer_state(MID, K, 3, w), prompt, steps))
    return runs[0], runs[1]


def fp8_histories(m: ModelConfig, w: np.ndarray, prompt: np.ndarray) -> dict:
    """A sidecar's fp8 amax histories, as a run trained in fp8 leaves them: the NumPy fp8 forward over prompt,
    recorded as a training micro-batch is."""
    S = make_infer_state(m, numpy_backend(precision_name="fp8"), prompt.shape[0], w, cache=False)
    tokens, _ = S.inputs(*prompt.shape)
    S.K.copy_in(tokens, prompt)
    model.gpt_infer(S.K, m, S.P_compute, S.arena, tokens, 0)
    S.prec.end_micro_batch()
    return S.prec.sidecar()


# logits against the NumPy step: fp32 only rounds differently; bf16 rounds every activation on the GPU side. (fp8 has
# its own test below: E4M3's steps of 1/8 magnify any difference in the sums.)
TOL_STEP = {"fp32": 1e-5, "bf16": 2e-2}


@pytest.mark.parametrize("precision", list(TOL_STEP))
def test_the_graphs_equal_numpy_gpu(precision: str) -> None:
    """The prefill and every decode step of mid_run against the NumPy backend's, to 1e-5 in fp32 and to bf16's
    rounding in bf16."""
    got, want = mid_run(precision)
    for i, (a, b) in enumerate(zip(got, want)):
        check("prefill" if i == 0 else f"step {i}", a, b, TOL_STEP[precision])


# fp8: the decode step against the GPU's own forward over the same tokens. Between fp32 activations the E4M3 operands
# of both are the same bytes, so the logits agree to fp32's rounding (dev/fp8_decode_check.py measured them equal).
# Between bf16 activations, bf16's rounding of an activation (the GEMMs of b rows and of a window round differently)
# crosses an E4M3 step now and then and moves it by 1/8: 7-8% of the logits at MID and at ANDREA-12M's width, as far
# as the GPU's fp8 forward is from NumPy's; a wrong scale, cache row or position is off by far more.
TOL_FP8_SELF = {"fp32": 1e-5, "bf16": 0.25}


@pytest.mark.parametrize("activations", list(TOL_FP8_SELF))
def test_fp8_decode_step_is_the_forward_gpu(activations: str) -> None:
    """mid_run's decode steps in fp8 (rows at their own positions in batches of 1, 2 and 3), scaled by amax
    histories as a checkpoint trained in fp8 has them, against the training forward's window (model.gpt_infer from
    position 0) over each row's tokens so far, on the same GPU: to TOL_FP8_SELF. (Against the NumPy reference the
    interpreter holds fp8 over fp32 activations to 1e-5: tests/kernels/test_decode.py; on the GPU the FP8 tensor
    cores' sums differ from NumPy's enough to move E4M3 operands, 4-8% of the logits for the forward alone.)"""
    prompt, steps, w = MID_PROMPT, MID_STEPS, weights(MID)
    side = fp8_histories(MID, w, prompt)
    compute = None if activations == "bf16" else activations
    states = [
        make_infer_state(MID, triton_backend("fp8", compute=compute), b, w, cache)
        for b, cache in ((3, True), (1, False))
    ]
    for S in states:
        S.prec.load_sidecar(side, "the test's histories")
    got = decode_steps(states[0], prompt, steps)[1:]
    seqs = [list(prompt[0]), list(prompt[1]), []]
    for i, ((slots, toks), logits) in enumerate(zip(steps, got)):
        for r, (slot, tok) in enumerate(zip(slots, toks)):
            seqs[slot].append(tok)
            want = decode_steps(states[1], np.array([seqs[slot]], np.int32), [])[0][0]
            check(f"step {i} row {slot}", logits[r], want, TOL_FP8_SELF[activations])


def test_a_replay_is_the_eager_step_gpu() -> None:
    """After its graph is captured, each replay at new inputs (positions advanced, other rows, other tokens) gives
    what the eager step (model.gpt_decode, the same kernels and choices) gives on those inputs, bit for bit; and
    the memory the process gains from before the state is made to the last replay is within the plan (less the
    cuBLAS workspace the plan counts, which the backend allocated already), up to GRAPH_SLACK."""
    m = ModelConfig(vocab_size=V, d_model=C, n_layer=12, n_head=NH, seq_len=T)
    K, w = triton_backend("bf16"), params.init_weights(m, 0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()  # earlier tests' runtimes keep their own streams' cuBLAS workspaces
    S = make_infer_state(m, K, B, w)
    roles = memory.role_bytes(S.plan, S.K.precision)
    plan, allocated = sum(roles.values()), roles["runtime"]  # the runtime's row, its workspace: allocated before
    rng = np.random.default_rng(3)
    for b in (1, 32):
        for step in range(3):
            toks, pos = rng.integers(0, V, b), rng.integers(0, T, b)
            slots = rng.permutation(B)[:b]
            got = S.decode(toks, pos, slots).cpu()  # (copies to the host allocate nothing on the device)
            model.gpt_decode(S.K, m, S.P_compute, S.arena, *S.decode_inputs(b))
            assert torch.equal(S.arena["next_logits"][:b].cpu(), got), (b, step)
    assert set(S.decoders) == {1, 32}
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    assert grown <= plan - allocated + GRAPH_SLACK, f"grew {grown:,} bytes; the plan {plan - allocated:,} more"


# torch's own bytes around a decode step, none of them the step's: each captured graph's generator seed and offset (two
# 8-byte tensors, 512-byte blocks to the allocator) and the GEMM choice's comparison scalars in the warm-up
# (dev/decode_memory.py: 1-3 KiB live at the peak at ANDREA-120M's shape)
GRAPH_SLACK = 4096
