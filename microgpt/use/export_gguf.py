"""`microgpt export --format gguf`: a checkpoint as one GGUF file, which llama.cpp (and the tools built on it: its
server, Ollama, LM Studio, llama-cpp-python) loads as its GPT-2 architecture (ANDREA's block) or its Apertus
architecture (the modern block, model.softcap 0).

GGUF version 3, little-endian (learned from llama.cpp's gguf-py and its GPT-2 and Apertus loaders; nothing of them is
imported):

    u32 magic "GGUF" | u32 version 3 | u64 tensor count | u64 key count
    keys      string key, u32 value type, value (a string: u64 length + UTF-8; an array: u32 item type, u64 count,
              the items)
    tensors   string name, u32 n_dims, u64 dims (the fastest-varying first), u32 ggml type, u64 offset into the data
    padding to ALIGN bytes, then each tensor's data, each padded to ALIGN bytes

GPT-2: the transformers export's GPT-2 state (export.hf_state_dict, the one map of microgpt's names) under llama.cpp's
names. GPT-2's Conv1D weights (in, out) are written transposed, (out, in), which ggml reads as ne = [in, out]; the
linears' biases are zeros, as in the transformers export; there is no output.weight (llama.cpp's GPT-2 then uses
token_embd as the head: the tied head).

The modern block as llama.cpp's "apertus" (src/models/apertus.cpp of the llama.cpp that llama-cpp-python 0.3.36
builds): pre-norm RMSNorm layers (attn_norm, ffn_norm, output_norm) with weights, written as ones; q and k RMSNormed
per head (attn_q_norm, attn_k_norm: ones) and then rotated in NeoX's "rotate half" pairing, microgpt's own; attention
scaled 1/sqrt(D); an MLP of two linears around xIELU; an untied output.weight; one eps key for every norm (1e-6, the
modern block's). What it has not, the export makes exact another way:
- microgpt normalizes the embedding (x = rmsnorm(wte[tokens])); apertus does not, and a row's norm depends on its
  token alone, so token_embd holds rmsnorm(wte) row by row (microgpt's own rmsnorm op, so the same fp32 rows).
- ReLU^2: xIELU is x > 0: a_p x^2 + b x; else a_n (expm1(min(x, eps)) - x) + b x, with ggml taking a_p =
  softplus(xielu.alpha_p) and a_n = b + softplus(xielu.alpha_n). alpha_p = ln(e - 1) in fp32 (softplus of it is 1.0
  in fp32), alpha_n = -1e4 (softplus 0.0), b = 0: max(x, 0)^2.
What no llama.cpp architecture with QK-norm and ReLU^2 has is a final logit soft-cap, nor value embeddings: those
models are refused (unsupported()). docs/GUIDE.md section 5 has the survey.

Types: 1-D tensors and position_embd stay fp32 (as llama.cpp's converter keeps them); token_embd, the linears and
output take --dtype: fp32, fp16, or q8_0 (ggml's Q8_0: blocks of 32 values along a row, each an fp16 scale d =
max|x| / 127 and 32 int8 round(x / d), rounded half away from zero); a row whose length is not a multiple of 32 is
written fp16 under q8_0.

Tokenizer: the run's byte-level BPE as tokenizer.ggml.model "gpt2" with the pre-tokenizer "gpt-2" (the regex that
tokenizers' ByteLevel applies); one token per id below model.vocab_size (ids past the tokenizer's are "[PAD<id>]",
unused), the special tokens as control tokens, the merges as "left right" strings; <|endoftext|> is BOS and EOS,
<|im_end|> ends a turn, no BOS is added to a prompt (sample adds none either), and the ChatML chat template is the
transformers export's. A byte-level model (vocab 256) gets the 256 byte tokens and no merges, NUL as BOS and EOS.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import config
from microgpt.data.tokenizer import EOT, IM_END, PAD
from microgpt.engine.trained import Trained
from microgpt.ops import rmsnorm

MAGIC = b"GGUF"
VERSION = 3
ALIGN = 32  # general.alignment's default: not written
LAYER_NORM_EPS = 1e-5  # GPT-2's LayerNorm
# xIELU's keys that make it ReLU^2 (the module docstring): ggml reads softplus(alpha_p) = 1, b + softplus(alpha_n) = 0
XIELU = {"xielu.alpha_p": float(np.float32(np.log(np.e - 1))), "xielu.alpha_n": -1e4, "xielu.beta": 0.0,
         "xielu.eps": -1e-6}  # fmt: skip

# GGUF value types and ggml tensor types (the ids of the format)
U32, I32, F32V, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8
QK8_0 = 32  # values a Q8_0 block holds
# --dtype -> (the ggml type of the 2-D weights, general.file_type: llama.cpp's ALL_F32, MOSTLY_F16, MOSTLY_Q8_0)
DTYPES = {"fp32": (GGML_F32, 0), "fp16": (GGML_F16, 1), "q8_0": (GGML_Q8_0, 7)}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5

# the transformers export's GPT-2 names -> llama.cpp's (per block: the part after "transformer.h.{i}.")
GGUF_TOP = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
            "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias"}  # fmt: skip
GGUF_BLOCK = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
              "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}  # fmt: skip
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gguf_name(hf: str) -> str:
    if hf in GGUF_TOP:
        return GGUF_TOP[hf]
    _, _, i, rest = hf.split(".", 3)  # transformer.h.{i}.<part>.weight|bias
    part, _, leaf = rest.rpartition(".")
    return f"blk.{i}.{GGUF_BLOCK[part]}.{leaf}"


def arch(m: config.ModelConfig) -> str:
    """llama.cpp's architecture for the model's block."""
    return "apertus" if m.block == "modern" else "gpt2"


def unsupported(m: config.ModelConfig) -> str | None:
    """Why no llama.cpp architecture computes this model (one clause), or None."""
    if m.block != "modern":
        return None
    if m.value_embeds:
        return (
            f"has model.value_embeds {m.value_embeds}: no llama.cpp architecture adds per-token value embeddings to "
            "a layer's values"
        )
    if m.skips:
        return (
            f"has model.skips {m.skips}: no llama.cpp architecture adds an earlier layer's residual stream to a later "
            "layer's input"
        )
    if m.softcap:
        return (
            f"has model.softcap {m.softcap:g}: no llama.cpp architecture has a final logit soft-cap together with "
            "QK-norm and ReLU^2 (apertus carries all but the cap); train with model.softcap 0 for GGUF, or write "
            "--format hf (transformers' NanoChat)"
        )
    return None


def modern_tensors(P: dict[str, np.ndarray], m: config.ModelConfig) -> dict[str, np.ndarray]:
    """The modern block's named weights (params.views) as llama.cpp's apertus tensors, numpy layout (the last axis is
    ggml's ne0): matrices (out, in), token_embd the normalized embedding, every norm weight ones."""
    wte = np.ascontiguousarray(P["wte"], dtype=np.float32)
    emb = np.empty_like(wte)
    rmsnorm.rmsnorm_forward(emb, np.empty(len(wte), np.float32), wte)
    ones = np.ones(m.d_model, np.float32)
    out = {"token_embd.weight": emb, "output_norm.weight": ones, "output.weight": P["lm_head"]}
    for i in range(m.n_layer):
        h, b = f"h{i}.", f"blk.{i}."
        out |= {
            b + "attn_norm.weight": ones,
            b + "attn_q.weight": P[h + "w_q"].T,
            b + "attn_k.weight": P[h + "w_k"].T,
            b + "attn_v.weight": P[h + "w_v"].T,
            b + "attn_q_norm.weight": np.ones(m.head_dim, np.float32),
            b + "attn_k_norm.weight": np.ones(m.head_dim, np.float32),
            b + "attn_output.weight": P[h + "w_o"].T,
            b + "ffn_norm.weight": ones,
            b + "ffn_up.weight": P[h + "w_1"].T,
            b + "ffn_down.weight": P[h + "w_2"].T,
        }
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def gguf_tensors(hf_state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT-2's named weights (export.hf_state_dict) as llama.cpp's, each in the numpy layout whose last axis is
    ggml's ne0: Conv1D weights transposed to (out, in)."""
    out = {}
    for name, w in hf_state.items():
        out[gguf_name(name)] = np.ascontiguousarray(w.T if name.endswith(CONV1D) else w, dtype=np.float32)
    return out


def q8_0(a: np.ndarray) -> bytes:
    """ggml's Q8_0 of a (..., K) fp32 array, K a multiple of 32: per block of 32 along the last axis, the fp16 scale
    d = max|x| / 127, then 32 int8 round(x / d), half away from zero (q is computed with the fp32 d, as ggml does)."""
    blocks = a.reshape(-1, QK8_0).astype(np.float32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, 0, 1 / d)
    x = blocks * inv
    q = np.sign(x) * np.floor(np.abs(x) + 0.5)
    packed = np.empty(len(blocks), dtype=[("d", "<f2"), ("q", "i1", (QK8_0,))])
    packed["d"], packed["q"] = d[:, 0].astype(np.float16), q.astype(np.int8)
    return packed.tobytes()


def encode(name: str, a: np.ndarray, dtype: str) -> tuple[int, bytes]:
    """(ggml type, data) of one tensor: 1-D tensors and position_embd in fp32, the rest in dtype (q8_0 needs rows
    of a multiple of 32 values, else fp16)."""
    kind = DTYPES[dtype][0] if a.ndim == 2 and name != "position_embd.weight" else GGML_F32
    if kind == GGML_Q8_0 and a.shape[-1] % QK8_0:
        kind = GGML_F16
    if kind == GGML_Q8_0:
        return kind, q8_0(a)
    return kind, np.ascontiguousarray(a, dtype="<f2" if kind == GGML_F16 else "<f4").tobytes()


# --- the tokenizer ------------------------------------------------------------------------------------------
def byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE's alphabet), in GPT-2's order: the printable
    bytes as themselves, then the others, in order, as chr(256), chr(257), ..."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(rest)}}


def vocab_keys(info: dict[str, Any], m: config.ModelConfig) -> list[tuple[str, int, Any]]:
    """The tokenizer.* keys as (key, type, value) for a run's tokenizer record (data.tokenizer_info)."""
    if info.get("kind", "bytes") == "bytes":
        pieces = byte_unicode()
        tokens, special, merges = {b: pieces[b] for b in range(256)}, {}, []
        bos = eos = 0  # the byte model separates documents with NUL
    else:
        raw = json.loads(Path(info["path"]).read_text(encoding="utf-8"))
        tokens = {i: t for t, i in raw["model"]["vocab"].items()}
        special = {a["content"]: a["id"] for a in raw.get("added_tokens", []) if a.get("special")}
        tokens |= {i: t for t, i in special.items()}
        merges = [" ".join(p) if isinstance(p, list) else p for p in raw["model"]["merges"]]
        bos = eos = special[EOT]
    types = [
        TOKEN_CONTROL if i in special.values() else TOKEN_NORMAL if i in tokens else TOKEN_UNUSED
        for i in range(m.vocab_size)
    ]
    keys = [
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, "gpt-2"),
        ("tokenizer.ggml.tokens", (ARRAY, STRING), [tokens.get(i, f"[PAD{i}]") for i in range(m.vocab_size)]),
        ("tokenizer.ggml.token_type", (ARRAY, I32), types),
        ("tokenizer.ggml.merges", (ARRAY, STRING), merges),
        ("tokenizer.ggml.bos_token_id", U32, bos),
        ("tokenizer.ggml.eos_token_id", U32, eos),
    ]
    if IM_END in special:
        keys.append(("tokenizer.ggml.eot_token_id", U32, special[IM_END]))
    if PAD in special:
        keys.append(("tokenizer.ggml.padding_token_id", U32, special[PAD]))
    return keys + [("tokenizer.ggml.add_bos_token", BOOL, False), ("tokenizer.ggml.add_eos_token", BOOL, False)]


def metadata(ld: Trained, dtype: str, chat_template: str) -> list[tuple[str, Any, Any]]:
    """Every key of the file, in order: general.*, <arch>.* (the shapes llama.cpp's GPT-2 or Apertus reads; apertus
    also xielu.*), tokenizer.*."""
    m, a = ld.exp.model, arch(ld.exp.model)
    keys = [
        ("general.architecture", STRING, a),
        ("general.name", STRING, ld.exp.name),
        ("general.file_type", U32, DTYPES[dtype][1]),
    ]
    if dtype == "q8_0":
        keys.append(("general.quantization_version", U32, 2))
    keys += [
        (f"{a}.context_length", U32, m.seq_len),
        (f"{a}.embedding_length", U32, m.d_model),
        (f"{a}.feed_forward_length", U32, 4 * m.d_model),
        (f"{a}.block_count", U32, m.n_layer),
        (f"{a}.attention.head_count", U32, m.n_head),
    ]
    if a == "gpt2":
        keys.append((f"{a}.attention.layer_norm_epsilon", F32V, LAYER_NORM_EPS))
    else:
        keys += [
            (f"{a}.attention.head_count_kv", U32, m.n_head),
            (f"{a}.attention.layer_norm_rms_epsilon", F32V, rmsnorm.EPS),
            (f"{a}.rope.dimension_count", U32, m.head_dim),
            (f"{a}.rope.freq_base", F32V, m.rope_base),
            *((k, (ARRAY, F32V), [v] * m.n_layer) for k, v in XIELU.items()),
        ]
    keys += vocab_keys(ld.side.get("tokenizer", {}), m)
    tokenizer_kind = ld.side.get("tokenizer", {}).get("kind", "bytes")
    return keys + ([("tokenizer.chat_template", STRING, chat_template)] if tokenizer_kind == "bpe" else [])


# --- the file -----------------------------------------------------------------------------------------------
def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return _string(value)
    return struct.pack({U32: "<I", I32: "<i", F32V: "<f", BOOL: "<?"}[vtype], value)


def _key(key: str, vtype: Any, value: Any) -> bytes:
    if isinstance(vtype, tuple):  # (ARRAY, item type)
        items = b"".join(_value(vtype[1], v) for v in value)
        return _string(key) + struct.pack("<IIQ", ARRAY, vtype[1], len(value)) + items
    return _string(key) + struct.pack("<I", vtype) + _value(vtype, value)


def _pad(n: int) -> bytes:
    return b"\0" * (-n % ALIGN)


def gguf_chunks(keys: list[tuple[str, Any, Any]], tensors: dict[str, np.ndarray], dtype: str) -> list[bytes]:
    """The whole file as chunks: header, keys, tensor infos, padding, then the data of each tensor."""
    infos, data, offset = [], [], 0
    for name, a in tensors.items():
        kind, raw = encode(name, a, dtype)
        dims = a.shape[::-1]  # ggml's ne: the fastest-varying first
        infos.append(_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset))
        data += [raw, _pad(len(raw))]
        offset += len(raw) + len(_pad(len(raw)))
    head = [MAGIC, struct.pack("<IQQ", VERSION, len(tensors), len(keys)), *(_key(*k) for k in keys), *infos]
    return [*head, _pad(sum(len(c) for c in head)), *data]
