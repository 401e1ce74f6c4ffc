"""`microgpt export --format gguf`: a GGUF file that llama.cpp loads as its GPT-2 (ANDREA's block) or its apertus (the
modern block without a soft-cap).

Read back with the `gguf` package (llama.cpp's own Python reader, in the test extra): every metadata key and value,
every tensor's name, ggml shape, type and data, the data rebuilt here from microgpt's parameters by their names
(not through the exporter's map); Q8_0 blocks byte for byte as gguf-py's quantizer (the reference implementation of
ggml's) writes them. The modern file also runs through apertus_logits, llama.cpp's apertus graph (as its
src/models/apertus.cpp and ggml's xIELU compute it) in NumPy from the file's keys and tensors alone, against
microgpt's logits. Where llama-cpp-python is installed (`make check-gguf`: it compiles llama.cpp, too long for CI),
the real llama.cpp loads each file and tokenizes as microgpt does; from the fp32 file its logits are microgpt's (within
1e-3) and its greedy tokens are `microgpt sample`'s, for both blocks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine.trained import load_trained
from microgpt.use import sample
from microgpt.use.export import CHAT_TEMPLATE
from tests.conftest import cli, write_experiment

gguf = pytest.importorskip("gguf")

# tests/test_modern.py's MODERN_RUN (that module imports torch, which `make check-gguf`'s venv does not have)
MODERN = {"model": {"block": "modern", "n_head": 2, "softcap": 10.0},
          "train": {"optimizer": "muon", "lr": 0.05, "head_lr": 0.01, "muon_lr": 0.02, "weight_decay": 0.0,
                    "schedule": "warmdown", "warmdown_frac": 0.5, "beta1": 0.8}}  # fmt: skip
# the tokenizer's keys, the same in both blocks' files (the built-in BPE's ids)
TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt-2",
    "tokenizer.ggml.bos_token_id": 0,
    "tokenizer.ggml.eos_token_id": 0,
    "tokenizer.ggml.eot_token_id": 2,
    "tokenizer.ggml.padding_token_id": 3,
    "tokenizer.ggml.add_bos_token": False,
    "tokenizer.ggml.add_eos_token": False,
    "tokenizer.chat_template": CHAT_TEMPLATE,
}
PROMPTS = ["def add(a, b):\n    return", "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"]


def train(
    folder: Path,
    vocab_size: int,
    d_model: int = 64,
    steps: int = 8,
    tokenizer_size: int = 0,
    modern: dict | None = None,
    shards: Path | None = None,
) -> Path:
    """A run of TINY's shape at this width and vocabulary; tokenizer_size: its data prepared with a BPE of that many
    entries (the model's ids past it are padding), or shards: another run's prepared data, else the built-in corpus
    at the model's own size; modern: the modern block (MODERN) with these model fields over it."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"path": str(shards or folder / "data")}
    if shards:
        data["source"] = "shards"
    elif tokenizer_size:
        prep = cli(
            "prep",
            "--builtin",
            "--vocab-size",
            str(tokenizer_size),
            "--max-bytes",
            "400000",
            "--val-fraction",
            "0.3",
            "--out",
            str(folder / "data"),
            "--quiet",
        )
        assert prep.returncode == 0, prep.stderr
        data["source"] = "shards"
    model, train = {"vocab_size": vocab_size, "d_model": d_model, "seq_len": 64}, {"steps": steps}
    if modern is not None:
        model, train = {**MODERN["model"], **model, **modern}, {**MODERN["train"], **train}
    exp = write_experiment(folder, model=model, train=train, data=data)
    res = cli("train", str(exp), "--out", str(folder / "run"))
    assert res.returncode == 0, res.stderr
    return folder / "run"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE model of 520 ids over a 512-entry tokenizer (ids past it: padding), rows of 64 (Q8_0's blocks of 32)."""
    return train(tmp_path_factory.mktemp("gguf"), 520, tokenizer_size=512)


@pytest.fixture(scope="module")
def modern_run(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The modern block, model.softcap 0 (apertus has no soft-cap), on run's data: head dim 32."""
    return train(tmp_path_factory.mktemp("gguf-modern"), 520, modern={"softcap": 0.0}, shards=run.parent / "data")


def export(run: Path, out: Path, dtype: str) -> Path:
    res = cli("export", str(run), "--out", str(out), "--format", "gguf", "--dtype", dtype)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"exported {run}/ckpt/step-") and res.stdout.endswith(f"{dtype} weights\n")
    arch = "apertus" if load_trained(run).exp.model.block == "modern" else "gpt2"
    assert f": a GGUF file (llama.cpp's {arch}), " in res.stdout
    return out


def expected_tensors(run: Path) -> dict[str, np.ndarray]:
    """llama.cpp's GPT-2 tensors from microgpt's parameters, numpy layout (the last axis is ggml's ne0)."""
    ld = load_trained(run)
    P, m = ld.params(), ld.exp.model
    out = {
        "token_embd.weight": P["wte"],
        "position_embd.weight": P["wpe"],
        "output_norm.weight": P["lnf_w"],
        "output_norm.bias": P["lnf_b"],
    }
    for i in range(m.n_layer):
        h, b = f"h{i}.", f"blk.{i}."
        qkv = np.concatenate([P[h + "w_q"], P[h + "w_k"], P[h + "w_v"]], axis=1)  # (C, 3C) = x @ w
        out |= {
            b + "attn_norm.weight": P[h + "ln1_w"],
            b + "attn_norm.bias": P[h + "ln1_b"],
            b + "ffn_norm.weight": P[h + "ln2_w"],
            b + "ffn_norm.bias": P[h + "ln2_b"],
            b + "attn_qkv.weight": qkv.T,
            b + "attn_output.weight": P[h + "w_o"].T,
            b + "ffn_up.weight": P[h + "w_1"].T,
            b + "ffn_down.weight": P[h + "w_2"].T,
        }
        for name, w in list(out.items()):
            if name.startswith(b) and name.endswith(("qkv.weight", "output.weight", "up.weight", "down.weight")):
                out[name.replace(".weight", ".bias")] = np.zeros(w.shape[0], np.float32)
    return out


def fields(reader: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def check_vocab(got: dict[str, object], run: Path) -> None:
    """The tokens, their types and the merges (popped from got) are the run's tokenizer's, padded to 520 ids."""
    ld = load_trained(run)
    m, tok = ld.exp.model, load_tokenizer(ld.side["tokenizer"])
    raw = json.loads((run / "tokenizer.json").read_text())
    tokens, types = got.pop("tokenizer.ggml.tokens"), got.pop("tokenizer.ggml.token_type")
    merges = got.pop("tokenizer.ggml.merges")
    assert len(tokens) == len(types) == m.vocab_size == 520 and tok.vocab_size == 512
    assert tokens == [tok.tok.id_to_token(i) for i in range(512)] + [f"[PAD{i}]" for i in range(512, 520)]
    assert types == [3] * 4 + [1] * 508 + [5] * 8  # control: the four special tokens; unused: the padding
    assert merges == [" ".join(p) for p in raw["model"]["merges"]]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "q8_0"])
def test_every_key_and_tensor_reads_back(run: Path, tmp_path: Path, dtype: str) -> None:
    path = export(run, tmp_path / "model.gguf", dtype)
    reader = gguf.GGUFReader(path)
    got = fields(reader)
    check_vocab(got, run)
    file_type = {"fp32": 0, "fp16": 1, "q8_0": 7}[dtype]
    want = {
        "general.architecture": "gpt2",
        "general.name": "tiny-test",
        "general.file_type": file_type,
        "gpt2.context_length": 64,
        "gpt2.embedding_length": 64,
        "gpt2.feed_forward_length": 256,
        "gpt2.block_count": 2,
        "gpt2.attention.head_count": 4,
        "gpt2.attention.layer_norm_epsilon": pytest.approx(1e-5, rel=1e-6),
        **TOKENIZER_KEYS,
    }
    want |= {"general.quantization_version": 2} if dtype == "q8_0" else {}
    assert got == want

    want_t = expected_tensors(run)
    names = [t.name for t in reader.tensors]
    assert sorted(names) == sorted(want_t) and len(names) == 4 + 12 * 2  # every tensor once, nothing else
    for t in reader.tensors:
        w = want_t[t.name]
        assert list(t.shape) == list(w.shape[::-1]), t.name  # ggml's ne: the fastest-varying first
        kind = gguf.GGMLQuantizationType
        if w.ndim == 1 or t.name == "position_embd.weight" or dtype == "fp32":
            assert t.tensor_type == kind.F32 and np.array_equal(t.data.reshape(w.shape), w), t.name
        elif dtype == "fp16":
            assert t.tensor_type == kind.F16 and np.array_equal(t.data.reshape(w.shape), w.astype(np.float16))
        else:  # gguf-py's Q8_0 is bit for bit ggml's reference quantizer
            assert t.tensor_type == kind.Q8_0, t.name
            assert t.data.tobytes() == gguf.quants.quantize(w, kind.Q8_0).tobytes(), t.name
            back = gguf.quants.dequantize(t.data, kind.Q8_0).reshape(w.shape)
            assert np.abs(back - w).max() <= np.abs(w).max() / 127 * 0.51, t.name
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_q8_0_keeps_rows_it_cannot_block_in_fp16(tmp_path: Path) -> None:
    """d_model 48: rows of 48 values are no whole number of Q8_0's blocks of 32; those tensors are written fp16, while
    ffn_down's rows (4 x 48 = 192 values, its input) are blocked."""
    run = train(tmp_path, 384, d_model=48, steps=1)
    reader = gguf.GGUFReader(export(run, tmp_path / "m.gguf", "q8_0"))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["token_embd.weight"] == "F16" and kinds["blk.0.attn_qkv.weight"] == "F16"
    assert kinds["blk.0.ffn_down.weight"] == "Q8_0" and kinds["position_embd.weight"] == "F32"


def test_byte_model_has_the_256_byte_tokens(tmp_path: Path) -> None:
    run = train(tmp_path, 256, steps=1)
    got = fields(gguf.GGUFReader(export(run, tmp_path / "b.gguf", "fp32")))
    tokens = got["tokenizer.ggml.tokens"]
    assert len(tokens) == 256 and tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ" and tokens[10] == "Ċ"
    assert "tokenizer.chat_template" not in got and got["tokenizer.ggml.eos_token_id"] == 0


def test_bad_dtype_and_an_existing_out_are_refused(run: Path, tmp_path: Path) -> None:
    res = cli("export", str(run), "--out", str(tmp_path / "m.gguf"), "--format", "gguf", "--dtype", "bf16")
    assert res.returncode == 2 and res.stderr == "error: --dtype bf16: --format gguf takes fp32 or fp16 or q8_0\n"
    (tmp_path / "m.gguf").write_text("mine")
    res = cli("export", str(run), "--out", str(tmp_path / "m.gguf"), "--format", "gguf")
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"error: --out {tmp_path / 'm.gguf'}: exists; choose a new file (nothing overwritten)"
    ]
    assert (tmp_path / "m.gguf").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


