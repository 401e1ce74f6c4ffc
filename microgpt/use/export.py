"""`microgpt export`: a checkpoint as a Hugging Face `transformers` folder (GPT-2 for ANDREA's block, NanoChat for the
modern block), or (`--format gguf`) as one GGUF file for llama.cpp (microgpt/use/export_gguf.py: ANDREA's block from
the same GPT-2 state as written here, the modern block without a soft-cap as llama.cpp's apertus).

ANDREA is GPT-2's architecture (learned positions, pre-LN with bias, tanh GELU = "gelu_new", tied head) with no
linear biases, and microgpt stores weights [in, out] as GPT-2's Conv1D does, so the mapping is one-to-one:

    wte, wpe                    -> transformer.wte.weight (V,C), transformer.wpe.weight (T,C)
    h{i}.ln1_w/b, ln2_w/b       -> transformer.h.{i}.ln_1.weight/bias, ln_2.weight/bias
    h{i}.w_q | w_k | w_v        -> transformer.h.{i}.attn.c_attn.weight (C,3C): concatenated along the output dim
    h{i}.w_o, w_1, w_2          -> attn.c_proj.weight (C,C), mlp.c_fc.weight (C,4C), mlp.c_proj.weight (4C,C)
    lnf_w/b                     -> transformer.ln_f.weight/bias
    (none)                      -> every linear bias: zeros; lm_head is tied to wte and not stored

The modern block (model.block "modern") is transformers' NanoChatForCausalLM, which computes the same function:
RMSNorm without weights (eps 1e-6) after the embedding, before each branch and at the end, QK-norm per head, rotary
positions, ReLU^2 between two bias-free linears, an untied head and the logit soft-cap. nn.Linear stores [out, in],
so every matrix goes transposed; and NanoChat rotates the other way (its rotate_half is (x2, -x1)), which is
microgpt's rotation conjugated by negating each head's second half: q and k's projections go with the rows of those
halves negated, which leaves every attention score (and the per-head norm) as it is.

    wte                         -> model.embed_tokens.weight (V,C)
    h{i}.w_q, w_k (halves -)    -> model.layers.{i}.self_attn.q_proj.weight, k_proj.weight (C,C), transposed
    h{i}.w_v, w_o               -> self_attn.v_proj.weight, o_proj.weight, transposed
    h{i}.w_1, w_2               -> mlp.fc1.weight (4C,C), mlp.fc2.weight (C,4C), transposed
    lm_head                     -> lm_head.weight (V,C)

The folder: config.json, model.safetensors (fp32 or bf16), tokenizer.json + tokenizer_config.json (special tokens,
a ChatML chat_template rendering exactly what microgpt/data/chatml.py render gives), generation_config.json and a
README.md model card. A byte-level model (vocab 256) gets a byte-level tokenizer.json whose ids are the bytes.
Nothing here imports torch or transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import config
from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine import params
from microgpt.engine.trained import Trained, load_trained
from microgpt.errors import ArgParser, InputError, output_error
from microgpt.fileio import atomic_write_bytes, atomic_write_json, check_parents
from microgpt.use import export_gguf

# ChatML as microgpt/data/chatml.py render writes it; add_generation_prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ExportError(InputError):
    """An export that cannot be written (the --out folder, the checkpoint). str(err) is one line."""


# microgpt's name -> GPT-2's (transformers' GPT2LMHeadModel), per block leaf or GEMM site; a linear's bias is zeros
HF_TOP = {"wte": "transformer.wte.weight", "wpe": "transformer.wpe.weight", "lnf_w": "transformer.ln_f.weight",
          "lnf_b": "transformer.ln_f.bias"}  # fmt: skip
HF_NORMS = {"ln1_w": "ln_1.weight", "ln1_b": "ln_1.bias", "ln2_w": "ln_2.weight", "ln2_b": "ln_2.bias"}
HF_SITES = {"w_qkv": "attn.c_attn", "w_o": "attn.c_proj", "w_1": "mlp.c_fc", "w_2": "mlp.c_proj"}


def hf_state_dict(P: dict[str, np.ndarray], m: config.ModelConfig) -> dict[str, np.ndarray]:
    """microgpt's named weights (params.views) -> GPT2LMHeadModel's (lm_head tied, so not stored). A GEMM site of G
    weights (G, C, OC) is GPT-2's one Conv1D weight (C, G*OC): the G side by side along the output dimension."""
    out = {hf: P[name] for name, hf in HF_TOP.items()}
    for i in range(m.n_layer):
        h, o = f"h{i}.", f"transformer.h.{i}."
        out |= {o + hf: P[h + leaf] for leaf, hf in HF_NORMS.items()}
        for site, leaves in params.SITES.items():
            w = np.concatenate([P[h + leaf] for leaf in leaves], axis=1)
            out[o + HF_SITES[site] + ".weight"], out[o + HF_SITES[site] + ".bias"] = w, np.zeros(w.shape[1], np.float32)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


