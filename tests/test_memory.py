"""The memory plan and its arena: one allocation, every buffer a disjoint view with its planned shape, the printed
total equal to the allocation, and one-line errors for a plan that cannot be allocated or a buffer it lacks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from microgpt import config
from microgpt.engine import memory, model, params, precision
from microgpt.engine.backend import numpy_backend
from microgpt.run import trainer
from tests.conftest import TINY

M = config.ModelConfig(vocab_size=61, d_model=24, n_layer=2, n_head=3, seq_len=11)


def test_memory_plan_is_the_allocation(tmp_path) -> None:
    """Every buffer is a view into the one arena allocation, and the printed plan's total is its size."""
    tr = trainer.Trainer(config.from_dict(TINY), tmp_path)
    S = tr.S
    assert sum(memory.role_bytes(S.plan, S.K.precision).values()) == S.arena.nbytes == S.arena.pool.nbytes
    pool = S.arena.pool
    lo, hi = pool.ctypes.data, pool.ctypes.data + pool.nbytes
    for (role, name), view in S.arena.views.items():
        assert view.base is not None and lo <= view.ctypes.data and view.ctypes.data + view.nbytes <= hi, name
    spans = sorted((v.ctypes.data, v.ctypes.data + v.nbytes) for (role, _), v in S.arena.views.items())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "views overlap"
    assert S.p.size == params.n_params(tr.m) and S.p.ctypes.data == S.P["wte"].ctypes.data
    total = memory.format_plan(S.plan, S.K.precision).splitlines()[-1]
    assert total.split()[1] == f"{S.arena.nbytes:,}"


def test_a_plan_that_does_not_fit_is_one_line(tmp_path) -> None:
    """The arena is allocated at once; a plan bigger than the machine fails there, naming its size."""
    raw = {**TINY, "train": {**TINY["train"], "micro_batch": 1 << 22}}
    try:
        trainer.Trainer(config.from_dict(raw), tmp_path)
    except memory.PlanError as e:
        assert "bytes" in str(e) and "\n" not in str(e)
    else:
        raise AssertionError("a 4M-sequence micro-batch should not fit")


def test_layout_packs_parameter_roles_and_aligns_the_rest() -> None:
    """Parameter-shaped roles are contiguous in the canonical order (the flat array is the checkpoint's layout);
    every other view starts on ALIGN bytes; the arena is a whole number of ARENA_GRANULE."""
    t = config.TrainConfig(micro_batch=3, n_micro=2, precision="bf16", backend="triton")
    prec = precision.make(t.precision, t.backend)
    bufs = memory.plan(M, t, prec, 7)
    sizes = memory.kind_sizes(prec)
    offsets, roles, total = memory.layout(bufs, sizes)
    for role in memory.PACKED:
        rows = [b for b in bufs if b.role == role]
        starts = [offsets[(role, b.name)] for b in rows]
        ends = [o + b.numel * sizes[b.kind] for o, b in zip(starts, rows)]
        assert starts[1:] == ends[:-1], role
    assert all(off % memory.ALIGN == 0 for (role, _), off in offsets.items() if role not in memory.PACKED)
    assert total % memory.ARENA_GRANULE == 0 and sum(roles.values()) == total
    assert [b.shape for b in bufs if b.role == "inputs"] == [(2, 3, 11), (2, 3, 11)]  # every micro-batch's inputs
    assert "compute_params" in roles and roles["compute_params"] > 0


def test_a_buffer_the_plan_lacks_is_one_line() -> None:
    K = numpy_backend()
    arena = memory.Arena(memory.plan(M, config.TrainConfig(micro_batch=2), K.precision, 5), K)
    with pytest.raises(memory.PlanError, match="no buffer 'nonsense'"):
        arena["nonsense"]
    assert arena["tokens"].dtype == np.int32 and arena["hyper"].shape == (memory.HYPER,)