# --- the modern block as llama.cpp's apertus ------------------------------------------------------------------
def modern_expected(run: Path) -> dict[str, np.ndarray]:
    """llama.cpp's apertus tensors from microgpt's parameters, numpy layout: (out, in) matrices, the embedding
    RMSNormed row by row, norm weights ones."""
    ld = load_trained(run)
    P, m = ld.params(), ld.exp.model
    wte = P["wte"].astype(np.float64)
    emb = wte / np.sqrt((wte * wte).mean(axis=1, keepdims=True) + 1e-6)
    ones_c, ones_d = np.ones(m.d_model, np.float32), np.ones(m.d_model // m.n_head, np.float32)
    out = {"token_embd.weight": emb, "output_norm.weight": ones_c, "output.weight": P["lm_head"]}
    for i in range(m.n_layer):
        h, b = f"h{i}.", f"blk.{i}."
        out |= {b + n: ones_c for n in ("attn_norm.weight", "ffn_norm.weight")}
        out |= {b + n: ones_d for n in ("attn_q_norm.weight", "attn_k_norm.weight")}
        out |= {b + f"attn_{x}.weight": P[h + f"w_{x}"].T for x in "qkv"}
        out |= {
            b + "attn_output.weight": P[h + "w_o"].T,
            b + "ffn_up.weight": P[h + "w_1"].T,
            b + "ffn_down.weight": P[h + "w_2"].T,
        }
    return out


def tensors_of(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    """Each tensor as fp64, numpy layout, dequantized."""
    return {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(list(t.shape)[::-1]).astype(np.float64)
        for t in reader.tensors
    }


def apertus_logits(reader: gguf.GGUFReader, ids: list[int]) -> np.ndarray:
    """llama.cpp's apertus forward (src/models/apertus.cpp) over ids from position 0, in fp64, from the file alone:
    RMSNorm x / sqrt(mean(x^2) + eps) * w; q and k RMSNormed per head, then NeoX rotary (halves, angle p * base^(-2i /
    n_rot)); causal attention at 1 / sqrt(D); ggml's xIELU MLP (ggml_xielu: a_p = softplus(alpha_p), a_n = beta +
    softplus(alpha_n)); the output norm and head, nothing after it."""
    f, W = fields(reader), tensors_of(reader)
    a = f["general.architecture"]
    L, H, eps = f[f"{a}.block_count"], f[f"{a}.attention.head_count"], f[f"{a}.attention.layer_norm_rms_epsilon"]
    D, base = f[f"{a}.rope.dimension_count"], f[f"{a}.rope.freq_base"]
    assert f[f"{a}.attention.head_count_kv"] == H and D * H == f[f"{a}.embedding_length"]

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w

    def softplus(v: float) -> float:
        return float(np.log1p(np.exp(v)))

    n = len(ids)
    angle = np.arange(n)[:, None] * base ** (-np.arange(0, D, 2) / D)  # (n, D/2)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]

    def rope(z: np.ndarray) -> np.ndarray:  # (n, H, D), NeoX: the pairs are (i, i + D/2)
        z1, z2 = z[..., : D // 2], z[..., D // 2 :]
        return np.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin], axis=-1)

    x = W["token_embd.weight"][ids]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(L):
        b = f"blk.{i}."
        h = norm(x, W[b + "attn_norm.weight"])
        q, k, v = ((h @ W[b + f"attn_{z}.weight"].T).reshape(n, H, D) for z in "qkv")
        q, k = rope(norm(q, W[b + "attn_q_norm.weight"])), rope(norm(k, W[b + "attn_k_norm.weight"]))
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D) + mask
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", p, v).reshape(n, H * D) @ W[b + "attn_output.weight"].T
        u = norm(x, W[b + "ffn_norm.weight"]) @ W[b + "ffn_up.weight"].T
        beta, xeps = f["xielu.beta"][i], f["xielu.eps"][i]
        a_p, a_n = softplus(f["xielu.alpha_p"][i]), beta + softplus(f["xielu.alpha_n"][i])
        act = np.where(u > 0, a_p * u * u + beta * u, a_n * (np.expm1(np.minimum(u, xeps)) - u) + beta * u)
        x = x + act @ W[b + "ffn_down.weight"].T
    return norm(x, W["output_norm.weight"]) @ W["output.weight"].T