NANOCHAT_SITES = {"w_q": "self_attn.q_proj", "w_k": "self_attn.k_proj", "w_v": "self_attn.v_proj",
                  "w_o": "self_attn.o_proj", "w_1": "mlp.fc1", "w_2": "mlp.fc2"}  # fmt: skip


def nanochat_state_dict(P: dict[str, np.ndarray], m: config.ModelConfig) -> dict[str, np.ndarray]:
    """The modern block's named weights -> NanoChatForCausalLM's: each matrix transposed to [out, in], q's and k's
    rows of each head's second half negated (the module docstring says why)."""
    D = m.head_dim
    flip = np.ones(m.d_model, np.float32).reshape(m.n_head, D)
    flip[:, D // 2 :] = -1
    out = {"model.embed_tokens.weight": P["wte"], "lm_head.weight": P["lm_head"]}
    for i in range(m.n_layer):
        for leaf, hf in NANOCHAT_SITES.items():
            w = P[f"h{i}.{leaf}"].T
            out[f"model.layers.{i}.{hf}.weight"] = w * flip.reshape(-1, 1) if leaf in ("w_q", "w_k") else w
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def state_dict(P: dict[str, np.ndarray], m: config.ModelConfig) -> dict[str, np.ndarray]:
    """The transformers state of the model's family: GPT-2's, or NanoChat's for the modern block."""
    return nanochat_state_dict(P, m) if m.block == "modern" else hf_state_dict(P, m)


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """fp32 -> bfloat16 bit patterns (uint16), rounded to nearest even; numpy has no bfloat16 dtype."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def save_safetensors(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """Serialized in memory, then written by us: a full disk is then an OSError with its errno (exit 4), not the
    library's own error type."""
    meta = {"format": "pt"}
    if dtype == "fp32":
        from safetensors.numpy import save

        path.write_bytes(save(tensors, metadata=meta))
        return
    from safetensors import TensorSpec, serialize

    bits = {k: to_bf16_bits(v) for k, v in tensors.items()}
    specs = {
        k: TensorSpec(dtype="bfloat16", shape=b.shape, data_ptr=b.ctypes.data, data_len=b.nbytes)
        for k, b in bits.items()
    }
    path.write_bytes(serialize(specs, metadata=meta))


def byte_tokenizer_json() -> dict[str, Any]:
    """A tokenizers file for the byte tokenizer: GPT-2's byte-to-character map, no merges, id = byte value."""
    vocab = {c: b for b, c in export_gguf.byte_unicode().items()}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def narrowed_attention(m: config.ModelConfig) -> str | None:
    """Why neither export writes this model's attention (one clause), or None: both write models that attend over the
    whole sequence so far, across documents."""
    if m.attn_window:
        return f"has model.attn_window {m.attn_window}: the exported model would attend past its window"
    if m.doc_mask >= 0:
        return f"has model.doc_mask {m.doc_mask}: the exported model would attend across <|endoftext|>"
    return None


def tokenizer_files(info: dict[str, Any], m: config.ModelConfig) -> tuple[str, dict[str, Any], dict[str, int]]:
    """(tokenizer.json text, tokenizer_config.json, special token -> id)."""
    from microgpt.data.tokenizer import EOT, IM_END, IM_START, PAD

    kind = info.get("kind", "bytes")
    base = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": m.seq_len,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if kind == "bytes":
        if m.vocab_size < 256:
            raise ExportError(f"model.vocab_size {m.vocab_size}: a byte-level model needs 256 entries")
        return json.dumps(byte_tokenizer_json()), base, {}
    if kind != "bpe":
        raise ExportError(
            f"checkpoint tokenizer kind {kind!r}: no tokenizer.json recorded (set data.tokenizer), so "
            "there is nothing to export the tokenizer from"
        )
    tok = load_tokenizer(info)
    if tok.vocab_size > m.vocab_size:
        raise ExportError(
            f"{info['path']}: tokenizer has {tok.vocab_size} ids, more than model.vocab_size {m.vocab_size}"
        )
    special = tok.special_ids()
    cfg = {
        **base,
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": None,
        "pad_token": PAD if PAD in special else EOT,
        "additional_special_tokens": [IM_START, IM_END],
    }
    return Path(info["path"]).read_text(encoding="utf-8"), cfg, special


def hf_config(m: config.ModelConfig, special: dict[str, int], dtype: str) -> dict[str, Any]:
    from microgpt.data.tokenizer import EOT

    eot = special.get(EOT, 0)  # the byte model separates documents with byte 0
    torch_dtype = "bfloat16" if dtype == "bf16" else "float32"
    if m.block == "modern":
        return {
            "architectures": ["NanoChatForCausalLM"],
            "model_type": "nanochat",
            "vocab_size": m.vocab_size,
            "hidden_size": m.d_model,
            "intermediate_size": 4 * m.d_model,
            "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head,
            "num_key_value_heads": m.n_head,
            "head_dim": m.head_dim,
            "max_position_embeddings": m.seq_len,
            "hidden_act": "relu2",
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_base},
            "final_logit_softcapping": m.softcap or None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": eot,
            "eos_token_id": eot,
            "pad_token_id": eot,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.seq_len,
        "n_ctx": m.seq_len,
        "n_embd": m.d_model,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }


def generation_config(special: dict[str, int]) -> dict[str, Any]:
    from microgpt.data.tokenizer import EOT, IM_END, PAD

    eos = [special[s] for s in (IM_END, EOT) if s in special] or [0]
    return {"bos_token_id": special.get(EOT, 0), "eos_token_id": eos, "pad_token_id": special.get(PAD, eos[-1])}


def data_line(data: dict[str, Any]) -> str:
    """The card's data line: the source and the shard folder's name, never a path of the machine that trained it."""
    folder = Path(str(data.get("path") or "")).name
    mask = "; loss on assistant tokens only" if data.get("loss_mask") else ""
    return f"- data: {data.get('source', 'builtin')}{f' ({folder})' if folder else ''}{mask}"


def model_card(ld: Trained, dtype: str) -> str:
    m, side = ld.exp.model, ld.side
    data = side.get("data") or side["config"].get("data", {})
    val = side.get("val_loss")
    tok = side.get("tokenizer", {})
    lines = [
        f"# {ld.exp.name}",
        "",
        (
            "A small GPT (ANDREA's modern block: NanoChat's architecture) trained with microgpt and exported with "
            "`microgpt export`."
            if m.block == "modern"
            else "A small GPT (ANDREA architecture = GPT-2 with zero linear "
            "biases) trained with microgpt and exported with `microgpt export`."
        ),
        "",
        f"- model: d_model {m.d_model}, n_layer {m.n_layer}, n_head {m.n_head}, context {m.seq_len}, "
        f"vocab {m.vocab_size} ({params.n_params(m):,} parameters), weights {dtype}",
        f"- tokenizer: {tok.get('kind', 'bytes')}",
        data_line(data),
        f"- steps: {ld.step} (checkpoint {ld.path.name})",
        f"- validation loss: {val:.4f}" if isinstance(val, (int, float)) else "- validation loss: not recorded",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tok = AutoTokenizer.from_pretrained(DIR); model = AutoModelForCausalLM.from_pretrained(DIR)",
        "```",
        "",
    ]
    return "\n".join(lines)


