"""`microgpt eval`: loss, perplexity and bits per byte of a checkpoint on shards or a text file; HellaSwag accuracy.

The model runs on the NumPy backend through the inference step (model.gpt_infer on an inference plan of B
sequences), whose losses for a window from position 0 are the training forward's bit for bit, so a shard split
scores exactly as the trainer's validation loss does: windows of seq_len + 1
tokens at stride seq_len from token 0, batch i = windows i*B .. i*B + B - 1 (wrapping, as Loader.val_batch), loss =
sum of token losses / count of scored targets (masked targets, y = -1, are not scored).

A text file is tokenized with the checkpoint's tokenizer after one <|endoftext|> (byte 0 for the byte tokenizer),
so every token of the text is predicted; its windows are cut the same way, the last one may be short.
Bits per byte = sum of token losses / ln 2 / bytes of the scored tokens (a special token counts its string's
bytes): for a text file, its size in bytes.

HellaSwag (JSONL: ctx, endings (4), label), scored as llm.c's dev/data/hellaswag.py: each ending is tokenized as
" " + ending after the context, and only the ending's tokens are scored; acc picks the ending with the lowest sum
of token losses, acc_norm the lowest mean loss per token. The real validation set (10,042 examples) is
https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl.
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

from microgpt import checkpoint, config
from microgpt.backend import numpy_backend
from microgpt.data.tokenizer import load_tokenizer
from microgpt.errors import ArgParser, InputError, brief, check_number
from microgpt.fileio import parse_json
from microgpt.state import make_infer_state


class EvalError(InputError):
    """Bad eval input (a text or HellaSwag file, a flag). str(err) is one line naming it."""


class Scorer:
    """The checkpoint's model on a NumPy inference plan of B windows of T tokens without a KV cache (every window
    starts at position 0): the per-token losses of (b, t) batches of at most B * T tokens."""

    def __init__(self, ld: checkpoint.Trained, B: int):
        self.m, self.B, self.T = ld.exp.model, B, ld.exp.model.seq_len
        self.S = make_infer_state(self.m, numpy_backend(), B, ld.weights, cache=False)
        self.K, self.A = self.S.K, self.S.arena

    def forward(self, x: np.ndarray, y: np.ndarray) -> tuple[float, int, np.ndarray]:
        """x, y (b, t) int32, b * t <= B * T; full windows (t = T) are padded to B rows, as the trainer's
        evaluation batches are. (sum of losses, scored count, losses (b, t))."""
        K, A, (b, t) = self.K, self.A, x.shape
        if t == self.T and b < self.B:
            pad = self.B - b
            x = np.concatenate([x, np.zeros((pad, t), np.int32)])
            y = np.concatenate([y, np.full((pad, t), -1, np.int32)])
        tokens, targets = self.S.inputs(*x.shape)
        K.copy_in(tokens, x)
        K.copy_in(targets, y)
        self.S.run(tokens, 0, targets)
        n = x.size
        K.loss_sum(A["loss_sum"], A["losses"][:n], targets.reshape(-1))  # as the trainer's _val_loss
        s, c = K.to_numpy(A["loss_sum"]).tolist()
        return s, int(c), K.to_numpy(A["losses"][:n]).reshape(x.shape)[:b].copy()


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


def score_windows(sc: Scorer, windows: Windows, nbytes: np.ndarray) -> dict[str, Any]:
    total, count, byte_count = 0.0, 0, 0
    for i in range(0, windows.n, sc.B):
        x, y = windows.get(i, min(windows.n, i + sc.B))
        s, c, _ = sc.forward(x, y)
        total, count = total + s, count + c
        byte_count += int(nbytes[y[y >= 0]].sum())
    loss = total / max(1, count)
    bpb = total / math.log(2) / byte_count if byte_count else None
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": bpb,
            "tokens": count, "bytes": byte_count, "windows": windows.n}  # fmt: skip


def shard_windows(ld: checkpoint.Trained, folder: Path, split: str, n: int | None, B: int) -> Windows:
    """The validation loader's windows 0 .. n-1 (all of them by default; past the end they wrap, as val_batch)."""
    from microgpt.data.loader import Loader, open_split

    if not folder.is_dir():
        raise EvalError(f"--data {folder}: not a folder")
    parts, masks = open_split(folder, split, ld.exp)
    ld_ = Loader(parts, B, ld.exp.model.seq_len, ld.exp.train.seed, 1, masks, f"{folder} {split}")
    return Windows(ld_.n_windows if n is None else n,
                   lambda lo, hi: ld_._windows(np.arange(lo, hi, dtype=np.int64) % ld_.n_windows))  # fmt: skip