@pytest.mark.parametrize("dtype", ["fp32", "q8_0"])
def test_modern_block_writes_apertus_keys_and_tensors(modern_run: Path, tmp_path: Path, dtype: str) -> None:
    path = export(modern_run, tmp_path / "modern.gguf", dtype)
    reader = gguf.GGUFReader(path)
    got = fields(reader)
    check_vocab(got, modern_run)
    xielu = {k: got.pop(k) for k in ("xielu.alpha_p", "xielu.alpha_n", "xielu.beta", "xielu.eps")}
    want = {
        "general.architecture": "apertus",
        "general.name": "tiny-test",
        "general.file_type": {"fp32": 0, "q8_0": 7}[dtype],
        "apertus.context_length": 64,
        "apertus.embedding_length": 64,
        "apertus.feed_forward_length": 256,
        "apertus.block_count": 2,
        "apertus.attention.head_count": 2,
        "apertus.attention.head_count_kv": 2,
        "apertus.attention.layer_norm_rms_epsilon": pytest.approx(1e-6, rel=1e-6),
        "apertus.rope.dimension_count": 32,
        "apertus.rope.freq_base": 10000.0,
        **TOKENIZER_KEYS,
    }
    want |= {"general.quantization_version": 2} if dtype == "q8_0" else {}
    assert got == want
    # xIELU as ReLU^2, as ggml computes its parameters in fp32: softplus(alpha_p) = 1, beta + softplus(alpha_n) = 0
    f32 = np.float32
    assert all(len(v) == 2 and len(set(v)) == 1 for v in xielu.values())
    alpha_p, alpha_n = f32(xielu["xielu.alpha_p"][0]), f32(xielu["xielu.alpha_n"][0])
    assert np.log(f32(1) + np.exp(alpha_p)) == f32(1) and np.log(f32(1) + np.exp(alpha_n)) == f32(0)
    assert xielu["xielu.beta"] == [0.0, 0.0]

    want_t = modern_expected(modern_run)
    names = [t.name for t in reader.tensors]
    assert sorted(names) == sorted(want_t) and len(names) == 3 + 10 * 2
    for t in reader.tensors:
        w = want_t[t.name]
        assert list(t.shape) == list(w.shape[::-1]), t.name
        kind = gguf.GGMLQuantizationType
        if t.name == "token_embd.weight" and dtype == "fp32":  # fp32 rows of microgpt's rmsnorm op: within an ulp
            assert t.tensor_type == kind.F32
            np.testing.assert_allclose(t.data.reshape(w.shape), w, rtol=1e-6, atol=0)
        elif w.ndim == 1 or dtype == "fp32":
            assert t.tensor_type == kind.F32 and np.array_equal(t.data.reshape(w.shape), w), t.name
        elif t.name != "token_embd.weight":  # gguf-py's Q8_0 is bit for bit ggml's reference quantizer
            assert t.tensor_type == kind.Q8_0, t.name
            assert t.data.tobytes() == gguf.quants.quantize(w, kind.Q8_0).tobytes(), t.name
        else:  # rows an ulp from the fp64 ones here: within half a step d plus the fp16 scale's rounding (127 d 2^-11)
            back = gguf.quants.dequantize(t.data, kind.Q8_0).reshape(-1, 32)
            d = np.abs(w).reshape(-1, 32).max(axis=1, keepdims=True) / 127
            assert t.tensor_type == kind.Q8_0 and (np.abs(back - w.reshape(-1, 32)) <= 0.57 * d).all()