FORMATS = {"hf": ("fp32", "bf16"), "gguf": ("fp32", "fp16", "q8_0")}  # --format -> its --dtype choices


def export(where: str | Path, out: str | Path | None, dtype: str = "fp32", fmt: str = "hf") -> Path:
    """Write the folder (hf) or the file (gguf); --out must not exist (a folder may be empty), and not be a symbolic
    link (live or dangling: the export is never written through one). Everything is written to a temp folder or
    file next to it and renamed into place, so a failed export leaves nothing behind; an output the disk refuses is a
    WriteError (exit 4), a path that cannot be written an ExportError (exit 2). out None: default_out. Returns out."""
    return export_trained(where, out, dtype, fmt)[0]


def default_out(ld: Trained, dtype: str, fmt: str) -> Path:
    """Where an export goes without --out: beside the run, in its folder's export/ (a run folder is git-ignored and
    travels whole), named by the run, the step and the dtype: runs/X/export/X-step300-fp32 (hf, a folder) or
    runs/X/export/X-step300-q8_0.gguf. The run folder is the one holding ckpt/, else the checkpoint's own folder."""
    run = ld.path.parent.parent if ld.path.parent.name == "ckpt" else ld.path.parent
    name = f"{Path(os.path.abspath(run)).name}-step{ld.step}-{dtype}"
    return run / "export" / (f"{name}.gguf" if fmt == "gguf" else name)


def export_trained(where: str | Path, out: str | Path | None, dtype: str, fmt: str) -> tuple[Path, Trained]:
    """export(), also returning the checkpoint it read (the command's line names it)."""
    if fmt not in FORMATS or dtype not in FORMATS[fmt]:
        raise ExportError(f"--dtype {dtype}: --format {fmt} takes {' or '.join(FORMATS.get(fmt, ()))}")
    ld = None
    if out is None:  # the checkpoint first, to name the output after it
        ld = load_trained(where)
        out = default_out(ld, dtype, fmt)
    out = Path(out)
    what = "folder" if fmt == "hf" else "file"
    if out.is_symlink():
        raise ExportError(f"--out {out}: is a symbolic link; give the {what} to write itself (nothing written)")
    check_parents(out, "--out", ExportError)
    try:
        taken = out.exists() and (fmt == "gguf" or not out.is_dir() or any(out.iterdir()))
    except OSError as e:
        raise output_error(e, f"--out {out}: cannot list the folder") from None
    if taken:
        raise ExportError(
            f"--out {out}: exists{' and is not empty' if fmt == 'hf' else ''}; choose a new {what} "
            "(nothing overwritten)"
        )
    ld = load_trained(where) if ld is None else ld
    m = ld.exp.model
    if why := narrowed_attention(m):
        raise ExportError(f"--format {fmt}: {ld.path} {why}; nothing written")
    if fmt == "gguf" and (why := export_gguf.unsupported(m)):
        raise ExportError(f"--format gguf: {ld.path} {why}; nothing written")
    if fmt == "hf" and m.value_embeds:
        raise ExportError(
            f"--format hf: {ld.path} has model.value_embeds {m.value_embeds}; transformers' NanoChat has no value "
            "embeddings, so no class of it computes this model (nothing written)"
        )
    if fmt == "hf" and m.skips:
        raise ExportError(
            f"--format hf: {ld.path} has model.skips {m.skips}; transformers' NanoChat has no skip connections between "
            "layers, so no class of it computes this model (nothing written)"
        )
    tok_json, tok_cfg, special = tokenizer_files(ld.side.get("tokenizer", {}), m)  # checked for gguf too
    if fmt == "gguf":
        keys = export_gguf.metadata(ld, dtype, CHAT_TEMPLATE)
        if m.block == "modern":
            tensors = export_gguf.modern_tensors(ld.params(), m)
        else:
            tensors = export_gguf.gguf_tensors(hf_state_dict(ld.params(), m))
        chunks = export_gguf.gguf_chunks(keys, tensors, dtype)
        try:
            atomic_write_bytes(out, chunks)
        except OSError as e:
            raise output_error(e, f"--out {out}: cannot write the export") from None
    else:
        write_folder(out, ld, dtype, tok_json, tok_cfg, special)
    return out, ld