@pytest.mark.parametrize("block", ["gpt2", "modern"])
def test_fp8_on_the_triton_backend_plans_no_activation_output(block: str) -> None:
    """The triton backend's fp8 MLP computes a = act(h) (GELU, or the modern block's ReLU^2) inside the cast to
    E4M3, so its plan has no (N, 4C) `a`, in training or inference; the NumPy reference of fp8, and every other
    precision, keeps it."""
    B, C = 2, M.d_model
    m = dataclasses.replace(M, block=block)
    for backend, name, planned in [("triton", "fp8", False), ("numpy", "fp8", True), ("triton", "bf16", True)]:
        t = config.TrainConfig(micro_batch=B, backend=backend, precision=name)
        prec = precision.make(t.precision, t.backend)
        rows = {b.name: b.shape for b in memory.plan(m, t, prec, 5)}
        assert ("a" in rows) == planned == prec.act_planned, (backend, t.precision)
        assert rows["dh"] == (B * M.seq_len, 4 * C)
        infer = {b.name for b in memory.inference_plan(m, prec, B, 16)}
        assert ("a" in infer) == planned, (backend, t.precision)


def test_gelu_output_is_saved_per_layer_unless_recomputed() -> None:
    """By default a = gelu(h) is a saved activation, one (N, 4C) plane per layer, which the model hands each layer's
    MLP backward as the forward's; with train.recompute_gelu it is one (N, 4C) scratch all layers share, and
    backward recomputes it. The plans differ by exactly the L - 1 planes more."""
    B, C, L = 2, M.d_model, M.n_layer
    N = B * M.seq_len
    sizes = {}
    for recompute in (False, True):
        t = config.TrainConfig(micro_batch=B, recompute_gelu=recompute)
        K = numpy_backend()
        bufs = memory.plan(M, t, K.precision, 5)
        (a,) = [b for b in bufs if b.name == "a"]
        assert (a.role, a.shape) == (("scratch", (N, 4 * C)) if recompute else ("acts", (L, N, 4 * C)))
        assert memory.act_output_saved(K.precision, t) is not recompute
        arena = memory.Arena(bufs, K)
        per_layer, recomputes = model._mlp_outputs(arena, L)
        assert recomputes is recompute and len(per_layer) == L
        assert all(x.shape == (N, 4 * C) for x in per_layer)
        assert (per_layer[0] is per_layer[-1]) is recompute  # one shared scratch, or a plane per layer
        sizes[recompute] = sum(b.numel for b in bufs)
    assert sizes[False] - sizes[True] == (L - 1) * N * 4 * C


@pytest.mark.parametrize(
    "backend, name, kept",
    [("numpy", "fp32", False), ("triton", "fp32", False), ("triton", "bf16", False), ("triton", "fp16", False),
     ("numpy", "fp8", True), ("triton", "fp8", True)],
)  # fmt: skip
def test_the_modern_plan_keeps_no_pre_activation_where_its_output_is_saved(backend: str, name: str, kept: bool) -> None:
    """ReLU^2's backward reads its output a (2 sqrt(a): ops/relu2.py), so where a is saved per layer the modern plan
    has no h at all, in training or inference: L x (N, 4C) less in training. With train.recompute_gelu h is saved per
    layer again (backward refills a from it); fp8 keeps h as it did (its cast computes act' from h, on the GPU act
    too); the GPT-2 block keeps h always (GELU's backward reads it)."""
    B, C, L = 2, M.d_model, M.n_layer
    N = B * M.seq_len
    prec = precision.make(name, backend)
    for block in ("modern", "gpt2"):
        m = dataclasses.replace(M, block=block)
        assert memory.pre_activation_kept(m, prec) is (kept or block == "gpt2")
        sizes = {}
        for recompute in (False, True):
            t = config.TrainConfig(micro_batch=B, backend=backend, precision=name, recompute_gelu=recompute)
            rows = {b.name: (b.role, b.shape) for b in memory.plan(m, t, prec, 5)}
            per_layer = kept or block == "gpt2" or recompute
            assert rows.get("h") == (("acts", (L, N, 4 * C)) if per_layer else None), (block, recompute)
            if prec.act_planned:
                assert rows["a"] == (("scratch", (N, 4 * C)) if recompute else ("acts", (L, N, 4 * C)))
            sizes[recompute] = sum(math.prod(shape) for _, shape in rows.values())
        infer = {b.name: b.shape for b in memory.inference_plan(m, prec, B, 16)}
        assert infer.get("h") == ((N, 4 * C) if kept or block == "gpt2" else None), block
        if block == "modern" and not kept:  # recompute: h's L planes and a's one scratch, against a's L planes
            assert sizes[True] - sizes[False] == N * 4 * C