@pytest.mark.parametrize("dtype", ["fp32", "q8_0"])
def test_apertus_graph_on_the_file_computes_microgpt_logits(modern_run: Path, tmp_path: Path, dtype: str) -> None:
    """llama.cpp's apertus graph, in NumPy from the file alone, gives microgpt's logits: within 1e-4 from the fp32
    file; from q8_0 the same greedy token at most positions (its weights are rounded)."""
    reader = gguf.GGUFReader(export(modern_run, tmp_path / "modern.gguf", dtype))
    tok = load_tokenizer(load_trained(modern_run).side["tokenizer"])
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        gen = sample.load(str(modern_run))[0]
        ours = np.stack([gen.feed([t]) for t in ids])
        theirs = apertus_logits(reader, ids)
        if dtype == "fp32":
            np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
        else:
            assert np.abs(theirs - ours).max() < 0.1 * np.abs(ours).max()


# --- the real llama.cpp (llama-cpp-python), where it is installed: `make check-gguf` ------------------------------
def llama_cpp_module():
    if os.environ.get("MICROGPT_LLAMA_CPP") == "require":  # make check-gguf: a missing llama_cpp fails, never skips
        import llama_cpp

        return llama_cpp
    return pytest.importorskip("llama_cpp")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "q8_0"])