def write_folder(
    out: Path, ld: Trained, dtype: str, tok_json: str, tok_cfg: dict[str, Any], special: dict[str, int]
) -> None:
    """The transformers folder (the module docstring) at out, absent or empty: written in a temp folder beside it,
    then renamed into place; on any failure the temp folder goes and out is as it was."""
    m = ld.exp.model
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        umask = os.umask(0)  # mkdtemp makes the folder 0700: give it the mode a plain mkdir would
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
    except OSError as e:
        raise output_error(e, f"--out {out}: cannot create a folder in {out.parent}") from None
    try:
        save_safetensors(state_dict(ld.params(), m), tmp / "model.safetensors", dtype)
        atomic_write_json(tmp / "config.json", hf_config(m, special, dtype))
        atomic_write_json(tmp / "generation_config.json", generation_config(special))
        atomic_write_json(tmp / "tokenizer_config.json", tok_cfg)
        (tmp / "tokenizer.json").write_text(tok_json, encoding="utf-8")
        (tmp / "README.md").write_text(model_card(ld, dtype), encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty (checked before)
        tmp.rename(out)
    except OSError as e:  # a full or read-only disk mid-export: the temp folder goes too
        shutil.rmtree(tmp, ignore_errors=True)
        raise output_error(e, f"--out {out}: cannot write the export") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def parser() -> ArgParser:
    what = "Write a Hugging Face transformers folder (GPT-2, or NanoChat for the modern block), or a GGUF file."
    p = ArgParser(prog="microgpt export", description=what)
    p.add_argument("checkpoint", help="a step-*.bin checkpoint, or a run folder (its newest valid checkpoint)")
    p.add_argument(
        "--out",
        help="hf: the folder to write (new, or empty); gguf: the file (new), say model.gguf. Default: in the run's "
        "folder, RUN/export/RUN-stepN-DTYPE (hf) or RUN/export/RUN-stepN-DTYPE.gguf",
    )
    p.add_argument(
        "--format",
        choices=tuple(FORMATS),
        default="hf",
        help="hf: transformers' GPT-2 or NanoChat (safetensors); gguf: llama.cpp's GPT-2, or its apertus for the "
        "modern block (model.softcap 0 only)",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16", "q8_0"),
        default="fp32",
        help="the weights' type: hf takes fp32 or bf16, gguf fp32, fp16 or q8_0",
    )
    return p


def main(argv: list[str] | argparse.Namespace) -> int:
    args = argv if isinstance(argv, argparse.Namespace) else parser().parse_args(argv)
    out, ld = export_trained(args.checkpoint, args.out, args.dtype, args.format)
    arch = "NanoChat" if ld.exp.model.block == "modern" else "GPT-2"
    what = (
        f"a transformers {arch} folder"
        if args.format == "hf"
        else f"a GGUF file (llama.cpp's {export_gguf.arch(ld.exp.model)})"
    )
    print(f"exported {ld.path} (step {ld.step}) to {out}: {what}, {args.dtype} weights")
    return 0
