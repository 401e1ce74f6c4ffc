"""The architecture's one home (microgpt/engine/params.py): the canonical table, its closed-form size, the views over
flat arrays, the init, and the PyTorch baseline (bench/torch_gpt.py) reading the same table."""

import math

import numpy as np
import pytest
import torch

from microgpt.config import ModelConfig, TrainConfig
from microgpt.engine import params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.model import gpt_forward
from microgpt.engine.state import make_state

M = ModelConfig(vocab_size=53, d_model=12, n_layer=3, n_head=2, seq_len=9)


@pytest.mark.parametrize(
    "m", [M, ModelConfig(), ModelConfig(vocab_size=50304, d_model=768, n_layer=12, n_head=12, seq_len=1024)]
)
def test_the_table_and_its_closed_form_agree(m: ModelConfig) -> None:
    shapes = params.param_shapes(m)
    assert params.n_params(m) == sum(math.prod(s) for _, s in shapes)
    assert len(shapes) == len({n for n, _ in shapes}) == 4 + len(params.BLOCK) * m.n_layer
    offsets = params.param_offsets(m)
    assert [offsets[n] for n, _ in shapes] == list(np.cumsum([0] + [math.prod(s) for _, s in shapes])[:-1])


def test_andrea_120m_has_gpt2_small_size() -> None:
    m = ModelConfig(vocab_size=50257, d_model=768, n_layer=12, n_head=12, seq_len=1024)
    assert params.n_params(m) == 124_439_808 - 12 * 9 * 768  # GPT-2 small less its linear biases (9 C a block)


def test_views_share_the_flat_array_and_the_qkv_site_is_three_weights() -> None:
    flat = np.arange(params.n_params(M), dtype=np.float32)
    V = params.views(flat, M)
    for name, shape in params.param_shapes(M):
        assert V[name].shape == shape and np.shares_memory(V[name], flat)
    for layer in range(M.n_layer):
        qkv = V[f"h{layer}.w_qkv"]
        assert qkv.shape == (3, M.d_model, M.d_model) and np.shares_memory(qkv, flat)
        for g, leaf in enumerate(params.SITES["w_qkv"]):
            np.testing.assert_array_equal(qkv[g], V[f"h{layer}.{leaf}"])
    assert set(params.site_shapes(M.d_model)) == set(params.SITES)


def test_init_is_gpt2s_and_a_function_of_the_seed() -> None:
    w = params.init_weights(M, 5)
    np.testing.assert_array_equal(w, params.init_weights(M, 5))
    assert not np.array_equal(w, params.init_weights(M, 6))
    V = params.views(w, M)
    for name, shape in params.param_shapes(M):
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("_w"):
            assert (V[name] == 1).all(), name
        elif leaf.endswith("_b"):
            assert (V[name] == 0).all(), name
    big = ModelConfig(vocab_size=2000, d_model=64, n_layer=2, n_head=2, seq_len=64)
    V = params.views(params.init_weights(big, 0), big)
    assert abs(V["wte"].std() - 0.02) < 1e-3
    assert abs(V["h0.w_2"].std() - 0.02 / 2) < 1e-3  # 1/sqrt(2L), L = 2
    mask = params.views(params.decay_mask(big), big)
    assert all((mask[n] == (len(s) == 2)).all() for n, s in params.param_shapes(big))


def test_the_pytorch_baseline_reads_the_same_architecture() -> None:
    """bench/torch_gpt.py built from the table starts from microgpt's weights and gives microgpt's loss."""
    from bench.torch_gpt import GPT

    t = TrainConfig(micro_batch=2, seed=11)
    S = make_state(M, t, numpy_backend())
    assert sum(p.numel() for p in GPT(M, seed=t.seed).parameters()) == params.n_params(M)
    rng = np.random.default_rng(0)
    x = rng.integers(0, M.vocab_size, size=(2, M.seq_len)).astype(np.int32)
    y = rng.integers(0, M.vocab_size, size=(2, M.seq_len)).astype(np.int32)
    S.arena["tokens"][0], S.arena["targets"][0] = x, y
    gpt_forward(S.K, M, S.P_compute, S.arena, S.arena["tokens"][0], S.arena["targets"][0])
    ours = float(S.arena["losses"].mean())
    theirs = GPT(M, seed=t.seed)(torch.from_numpy(x).long(), torch.from_numpy(y).long()).item()
    assert abs(ours - theirs) < 1e-5 * abs(ours), (ours, theirs)
