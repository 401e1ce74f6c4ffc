"""The modern block (model.block "modern") against a PyTorch twin written here from the recipe, autograd the oracle:
the loss and every parameter gradient of a 2-layer model in float64 and float32 on the NumPy backend; the inference
step and the decode step against the training forward; and the seed's checkpoint layout for it."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt import config
from microgpt.config import ModelConfig
from microgpt.engine import memory, model, params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.infer import make_infer_state
from microgpt.engine.state import fill_tables
from tests.test_model import check_close

M = ModelConfig(vocab_size=61, d_model=24, n_layer=2, n_head=3, seq_len=11, block="modern", softcap=4.0)
# with value embeddings: two tables, for layers 0 and 3, 1 and 4; layer 2 has none
MV = ModelConfig(
    vocab_size=61, d_model=24, n_layer=5, n_head=3, seq_len=11, block="modern", softcap=4.0, value_embeds=2
)
# with skips: layer 3 adds the stream after layer 0 (its input gradient waits in dskip), layer 2 the stream after
# layer 1, its own input (2k = L: kept in skip_kept)
MS = dataclasses.replace(M, n_layer=4, skips=2)
# skips and value embeddings together, no layer of one kept stream receiving another: 3 adds after 1, 4 after 0
MSV = dataclasses.replace(MV, skips=2, value_embeds=1)
# the window and the documents (issue 55): a window narrower than the sequence, <|endoftext|> (id 0) starting
# documents mid-row; each alone too
MW = dataclasses.replace(M, attn_window=4, doc_mask=0)
MWIN, MDOC = dataclasses.replace(M, attn_window=3), dataclasses.replace(M, doc_mask=0)
# every lever of the block at once: skips, value embeddings, the window and the documents
MSW = dataclasses.replace(MSV, attn_window=4, doc_mask=0)
B = 3
EPS = 1e-6


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of x (B, H, T, D), the rotate-half convention, positions 0 .. T-1; cos and sin rounded to
    float32 once, as the engine's planned table holds them."""
    T, D = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = (f(ang).float().to(x.dtype) for f in (torch.cos, torch.sin))
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def torch_mask(m: ModelConfig, tokens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query i sees key j: j <= i, i - j < the window (model.attn_window, or `window`,
    where not 0) and j at or after the last <|endoftext|> (model.doc_mask) at or before i."""
    Bn, T = tokens.shape
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = (j <= i)[None].expand(Bn, T, T)
    window = m.attn_window if window is None else window
    if window:
        mask = mask & (i - j < window)
    if m.doc_mask >= 0:
        start = torch.where(tokens == m.doc_mask, torch.arange(T), 0).cummax(dim=1).values
        mask = mask & (j[None] >= start[:, :, None])
    return mask[:, None]


def torch_twin_loss(
    P: dict[str, torch.Tensor], m: ModelConfig, tokens: torch.Tensor, targets: torch.Tensor, window: int | None = None
):
    """The modern recipe with [in, out] weights: RMSNorm without weights, QK-norm then RoPE, ReLU^2, untied head,
    logit soft-cap, mean loss over valid targets; value embedding j added to the values of layers j and L - k + j;
    skip j: the stream after layer j, times skip_w[j], added to layer L - 1 - j's input; attention under torch_mask
    (the window, `window` where given, and the documents)."""
    Bn, T = tokens.shape
    C, H = m.d_model, m.n_head
    D = C // H
    x = rms(P["wte"][tokens])
    mask = torch_mask(m, tokens, window)
    kept = []
    for layer in range(m.n_layer):
        h = f"h{layer}."
        if (j := m.n_layer - 1 - layer) < m.skips:
            x = x + P["skip_w"][j] * kept[j]
        a = rms(x)
        q, k, v = a @ P[h + "w_q"], a @ P[h + "w_k"], a @ P[h + "w_v"]
        nv, L = m.value_embeds, m.n_layer
        ve = layer if layer < nv else layer - (L - nv) if layer >= L - nv else None
        if ve is not None:
            v = v + P[f"ve{ve}"][tokens]
        q, k, v = (z.view(Bn, T, H, D).transpose(1, 2) for z in (q, k, v))
        q, k = rotate(rms(q), m.rope_base), rotate(rms(k), m.rope_base)
        s = (q @ k.transpose(-1, -2)) / D**0.5
        y = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + y.transpose(1, 2).reshape(Bn, T, C) @ P[h + "w_o"]
        x = x + F.relu(rms(x) @ P[h + "w_1"]).square() @ P[h + "w_2"]
        if layer < m.skips:
            kept.append(x)
    logits = rms(x) @ P["lm_head"].T
    logits = m.softcap * torch.tanh(logits / m.softcap)
    return F.cross_entropy(logits.view(-1, m.vocab_size), targets.view(-1), ignore_index=-1)


def engine_state(dtype: type, seed: int, m: ModelConfig = M, recompute: bool = False, R: int = 7):
    """A NumPy-backend arena in `dtype`: the init perturbed (its zero-initialised matrices would hide wiring
    mistakes), random tokens and targets, some targets ignored."""
    K = numpy_backend({"f32": dtype, "compute": dtype, "i32": np.int32, "u8": np.uint8})
    t = config.TrainConfig(micro_batch=B, recompute_gelu=recompute)
    arena = memory.Arena(memory.plan(m, t, K.precision, R), K)
    K, _ = K.bind(arena, m)
    fill_tables(K, m, arena)
    rng = np.random.default_rng(seed)
    flat = arena.flat("params")
    flat[...] = params.init_weights(m, seed) + rng.normal(0, 0.2, size=flat.shape)
    P, G = params.views(flat, m), params.views(arena.flat("grads"), m)
    arena["tokens"][0] = rng.integers(0, m.vocab_size, size=(B, m.seq_len))
    if m.doc_mask >= 0:  # documents starting mid-row, at a row's first token, and a row that starts mid-document
        arena["tokens"][0, 0, [3, 7]] = arena["tokens"][0, 1, [0, 5]] = m.doc_mask
        arena["tokens"][0, 2][arena["tokens"][0, 2] == m.doc_mask] = 1
    targets = rng.integers(0, m.vocab_size, size=(B, m.seq_len))
    targets[0, :3] = -1
    arena["targets"][0] = targets
    arena["loss_scale"][0] = 1.0
    return K, arena, P, G


def test_the_parameter_table_is_the_recipe_s() -> None:
    """No position table, no norm weights, an untied head; the same block budget as GPT-2's (12 C^2 a layer)."""
    names = [name for name, _ in params.param_shapes(M)]
    assert names[0] == "wte" and names[-1] == "lm_head" and len(names) == 2 + 6 * M.n_layer
    assert not any(n.startswith("wpe") or "ln" in n for n in names)
    C = M.d_model
    assert (
        params.n_params(M)
        == 2 * M.vocab_size * C + M.n_layer * 12 * C * C
        == sum(math.prod(s) for _, s in params.param_shapes(M))
    )
    w = params.views(params.init_weights(M, 0), M)
    for name in ("h0.w_o", "h1.w_2", "lm_head"):  # each residual branch and the head start at zero
        assert not w[name].any(), name
    assert w["h0.w_q"].std() > 0 and abs(w["wte"].std() - 1) < 0.05
    assert w["head"] is not w["wte"] and np.shares_memory(w["head"], w["lm_head"])
    # FLOPs a token: the untied embedding is a lookup, the head a GEMM
    assert params.flops_params(M)[0] == params.n_params(M) - M.vocab_size * C


def test_value_embeddings_are_tables_after_wte_that_adamw_keeps() -> None:
    """model.value_embeds k: k (V, C) tables right after wte, drawn like it (N(0, 1)); layers j and L - k + j read
    table j; they are lookups for the FLOPs, AdamW's (the embedding group) under Muon, and summed with the embedding
    after the last layer's gradients in data parallel (the bucket every layer finishes before)."""
    from microgpt.engine import collectives, optim

    names = [name for name, _ in params.param_shapes(MV)]
    assert names[:3] == ["wte", "ve0", "ve1"] and names[3].startswith("h0.")
    assert [params.value_embed(MV, layer) for layer in range(MV.n_layer)] == ["ve0", "ve1", None, "ve0", "ve1"]
    assert [params.value_embed(M, layer) for layer in range(M.n_layer)] == [None, None]
    V, C = MV.vocab_size, MV.d_model
    assert params.n_params(MV) == params.n_params(dataclasses.replace(MV, value_embeds=0)) + 2 * V * C
    assert params.flops_params(MV)[0] == params.n_params(MV) - 3 * V * C
    w = params.views(params.init_weights(MV, 0), MV)
    assert all(abs(w[n].std() - 1) < 0.05 for n in ("ve0", "ve1")) and not np.array_equal(w["ve0"], w["ve1"])
    off = params.param_offsets(MV)
    assert not any(name.startswith("ve") for name, _, _ in params.matrices(MV))
    assert optim.adamw_ranges(MV)[0] == ("adamw", 0, off["h0.w_q"])  # wte and both tables
    layers, rest = collectives.grad_buckets(MV)
    assert rest == (0, off["h0.w_q"]) and layers[-1][1] == params.n_params(MV)


def test_skips_are_scalars_after_the_tables_that_adamw_keeps_at_the_head_s_lr() -> None:
    """model.skips k: one (k,) vector skip_w after wte and the value embeddings, ones at init and drawing nothing
    (every other parameter is the model's without skips), never decayed; layer L-1-j receives skip j; under Muon AdamW
    keeps it at the head's row; data parallel sums it with the embedding, after every layer's backward; the plan
    keeps a stream only where a receiving layer adds into it, and a waiting input gradient where layers lie between."""
    from microgpt.engine import collectives, optim

    names = [name for name, _ in params.param_shapes(MSV)]
    assert names[:3] == ["wte", "ve0", "skip_w"] and names[3].startswith("h0.")
    assert dict(params.param_shapes(MSV))["skip_w"] == (2,) and "skip_w" not in dict(params.param_shapes(MV))
    assert [params.skip_into(MSV, layer) for layer in range(5)] == [None, None, None, 1, 0]
    assert [params.skip_into(MS, layer) for layer in range(4)] == [None, None, 1, 0]
    assert params.n_params(MSV) == params.n_params(dataclasses.replace(MSV, skips=0)) + 2
    w = params.named(params.init_weights(MSV, 0), MSV)
    plain = params.named(params.init_weights(dataclasses.replace(MSV, skips=0), 0), dataclasses.replace(MSV, skips=0))
    assert w["skip_w"].tolist() == [1.0, 1.0] and all(np.array_equal(w[n], plain[n]) for n in plain)
    off = params.param_offsets(MSV)
    assert not params.named(params.decay_mask(MSV), MSV)["skip_w"].any()
    assert optim.adamw_ranges(MSV) == [
        ("adamw", 0, off["skip_w"]),
        ("head", off["skip_w"], off["h0.w_q"]),
        ("head", off["lm_head"], params.n_params(MSV)),
    ]
    assert collectives.grad_buckets(MSV)[1] == (0, off["h0.w_q"])
    t = config.TrainConfig(micro_batch=B)
    for m, kept, waiting in ((MS, True, 1), (MSV, False, 2), (dataclasses.replace(MS, skips=1), False, 1)):
        rows = {b.name: b.shape for b in memory.plan(m, t, numpy_backend().precision, 7)}
        N, C = B * m.seq_len, m.d_model
        assert (rows.get("skip_kept") == (N, C)) == kept and rows["dskip"] == (waiting, N, C), m
    two = dataclasses.replace(M, skips=1)  # L = 2: layer 1 adds its own input, nothing waits
    assert "dskip" not in {b.name for b in memory.plan(two, t, numpy_backend().precision, 7)}


@pytest.mark.parametrize(
    "dtype, tol, recompute, M",
    [
        (np.float64, 1e-10, False, M),
        (np.float64, 1e-10, True, M),
        (np.float32, 1e-4, False, M),
        (np.float64, 1e-10, False, MV),
        (np.float32, 1e-4, True, MV),
        (np.float64, 1e-10, False, MS),
        (np.float32, 1e-4, False, MS),
        (np.float64, 1e-10, True, MSV),
        (np.float64, 1e-10, False, MW),
        (np.float32, 1e-4, False, MW),
        (np.float64, 1e-10, False, MWIN),
        (np.float64, 1e-10, True, MDOC),
        (np.float64, 1e-10, False, MSW),
    ],
    ids=[
        "f64",
        "f64-recompute",
        "f32",
        "f64-value-embeds",
        "f32-value-embeds",
        "f64-skips",
        "f32-skips",
        "f64-skips-value-embeds",
        "f64-window-docs",
        "f32-window-docs",
        "f64-window",
        "f64-docs",
        "f64-every-lever",
    ],
)
def test_loss_and_every_gradient_match_torch(dtype: type, tol: float, recompute: bool, M: ModelConfig) -> None:
    K, A, P, G = engine_state(dtype, 0, M, recompute=recompute)
    names = [name for name, _ in params.param_shapes(M)]
    for name in names:  # gradients accumulate: start from noise and subtract it afterwards
        G[name][...] = np.random.default_rng(1).normal(size=G[name].shape)
    noise = {n: G[n].copy() for n in names}
    tokens, targets = A["tokens"][0], A["targets"][0]
    model.gpt_forward(K, M, P, A, tokens, targets)
    eval_losses = A["losses"].copy()
    for name in names:
        np.testing.assert_array_equal(G[name], noise[name], err_msg=f"evaluation forward wrote into grad {name}")
    model.gpt_forward(K, M, P, A, tokens, targets, G)
    np.testing.assert_array_equal(A["losses"], eval_losses)
    K.loss_sum(A["loss_sum"], A["losses"], targets.reshape(-1))
    total, count = A["loss_sum"]
    model.gpt_backward(K, M, P, G, A, tokens)

    TP = {n: torch.tensor(P[n], dtype=torch.float64, requires_grad=True) for n in names}
    loss = torch_twin_loss(TP, M, torch.tensor(tokens, dtype=torch.long), torch.tensor(targets, dtype=torch.long))
    loss.backward()
    check_close("loss", np.array(total / count), loss.detach().numpy(), tol)
    for name in names:
        check_close(f"grad {name}", G[name] - noise[name], TP[name].grad.numpy(), tol)


def test_the_window_and_documents_change_the_loss() -> None:
    """The levers reach the model: the same weights and tokens (MW's, with their <|endoftext|>s) score differently
    with the window, with the documents and with neither, except where a query sees the same keys either way (row 0's
    first positions): the gradient test above would not tell a lever that did nothing from its twin's mask."""
    tokens = engine_state(np.float64, 0, MW)[1]["tokens"][0].copy()
    losses = []
    for m in (M, MWIN, MDOC):
        K, A, P, _ = engine_state(np.float64, 0, m)
        A["tokens"][0] = tokens
        model.gpt_forward(K, m, P, A, A["tokens"][0], A["targets"][0])
        losses.append(A["losses"].copy())
    assert not np.array_equal(losses[0], losses[1]) and not np.array_equal(losses[0], losses[2])
    assert np.array_equal(losses[0][:3], losses[1][:3]) and np.array_equal(losses[0][:3], losses[2][:3])


@pytest.mark.parametrize(
    "M",
    [M, MV, MS, MSV, MW, MSW],
    ids=["plain", "value-embeds", "skips", "skips-value-embeds", "window-docs", "every-lever"],
)
def test_inference_and_decode_are_the_training_forward(M: ModelConfig) -> None:
    """Prefill's per-token losses are the training forward's, bit for bit; decoding token by token through the
    decode step (rotary at each row's own position) gives prefill's next-token logits for every prefix (with the
    window and the documents: the decode step's window and its document starts, read from the cache's tokens); with
    skips, whose kept streams inference copies out of the one layer's x (skips), as training keeps them saved."""
    K, A, P, _ = engine_state(np.float32, 3, M, R=memory.cpu_logits_rows(M, B))  # the loss head's chunks as inference's
    tokens, targets = A["tokens"][0], A["targets"][0]
    model.gpt_forward(K, M, P, A, tokens, targets)
    weights = A.flat("params").copy()
    S = make_infer_state(M, numpy_backend(), B, weights)
    x, y = S.inputs(B, M.seq_len)
    x[...], y[...] = tokens, targets
    S.run(x, 0, y)
    np.testing.assert_array_equal(S.arena["losses"][: B * M.seq_len], A["losses"])

    ids = np.asarray(tokens[:2, :7], np.int32)
    prefill = {}
    for t in range(1, 8):
        P2 = make_infer_state(M, numpy_backend(), 2, weights)
        xx, _ = P2.inputs(2, t)
        xx[...] = ids[:, :t]
        P2.run(xx, 0)
        prefill[t] = P2.arena["next_logits"][:2].copy()
    D = make_infer_state(M, numpy_backend(), 2, weights)
    slots = np.array([1, 0], np.int32)  # rows in other cache rows than their batch order
    for t in range(7):
        logits = D.decode(ids[:, t], np.full(2, t, np.int32), slots)
        np.testing.assert_allclose(logits, prefill[t + 1], rtol=2e-5, atol=2e-5, err_msg=f"position {t}")
    if M is MW:  # windows after position 0, rows at their own positions (serve's): the cached attention's masks
        W = make_infer_state(M, numpy_backend(), 2, weights)
        for row, n in ((0, 4), (1, 2)):
            first, _ = W.inputs(1, n)
            first[...] = ids[row : row + 1, :n]
            W.run(first, 0, slots=[1 - row])
        later, _ = W.inputs(2, 3)
        later[...] = [ids[0, 4:7], ids[1, 2:5]]
        W.run(later, [4, 2], slots=[1, 0])
        want = np.stack([prefill[7][0], prefill[5][1]])
        np.testing.assert_allclose(W.arena["next_logits"][:2], want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("lever", [{}, {"value_embeds": 1}, {"skips": 1}], ids=["plain", "value-embeds", "skips"])
def test_fp8_trains_the_modern_block_next_to_fp32(lever: dict) -> None:
    """precision fp8 on the modern block (the NumPy reference of the GPU's E4M3 block linears and untied head): its
    head's E4M3 copy is lm_head's, Muon leaves the weights' maxima to the cast, and 12 steps on two repeated batches
    land within 2% of fp32's loss; with a value embedding too (added to the E4M3 linear's values), and with a skip
    (the stream an E4M3 linear's output built, added into the last layer's input)."""
    from microgpt.engine.backend import get_backend
    from microgpt.engine.state import make_state
    from microgpt.engine.step import Step

    m = ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, seq_len=16, block="modern", **lever)
    rng = np.random.default_rng(7)
    two = [
        [tuple(rng.integers(0, m.vocab_size, (2, m.seq_len)).astype(np.int32) for _ in range(2)) for _ in range(2)]
        for _ in range(2)
    ]
    losses = {}
    for prec in ("fp32", "fp8"):
        t = config.TrainConfig(
            micro_batch=2,
            n_micro=2,
            precision=prec,
            optimizer="muon",
            lr=0.05,
            head_lr=0.01,
            muon_lr=0.02,
            weight_decay=0.0,
        )
        S = make_state(m, t, get_backend("numpy", prec))
        if prec == "fp8":
            assert S.prec.head is not None and np.shares_memory(S.prec.head.master, S.P["lm_head"])
            assert "fp8_amax_blocks" not in S.arena, "AdamW sees no block matrix under Muon: no maxima to record"
        step = Step(S)
        losses[prec] = [step(two[i % 2], t.lr).loss for i in range(12)]
    assert losses["fp32"][-1] < losses["fp32"][0] - 1.0, losses["fp32"]
    assert abs(losses["fp8"][-1] - losses["fp32"][-1]) < 0.02 * losses["fp32"][-1], losses


MODERN_RUN = {"model": {"block": "modern", "n_head": 2, "softcap": 10.0},
              "train": {"optimizer": "muon", "lr": 0.05, "head_lr": 0.01, "muon_lr": 0.02, "weight_decay": 0.0,
                        "schedule": "warmdown", "warmdown_frac": 0.5, "beta1": 0.8}}  # fmt: skip


# a batch warmup over the first 5 of the 6 steps: 1, 1, 1, 2, 2 micro-batches, then n_micro 3
BATCH_WARMUP = {"n_micro": 3, "batch_warmup_steps": 5, "batch_warmup_start": 1}
# the window's schedule across the resume (steps 0-2 at 16 positions, then model.attn_window's 24 of the 32) and
# documents (the byte tokenizer's <|endoftext|>, NUL: 0)
WINDOW_RUN = ({"attn_window": 24, "doc_mask": 0}, {"attn_window_start": 16, "attn_window_every": 3})


@pytest.mark.parametrize(
    "lever, more_train",
    [
        ({}, {}),
        ({"value_embeds": 1}, {}),
        ({"n_layer": 4, "skips": 2}, {"muon_ns_steps": 3}),
        ({}, BATCH_WARMUP),
        WINDOW_RUN,
    ],
    ids=["plain", "value-embeds", "skips-ns-steps-3", "batch-warmup", "window-docs"],
)
def test_resume_is_bit_exact_on_one_and_two_processes(tmp_path: Path, lever: dict, more_train: dict) -> None:
    """The seed's checkpoint holds Muon's momentum in m (v zero there): a run stopped by SIGTERM and resumed with
    --resume latest, and a two-process run resumed from its step-3 checkpoint, each end on the final checkpoint's
    bytes of the same run never stopped; with value embeddings too (AdamW's, summed with the embedding's bucket), with
    skips (their scalars AdamW's, in the same bucket; 2k = L: a kept copy and a waiting gradient) and 3 Newton-Schulz
    steps (train.muon_ns_steps, recorded in the checkpoint's sidecar with the rest of the experiment), with a batch
    warmup whose checkpoints (steps 2 to 3, and 3) fall inside it, and with the window's schedule (a function of the
    step alone) and document masking."""
    from microgpt import checkpoint
    from tests.conftest import cli, write_experiment
    from tests.test_cli import start_training, wait_for_step

    value_embeds = lever.get("value_embeds", 0)
    exp = write_experiment(
        tmp_path, model={**MODERN_RUN["model"], **lever}, train={**MODERN_RUN["train"], **more_train}
    )
    final = checkpoint.ckpt_name(6)
    straight = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr
    proc = start_training(exp, tmp_path / "b", 6)
    wait_for_step(proc, 2, [])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    resumed = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "b"), "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr
    assert (tmp_path / "a/ckpt" / final).read_bytes() == (tmp_path / "b/ckpt" / final).read_bytes()
    ck, side = checkpoint.load(tmp_path / "a/ckpt" / final)
    assert side["config"]["train"]["muon_ns_steps"] == more_train.get("muon_ns_steps", 5)
    m = ModelConfig(**{**json.loads(exp.read_text())["model"]})
    v = params.named(ck.v, m)
    assert not any(v[name].any() for name, _, _ in params.matrices(m)) and v["wte"].any()
    assert all(v[f"ve{j}"].any() for j in range(value_embeds))
    if "skips" in lever:
        skip_w = params.named(ck.weights, m)["skip_w"]
        assert v["skip_w"].all() and not np.array_equal(skip_w, np.ones(2)), "AdamW trains the skips' scalars"

    two = ("--procs", "2", "--set", "train.micro_batch=2")
    whole = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "two"), *two)
    assert whole.returncode == 0, whole.stderr
    half = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "half"), *two, "--set", "train.ckpt_every=3")
    assert half.returncode == 0, half.stderr
    ck3 = tmp_path / "half/ckpt" / checkpoint.ckpt_name(3)
    again = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "again"), *two, "--resume", str(ck3))
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "two/ckpt" / final).read_bytes() == (tmp_path / "again/ckpt" / final).read_bytes()
    if (
        "batch_warmup_steps" in more_train
    ):  # the runs read the warmup's counts, resumed or not, one process or two: the tokens of each step
        per = 4 * 32  # micro_batch x seq_len, over both ranks of a two-process run alike (2 x 2)
        for run, first in (("b", 1), ("two", 1), ("again", 4)):
            steps = [json.loads(line) for line in (tmp_path / run / "train.jsonl").read_text().splitlines()]
            tokens = {r["step"]: r["tokens"] for r in steps if r.get("event") == "step"}
            assert [tokens[s] for s in range(first, 7)] == [per * c for c in (1, 1, 1, 2, 2, 3)][first - 1 :], run


