"""`microgpt eval`: loss, perplexity and bits per byte of a checkpoint on shards or a text file; HellaSwag accuracy.

The model runs through the inference step (model.gpt_infer on an inference plan of B = the checkpoint's micro_batch
sequences without a KV cache) on the backend `--backend` names: auto (the default) is triton where a CUDA GPU is
there, numpy elsewhere. triton computes in bf16 unless `--precision` says fp32; numpy in fp32
(backend.INFER_PRECISIONS); fp16 and fp8 score only a checkpoint trained in them (fp8 with the run's amax histories
from the sidecar). The inference step's losses for a window from position 0 are the training forward's on the same
backend and precision, so a shard split scores exactly as the trainer's validation loss does: windows of seq_len + 1
tokens at stride seq_len from token 0, batch i = windows i*B .. i*B + B - 1 (wrapping, as Loader.val_batch), loss =
sum of token losses / count of scored targets (masked targets, y = -1, are not scored).

A text file is tokenized with the checkpoint's tokenizer after one <|endoftext|> (byte 0 for the byte tokenizer),
so every token of the text is predicted; its windows are cut the same way, the last one may be short.
Bits per byte = sum of token losses / ln 2 / bytes of the scored tokens (a special token counts its string's
bytes): for a text file, its size in bytes.

Beside the loss, the unigram loss of the same scored tokens: the entropy of their own frequencies, -sum p ln p, which
is the loss of the best model that ignores context, fitted to these very tokens (so no unigram model of any data
scores them lower). A loss under it is what the model gets from context; a loss above it (text far from the training
data, say) is worse than counting tokens.

HellaSwag: microgpt/use/hellaswag.py (the same scorer the trainer runs for train.hellaswag).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import config
from microgpt.data import hellaswag_file
from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine import backend
from microgpt.engine.backend import Backend
from microgpt.engine.infer import InferState, trained_infer_state
from microgpt.engine.trained import Trained, load_trained
from microgpt.errors import ArgParser, InputError, check_number
from microgpt.fileio import read_input_text
from microgpt.use import hellaswag


class EvalError(InputError):
    """Bad eval input (a text or HellaSwag file, a flag). str(err) is one line naming it."""


def eval_backend(ld: Trained, name: str, precision: str | None) -> Backend:
    """The backend and precision the flags name for this checkpoint (backend.for_trained); EvalError if not."""
    return backend.for_trained(name, precision, ld.precision, str(ld.path), EvalError)


def scorer(ld: Trained, K: Backend) -> InferState:
    """The checkpoint's model on an inference plan of its micro_batch windows of seq_len from position 0 (no KV
    cache), with what its precision keeps from the run (fp8: the amax histories the run scaled by)."""
    return trained_infer_state(ld, K, ld.exp.train.micro_batch, cache=False)


def token_bytes(tok: Any, V: int) -> np.ndarray:
    """(V,) bytes each id stands for: 1 for the byte tokenizer; a byte-level BPE token's characters are bytes."""
    out = np.zeros(V, np.int64)
    if not hasattr(tok, "tok"):
        out[:256] = 1
        return out
    for piece, i in tok.tok.get_vocab(with_added_tokens=True).items():
        if i < V:
            out[i] = len(piece)
    for i, added in tok.tok.get_added_tokens_decoder().items():
        if i < V:
            out[i] = len(added.content.encode("utf-8"))
    return out


@dataclass
class Windows:
    """n windows of T tokens, made batch by batch: get(lo, hi) is windows lo..hi-1 as (x, y), each (hi - lo, T)
    int32. A split of any size, and a --windows past its end (which wraps, as Loader.val_batch), then cost one
    batch of memory at a time, never n windows at once."""

    n: int
    get: Callable[[int, int], tuple[np.ndarray, np.ndarray]]


def unigram_loss(counts: np.ndarray) -> float | None:
    """-sum p ln p of token counts (nats per token): the loss of the unigram model fitted to those very tokens."""
    n = int(counts.sum())
    if n == 0:
        return None
    p = counts[counts > 0] / n
    return float(-(p * np.log(p)).sum())


def score_windows(S: InferState, windows: Windows, nbytes: np.ndarray) -> dict[str, Any]:
    total, count, byte_count = 0.0, 0, 0
    counts = np.zeros(len(nbytes), np.int64)
    for i in range(0, windows.n, S.B):
        x, y = windows.get(i, min(windows.n, i + S.B))
        s, c, _ = S.score(x, y)
        total, count = total + s, count + c
        scored = y[y >= 0]
        byte_count += int(nbytes[scored].sum())
        counts += np.bincount(scored, minlength=len(counts))
    loss = total / max(1, count)
    bpb = total / math.log(2) / byte_count if byte_count else None
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": bpb,
        "unigram_loss": unigram_loss(counts),
        "tokens": count,
        "bytes": byte_count,
        "windows": windows.n,
    }