def text_windows(ids: list[int], T: int, n: int | None) -> Windows:
    xs, ys = [], []
    for start in range(0, max(1, len(ids) - 1), T):
        w = ids[start : start + T + 1]
        x, y = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        x[: len(w) - 1], y[: len(w) - 1] = w[:-1], w[1:]
        xs.append(x)
        ys.append(y)
    return Windows(len(xs) if n is None else min(n, len(xs)), lambda lo, hi: (np.stack(xs[lo:hi]), np.stack(ys[lo:hi])))


LABELS = {0: 0, 1: 1, 2: 2, 3: 3, "0": 0, "1": 1, "2": 2, "3": 3}  # the data set writes its label as a string


def read_hellaswag(path: Path) -> list[dict[str, Any]]:
    """Every line checked before any scoring (fileio's strict reader: nesting, duplicate keys, NaN); one error
    naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f"--hellaswag {path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    out = []
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        ex = parse_json(line, f"{path}:{k}", EvalError, allow_nan=False)
        if not isinstance(ex, dict) or not isinstance(ex.get("ctx"), str):
            raise EvalError(f"{path}:{k}: field 'ctx' missing or not a string")
        ends = ex.get("endings")
        if not isinstance(ends, list) or len(ends) != 4 or not all(isinstance(e, str) and e for e in ends):
            raise EvalError(f"{path}:{k}: field 'endings' must be a list of 4 non-empty strings")
        label = ex.get("label")
        if isinstance(label, bool) or not isinstance(label, (int, str)) or label not in LABELS:
            raise EvalError(f"{path}:{k}: field 'label' must be 0, 1, 2 or 3, got {brief(label)}")
        out.append({"ctx": ex["ctx"], "endings": ends, "label": LABELS[label]})
    if not out:
        raise EvalError(f"--hellaswag {path}: no examples")
    return out


def hellaswag_rows(ex: dict[str, Any], tok: Any, T: int) -> tuple[list[list[int]], list[int]]:
    """An example's 4 scored sequences (context + " " + ending, the last T + 1 tokens where longer: the ending must
    fit) and the number of ending tokens each scores."""
    ctx, seqs, n_end = tok.encode(ex["ctx"]), [], []
    for ending in ex["endings"]:
        end = tok.encode(" " + ending)
        seq = (ctx + end)[-(T + 1) :]
        seqs.append(seq)
        n_end.append(min(len(end), len(seq) - 1))
    return seqs, n_end


def hellaswag(ld: checkpoint.Trained, tok: Any, path: Path, limit: int | None) -> dict[str, Any]:
    """acc and acc_norm over the examples, packed to their own length: each batch holds as many whole examples (4
    rows each) as fit the plan's 4 * T tokens at the batch's longest row, so a 60-token example costs 60 positions,
    not seq_len. An example where some ending has no token to score (an empty context and a one-token ending: the
    ending's only token is the first of the sequence, predicted by nothing) cannot be judged: it counts among the
    examples, never as correct, and is reported as unscored."""
    examples = read_hellaswag(path)[:limit]
    T = ld.exp.model.seq_len
    rows = [hellaswag_rows(ex, tok, T) for ex in examples]
    judged = [e for e, (_, n_end) in enumerate(rows) if min(n_end) > 0]
    sc, correct, correct_norm, i = Scorer(ld, 4), 0, 0, 0
    while i < len(judged):
        j, t = i, 1
        while j < len(judged) and 4 * (j - i + 1) * max(t, *(len(s) - 1 for s in rows[judged[j]][0])) <= 4 * T:
            t = max(t, *(len(s) - 1 for s in rows[judged[j]][0]))
            j += 1
        x, y = np.zeros((4 * (j - i), t), np.int32), np.full((4 * (j - i), t), -1, np.int32)
        for k, e in enumerate(judged[i:j]):
            for r, (seq, n_end) in enumerate(zip(*rows[e])):
                x[4 * k + r, : len(seq) - 1] = seq[:-1]
                y[4 * k + r, len(seq) - 1 - n_end : len(seq) - 1] = seq[len(seq) - n_end :]
        _, _, losses = sc.forward(x, y)
        scored = y >= 0
        sums = np.where(scored, losses, 0.0).sum(axis=1, dtype=np.float64).reshape(-1, 4)
        means = sums / scored.sum(axis=1).reshape(-1, 4)
        labels = np.array([examples[e]["label"] for e in judged[i:j]])
        correct += int((np.argmin(sums, axis=1) == labels).sum())
        correct_norm += int((np.argmin(means, axis=1) == labels).sum())
        i = j
    unscored = len(examples) - len(judged)
    n = len(examples)
    return {"examples": n, "acc": correct / n, "acc_norm": correct_norm / n, "correct": correct,
            "correct_norm": correct_norm, "unscored": unscored}  # fmt: skip


def parser() -> ArgParser:
    p = ArgParser(prog="microgpt eval", description="Loss, perplexity, bits per byte, or HellaSwag accuracy.")
    p.add_argument("checkpoint", help="a step-*.bin checkpoint, or a run folder (its newest valid checkpoint)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", help="a folder of token shards (train_*.bin / val_*.bin)")
    what.add_argument("--text", help="a UTF-8 text file")
    what.add_argument("--hellaswag", help="a HellaSwag JSONL file (ctx, endings, label)")
    p.add_argument("--split", default="val", choices=("train", "val"), help="with --data: which split")
    p.add_argument("--windows", type=int, help="score only the first N windows (HellaSwag: examples)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | argparse.Namespace) -> int:
    args = argv if isinstance(argv, argparse.Namespace) else parser().parse_args(argv)
    if args.windows is not None:
        check_number(args.windows, "--windows", 1, config.INT_MAX, integer=True, error=EvalError)
    ld = checkpoint.load_trained(args.checkpoint)
    if args.hellaswag:
        tok = load_tokenizer(ld.side.get("tokenizer", {}))
        res = hellaswag(ld, tok, Path(args.hellaswag), args.windows)
        text = f"hellaswag: {res['examples']} examples | acc {res['acc']:.4f} | acc_norm {res['acc_norm']:.4f}"
        text += f" | {res['unscored']} with nothing to score (counted wrong)" if res["unscored"] else ""
    else:
        m, B = ld.exp.model, ld.exp.train.micro_batch
        if args.data:
            windows = shard_windows(ld, Path(args.data), args.split, args.windows, B)
            info = ld.side.get("tokenizer", {})
            tok = None if info.get("kind") == "unknown" else load_tokenizer(info)  # llm.c shards: no byte counts
        else:
            tok = load_tokenizer(ld.side.get("tokenizer", {}))
            try:
                body = Path(args.text).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise EvalError(f"--text {args.text}: cannot read ({getattr(e, 'strerror', None) or e})") from None
            if not body:
                raise EvalError(f"--text {args.text}: empty file")
            windows = text_windows([tok.eot_id, *tok.encode(body)], m.seq_len, args.windows)
        nbytes = token_bytes(tok, m.vocab_size) if tok is not None else np.zeros(m.vocab_size, np.int64)
        res = score_windows(Scorer(ld, B), windows, nbytes)
        bpb = res["bits_per_byte"] or float("nan")
        text = (f"loss {res['loss']:.4f} | perplexity {res['perplexity']:.2f} | bits/byte {bpb:.4f} "
                f"| {res['tokens']} tokens in {res['windows']} windows")  # fmt: skip
    res = {"step": ld.step, **res}
    print(json.dumps(res) if args.json else text)
    return 0