@pytest.mark.parametrize("block", ["gpt2", "modern"])
def test_llama_cpp_greedy_tokens_equal_microgpt_sample(
    block: str, dtype: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """GPT-2's file as llama.cpp's gpt2, the modern block's (model.softcap 0) as its apertus. The fp32 file runs with
    an fp32 KV cache (type 0), so its logits are microgpt's to fp32 rounding (1e-4); llama.cpp's default f16 cache
    moves them by about 1e-3 (docs/GUIDE.md section 5)."""
    llama_cpp = llama_cpp_module()
    run = request.getfixturevalue("run" if block == "gpt2" else "modern_run")
    path = export(run, tmp_path / "model.gguf", dtype)
    ld = load_trained(run)
    tok = load_tokenizer(ld.side["tokenizer"])
    kv = {"type_k": 0, "type_v": 0} if dtype == "fp32" else {}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=2, logits_all=True, verbose=False, **kv)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids  # the same tokenizer
        n = 64 - len(ids)  # within the context: llama.cpp does not slide its window as sample does
        llm.reset()
        llm.eval(ids)
        if dtype == "fp32":  # the prompt's logits, position by position, against microgpt's decode step
            gen = sample.load(str(run))[0]
            logits = np.stack([gen.feed([t]) for t in ids])
            np.testing.assert_allclose(np.array(llm.scores[: len(ids)]), logits, atol=1e-4, rtol=0)
        theirs = []
        for _ in range(n):
            theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(theirs[-1:])
        ours = sample.generate(sample.load(str(run))[0], ids, n, sample.Sampling(), [0])[0]
        if dtype == "fp32":  # fp16 and q8_0 round the weights: their tokens may part from fp32's
            assert theirs == ours, (prompt, theirs, ours)
            res = cli("sample", str(run), "--prompt", prompt, "--temperature", "0", "--tokens", str(n), "--json")
            assert res.returncode == 0 and json.loads(res.stdout)["text"] == tok.decode(theirs)
        else:
            assert len(theirs) == n and all(0 <= t < 512 for t in theirs)


def test_llama_cpp_reads_a_byte_model(tmp_path: Path) -> None:
    """A byte-level model (no merges): llama.cpp's tokens are the text's bytes, its logits microgpt's."""
    llama_cpp = llama_cpp_module()
    run = train(tmp_path, 256, steps=2)
    llm = llama_cpp.Llama(
        model_path=str(export(run, tmp_path / "b.gguf", "fp32")), n_ctx=64, logits_all=True, verbose=False
    )
    text = "héllo\n\tx = 1"
    ids = list(text.encode())
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    llm.eval(ids)
    gen = sample.load(str(run))[0]
    logits = np.stack([gen.feed([t]) for t in ids])
    np.testing.assert_allclose(np.array(llm.scores[: len(ids)]), logits, atol=1e-3, rtol=0)