def test_andrea_120m_modern_at_micro_batch_32_plans_2_4_gb_less() -> None:
    """The ANDREA-120M-MODERN recipe at micro-batch 32 in bf16 (L 12, N 32768, 4C 3072): its plan without the L
    planes of h is 2 x 12 x 32768 x 3072 bytes = 2.42 GB smaller than with them (the plan the fp8-style rule, h kept,
    would make: memory.pre_activation_kept)."""
    from pathlib import Path

    exp = config.load(Path(__file__).parents[1] / "experiments" / "ANDREA-120M-MODERN-TRAIN.json")
    t = dataclasses.replace(exp.train, micro_batch=32, backend="triton", precision="bf16")
    prec = precision.make("bf16", "triton")
    R = memory.gpu_logits_rows(exp.model, 32, 2)
    bufs = memory.plan(exp.model, t, prec, R)
    assert "h" not in {b.name for b in bufs}
    with_h = [*bufs, memory.Buf("h", (12, 32 * 1024, 3072), "acts", "compute")]
    less = sum(memory.role_bytes(with_h, prec).values()) - sum(memory.role_bytes(bufs, prec).values())
    assert less == 2 * 12 * 32768 * 3072 == 2_415_919_104


def test_largest_fitting_micro_batch_divides_the_step() -> None:
    """The largest micro-batch that divides the step's sequences and whose plan fits, under `below` when given;
    a plan that shrinks past a budget (the logits chunk) still gives the largest that fits, and none when even
    a micro-batch of 1 is over."""
    linear = lambda B: 1000 + 100 * B  # noqa: E731
    assert memory.largest_fitting(linear, 128, 1000 + 100 * 40) == (32, 4200)
    assert memory.largest_fitting(linear, 128, 10**9) == (128, 13800)
    assert memory.largest_fitting(linear, 128, 10**9, below=16) == (8, 1800)
    assert memory.largest_fitting(linear, 96, 1000 + 100 * 40) == (32, 4200)
    assert memory.largest_fitting(linear, 7, 1000 + 100 * 5) == (1, 1100)  # a prime count: 1 or all of it
    assert memory.largest_fitting(linear, 128, 1099) is None
    bumpy = lambda B: {1: 10, 2: 20, 4: 40, 8: 30, 16: 90}[B]  # noqa: E731  (8 below 4: a smaller logits chunk)
    assert memory.largest_fitting(bumpy, 16, 35) == (8, 30)


def test_a_plan_over_the_device_names_its_total_the_room_and_what_fits() -> None:
    prec = precision.make("fp32", "numpy")
    bufs = memory.plan(M, config.TrainConfig(micro_batch=8, n_micro=2), prec, 8)
    total = sum(memory.role_bytes(bufs, prec).values())
    with pytest.raises(memory.PlanError) as e:
        memory.check_fits(bufs, prec, M, total, "gpu", margin=1 << 20, hint=lambda: "try 4")
    assert str(e.value) == (
        f"the memory plan needs {total:,} bytes but the device (gpu) has {total - (1 << 20):,} "
        f"bytes for it ({total / 2**30:.2f} GiB against {total / 2**30:.2f} GiB available less "
        "train.memory_margin 0.00 GiB); try 4"
    )
    assert memory.check_fits(bufs, prec, M, total + (1 << 20), "gpu", margin=1 << 20) is bufs