def shard_windows(ld: Trained, folder: Path, split: str, n: int | None, B: int) -> Windows:
    """The validation loader's windows 0 .. n-1 (all of them by default; past the end they wrap, as val_batch)."""
    from microgpt.data.loader import Loader, open_split

    if not folder.is_dir():
        raise EvalError(f"--data {folder}: not a folder")
    parts, masks = open_split(folder, split, ld.exp)
    ld_ = Loader(parts, B, ld.exp.model.seq_len, ld.exp.train.seed, masks=masks, where=f"{folder} {split}")
    return Windows(
        ld_.n_windows if n is None else n,
        lambda lo, hi: ld_._windows(np.arange(lo, hi, dtype=np.int64) % ld_.n_windows),
    )


def text_windows(ids: list[int], T: int, n: int | None) -> Windows:
    xs, ys = [], []
    for start in range(0, max(1, len(ids) - 1), T):
        w = ids[start : start + T + 1]
        x, y = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        x[: len(w) - 1], y[: len(w) - 1] = w[:-1], w[1:]
        xs.append(x)
        ys.append(y)
    return Windows(len(xs) if n is None else min(n, len(xs)), lambda lo, hi: (np.stack(xs[lo:hi]), np.stack(ys[lo:hi])))


def parser() -> ArgParser:
    p = ArgParser(prog="microgpt eval", description="Loss, perplexity, bits per byte, or HellaSwag accuracy.")
    p.add_argument("checkpoint", help="a step-*.bin checkpoint, or a run folder (its newest valid checkpoint)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", help="a folder of token shards (train_*.bin / val_*.bin)")
    what.add_argument("--text", help="a UTF-8 text file")
    what.add_argument("--hellaswag", help="a HellaSwag JSONL file (ctx, endings, label)")
    p.add_argument("--split", default="val", choices=("train", "val"), help="with --data: which split")
    p.add_argument("--windows", type=int, help="score only the first N windows (HellaSwag: examples)")
    backend.add_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | argparse.Namespace) -> int:
    args = argv if isinstance(argv, argparse.Namespace) else parser().parse_args(argv)
    if args.windows is not None:
        check_number(args.windows, "--windows", 1, config.INT_MAX, integer=True, error=EvalError)
    ld = load_trained(args.checkpoint)
    K = eval_backend(ld, args.backend, args.precision)
    if args.hellaswag:
        tok = load_tokenizer(ld.side.get("tokenizer", {}))
        examples = hellaswag_file.read(Path(args.hellaswag), "--hellaswag")[: args.windows]
        res = hellaswag.score(scorer(ld, K), hellaswag_file.tokenize(examples, tok, ld.exp.model.seq_len))
        text = f"hellaswag: {res['examples']} examples | acc {res['acc']:.4f} | acc_norm {res['acc_norm']:.4f}"
        text += f" | {res['unscored']} with nothing to score (counted wrong)" if res["unscored"] else ""
        text += f" | {res['truncated']} with the context cut to fit seq_len" if res["truncated"] else ""
    else:
        res = score_windows(scorer(ld, K), *_windows(ld, args))
        bpb, unigram = res["bits_per_byte"] or float("nan"), res["unigram_loss"]
        text = (
            f"loss {res['loss']:.4f} | perplexity {res['perplexity']:.2f} | bits/byte {bpb:.4f} "
            f"| {res['tokens']} tokens in {res['windows']} windows"
        )
        if unigram is not None:
            text += f" | unigram {unigram:.4f} (the loss of these tokens' own frequencies)"
    res = {"step": ld.step, **res, "backend": K.name, "precision": K.precision.name}
    print(json.dumps(res) if args.json else f"{text} | {K.name} {K.precision.name}")
    return 0


def _windows(ld: Trained, args: argparse.Namespace) -> tuple[Windows, np.ndarray]:
    """The windows `--data` or `--text` names, and the bytes each token id stands for."""
    m, B = ld.exp.model, ld.exp.train.micro_batch
    if args.data:
        windows = shard_windows(ld, Path(args.data), args.split, args.windows, B)
        info = ld.side.get("tokenizer", {})
        tok = None if info.get("kind") == "unknown" else load_tokenizer(info)  # llm.c shards: no byte counts
    else:
        tok = load_tokenizer(ld.side.get("tokenizer", {}))
        try:
            body = read_input_text(args.text, "text file", EvalError)  # a regular file, size-bound
        except FileNotFoundError:
            raise EvalError(f"--text {args.text}: cannot read (No such file or directory)") from None
        except EvalError as e:
            raise EvalError(f"--text {e}") from None
        if not body:
            raise EvalError(f"--text {args.text}: empty file")
        windows = text_windows([tok.eot_id, *tok.encode(body)], m.seq_len, args.windows)
    return windows, token_bytes(tok, m.vocab_size) if tok is not None else np.zeros(m.vocab_size, np.int64)