# docs/ANDREA.md section 9's optimizers and schedule, written out from the text in NumPy float64
NS = (3.4445, -4.7750, 2.0315)


def section9_lr(s: int, t: dict) -> float:
    """f(s) of the warmdown schedule (schedule_start 0, S = train.steps)."""
    S = t["steps"]
    w = min(t["warmup_steps"], S)
    if s < w:
        return t["lr"] * (s + 1) / w
    d = max(w, S - round(t["warmdown_frac"] * S))
    return t["lr"] + (t["min_lr"] - t["lr"]) * min(1, max(0, s - d) / max(1, S - d))


def section9_muon(
    W: np.ndarray, G: np.ndarray, M: np.ndarray, lr: float, mu: float, wd: float, ns_steps: int = 5
) -> None:
    rows, cols = W.shape
    M += (1 - mu) * (G - M)
    U = G + mu * (M - G)
    X = U / (np.linalg.norm(U) + 1e-7)
    X = X.T if rows > cols else X
    a, b, c = NS
    for _ in range(ns_steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    W *= 1 - lr * wd
    W -= lr * math.sqrt(max(1, cols / rows)) * (X.T if rows > cols else X)


def section9_adamw(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, lr: float, n: int, t: dict) -> None:
    p -= lr * t["weight_decay"] * p
    m[...] = t["beta1"] * m + (1 - t["beta1"]) * g
    v[...] = t["beta2"] * v + (1 - t["beta2"]) * g * g
    p -= lr * (m / (1 - t["beta1"] ** n)) / (np.sqrt(v / (1 - t["beta2"] ** n)) + t["eps"])


@pytest.mark.parametrize("ns_steps", [5, 3])
def test_muon_steps_are_section_9s_recipe(tmp_path: Path, ns_steps: int) -> None:
    """The trainer's weights and Muon's momentum after each of six steps against section 9 written out above: the
    init drawn from the seed, G' (the clip acting), Muon on square, wide and tall matrices, AdamW on the embedding and
    the value embeddings at train.lr and on the head at head_lr, both weight decays, the warmdown's start rounded half
    to even, Muon's momentum warmup; the gradients from the torch twin (autograd). At the default Newton-Schulz steps
    and at train.muon_ns_steps 3 (whose weights lie far from 5's after the first step: the engine takes the field)."""
    from microgpt.run import trainer
    from tests.conftest import TINY
    from tests.test_step import FixedBatches, float64_backend

    m = dataclasses.replace(MV, vocab_size=256)
    t = {"optimizer": "muon", "micro_batch": 2, "n_micro": 2, "steps": 6, "lr": 0.05, "head_lr": 0.01,
         "muon_lr": 0.03, "min_lr": 0.002, "warmup_steps": 1, "schedule": "warmdown", "warmdown_frac": 0.75,
         "beta1": 0.8, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "muon_weight_decay": 0.05,
         "grad_clip": 0.3, "muon_momentum_warmup": 3, "muon_momentum_start": 0.85, "muon_momentum": 0.95,
         "muon_ns_steps": ns_steps}  # fmt: skip
    exp = config.from_dict({**TINY, "model": dataclasses.asdict(m), "train": {**TINY["train"], **t}})
    rng = np.random.default_rng(11)
    tokens, targets = (rng.integers(0, m.vocab_size, (t["steps"], 4, m.seq_len)).astype(np.int32) for _ in "xy")
    targets[:, 0, :2] = -1
    tr = trainer.Trainer(exp, tmp_path, K=float64_backend())
    tr.train_data = FixedBatches(tokens, targets, t["micro_batch"])

    draw, parts = np.random.default_rng(exp.train.seed), []  # the init: one generator, the canonical order
    for name, (fan_in, fan_out) in params.param_shapes(m):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("w_o", "w_2", "lm_head"):
            parts.append(np.zeros(fan_in * fan_out))
            continue
        std = 1.0 if leaf == "wte" or leaf.startswith("ve") else min(1, math.sqrt(fan_out / fan_in)) / math.sqrt(fan_in)
        parts.append(draw.normal(0, std, fan_in * fan_out).astype(np.float32).astype(np.float64))
    w = np.concatenate(parts)
    np.testing.assert_array_equal(tr.S.p, w)
    mom, sq = np.zeros_like(w), np.zeros_like(w)
    P, M, V = params.named(w, m), params.named(mom, m), params.named(sq, m)
    clipped = 0
    for s in range(t["steps"]):
        tr.train_step()
        TP = {n: torch.tensor(p, requires_grad=True) for n, p in P.items()}
        for u in range(t["n_micro"]):
            x, y = (torch.tensor(a[s, 2 * u : 2 * u + 2], dtype=torch.long) for a in (tokens, targets))
            torch_twin_loss(TP, m, x, y).backward()  # G: the raw sum over the micro-batches
        gscale = 1 / t["n_micro"]
        norm = math.sqrt(sum(float((p.grad**2).sum()) for p in TP.values()))
        clipped += norm * gscale > t["grad_clip"]
        factor = gscale * min(1, t["grad_clip"] / (norm * gscale + 1e-6))
        f = section9_lr(s, t)
        mu = t["muon_momentum_start"] + (t["muon_momentum"] - t["muon_momentum_start"]) * min(1, s / 3)
        for name, p in P.items():
            g = TP[name].grad.numpy() * factor
            if name.startswith("h"):
                if s == 1 and name == "h0.w_2":  # the other count's update (5 or 3) is not the one taken
                    other = p.copy()
                    section9_muon(
                        other, g, M[name].copy(), f / t["lr"] * t["muon_lr"], mu, t["muon_weight_decay"], 8 - ns_steps
                    )
                section9_muon(p, g, M[name], f / t["lr"] * t["muon_lr"], mu, t["muon_weight_decay"], ns_steps)
            else:
                lr = f / t["lr"] * t["head_lr"] if name == "lm_head" else f
                section9_adamw(p, g, M[name], V[name], lr, s + 1, t)
        check_close(f"weights after step {s}", tr.S.p, w, 1e-12)
        if s == 1:  # the first step whose gradients reach the block (the head and w_o, w_2 start at zero)
            assert np.abs(other - P["h0.w_2"]).max() > 1e-3 * np.abs(P["h0.w_2"]).max(), "3 and 5 steps should differ"
        check_close(f"m after step {s}", tr.S.adam_m, mom, 1e-12)
        check_close(f"v after step {s}", tr.S.adam_v, sq, 1e-12)
    assert clipped > 0 and section9_lr(2, t) == t["lr"] > section9_lr(3, t)  # round(4.5) = 4: the line from s = 2


def test_evaluation_reads_the_window_of_the_step_just_run_and_the_documents(tmp_path: Path) -> None:
    """A run's validation loss after step s attends under step s - 1's window (the schedule's: the model as it is
    trained) and the documents its tokens begin, as the training forward does: it is gpt_forward's loss over the val
    batches under that window, to the bit, and not the loss under the other window."""
    from microgpt.engine import optim
    from microgpt.run import trainer
    from tests.conftest import TINY

    mw = {**TINY["model"], **MODERN_RUN["model"], "doc_mask": 0}  # T 32: windows 16, 16, 16, 32, ...
    tw = {**TINY["train"], **MODERN_RUN["train"], "attn_window_start": 16, "attn_window_every": 3, "eval_every": 1}
    tr = trainer.Trainer(config.from_dict({**TINY, "model": mw, "train": tw}), tmp_path)
    S, A = tr.S, tr.S.arena
    x, _ = tr.val_data.sources["all"].val_batch(0)
    assert (x == 0).any() and (x != 0).any(), "the val windows hold <|endoftext|>s, NUL in the byte tokenizer"

    def val_loss(window: int) -> float:  # evaluation.py's sum, written out, under this window
        A["attn_window"][0] = window
        total, count = 0.0, 0
        for i in range(tr.t.eval_batches):
            A["tokens"][0], A["targets"][0] = tr.val_data.sources["all"].val_batch(i)
            model.gpt_forward(S.K, S.m, S.P_compute, A, A["tokens"][0], A["targets"][0])
            S.K.loss_sum(A["loss_sum"], A["losses"], A["targets"][0].reshape(-1))
            s, c = A["loss_sum"].tolist()
            total, count = total + s, count + int(c)
        return total / count

    for _ in range(4):
        tr.train_step()
        got = tr.evals.due(tr.step)["val_loss"]
        window = optim.attn_window_at(tr.step - 1, S.m, S.t)
        assert int(A["attn_window"][0]) == window == (16 if tr.step <= 3 else 32)
        assert got == val_loss(window)
        # the zero head passes no gradient to the block at step 0, and w_o (zero too) none to attention before its
        # first update: from the second step's on, attention reaches the loss
        assert (got != val_loss(48 - window)) == (tr.step >= 2)
