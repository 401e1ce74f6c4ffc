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
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import checkpoint
from microgpt.backend import numpy_backend
from microgpt.data.tokenizer import load_tokenizer
from microgpt.errors import ArgParser, InputError
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


def score_windows(sc: Scorer, windows: list[tuple[np.ndarray, np.ndarray]], nbytes: np.ndarray) -> dict[str, Any]:
    total, count, byte_count = 0.0, 0, 0
    for i in range(0, len(windows), sc.B):
        chunk = windows[i : i + sc.B]
        x, y = np.stack([w[0] for w in chunk]), np.stack([w[1] for w in chunk])
        s, c, _ = sc.forward(x, y)
        total, count = total + s, count + c
        byte_count += int(nbytes[y[y >= 0]].sum())
    loss = total / max(1, count)
    bpb = total / math.log(2) / byte_count if byte_count else None
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": bpb,
            "tokens": count, "bytes": byte_count, "windows": len(windows)}  # fmt: skip


def shard_windows(
    ld: checkpoint.Trained, folder: Path, split: str, n: int | None, B: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The validation loader's windows 0 .. n-1 (all of them by default; past the end they wrap, as val_batch)."""
    from microgpt.data.loader import Loader, open_split

    if not folder.is_dir():
        raise EvalError(f"--data {folder}: not a folder")
    parts, masks = open_split(folder, split, ld.exp)
    ld_ = Loader(parts, B, ld.exp.model.seq_len, ld.exp.train.seed, 1, masks, f"{folder} {split}")
    n = ld_.n_windows if n is None else n
    x, y = ld_._windows(np.arange(n, dtype=np.int64) % ld_.n_windows)
    return list(zip(x, y))


def text_windows(ids: list[int], T: int, n: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for start in range(0, max(1, len(ids) - 1), T):
        w = ids[start : start + T + 1]
        x, y = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        x[: len(w) - 1], y[: len(w) - 1] = w[:-1], w[1:]
        out.append((x, y))
    return out if n is None else out[:n]


def read_hellaswag(path: Path) -> list[dict[str, Any]]:
    """Every line checked before any scoring: one error naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f"--hellaswag {path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    out = []
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}:{k}: not JSON ({e.msg})") from None
        if not isinstance(ex, dict) or not isinstance(ex.get("ctx"), str):
            raise EvalError(f"{path}:{k}: field 'ctx' missing or not a string")
        ends = ex.get("endings")
        if not isinstance(ends, list) or len(ends) != 4 or not all(isinstance(e, str) and e for e in ends):
            raise EvalError(f"{path}:{k}: field 'endings' must be a list of 4 non-empty strings")
        label = ex.get("label")
        if isinstance(label, str) and label.isdigit():
            label = int(label)
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < 4:
            raise EvalError(f"{path}:{k}: field 'label' must be 0, 1, 2 or 3")
        out.append({"ctx": ex["ctx"], "endings": ends, "label": label})
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
    """Examples packed to their own length: each batch holds as many whole examples (4 rows each) as fit the plan's
    4 * T tokens at the batch's longest row, so a 60-token example costs 60 positions, not seq_len."""
    examples = read_hellaswag(path)[:limit]
    T = ld.exp.model.seq_len
    sc, rows = Scorer(ld, 4), [hellaswag_rows(ex, tok, T) for ex in examples]
    correct = correct_norm = i = 0
    while i < len(examples):
        j, t = i, 1
        while j < len(examples) and 4 * (j - i + 1) * max(t, *(len(s) - 1 for s in rows[j][0])) <= 4 * T:
            t = max(t, *(len(s) - 1 for s in rows[j][0]))
            j += 1
        x, y = np.zeros((4 * (j - i), t), np.int32), np.full((4 * (j - i), t), -1, np.int32)
        for e in range(i, j):
            for r, (seq, n_end) in enumerate(zip(*rows[e])):
                k = 4 * (e - i) + r
                x[k, : len(seq) - 1] = seq[:-1]
                y[k, len(seq) - 1 - n_end : len(seq) - 1] = seq[len(seq) - n_end :]
        _, _, losses = sc.forward(x, y)
        scored = y >= 0
        sums = np.where(scored, losses, 0.0).sum(axis=1, dtype=np.float64).reshape(-1, 4)
        means = sums / scored.sum(axis=1).reshape(-1, 4)
        labels = np.array([examples[e]["label"] for e in range(i, j)])
        correct += int((np.argmin(sums, axis=1) == labels).sum())
        correct_norm += int((np.argmin(means, axis=1) == labels).sum())
        i = j
    n = len(examples)
    return {"examples": n, "acc": correct / n, "acc_norm": correct_norm / n, "correct": correct,
            "correct_norm": correct_norm}  # fmt: skip


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
    if args.windows is not None and args.windows < 1:
        raise EvalError(f"--windows {args.windows}: must be at least 1")
    ld = checkpoint.load_trained(args.checkpoint)
    if args.hellaswag:
        tok = load_tokenizer(ld.side.get("tokenizer", {}))
        res = hellaswag(ld, tok, Path(args.hellaswag), args.windows)
        text = f"hellaswag: {res['examples']} examples | acc {res['acc']:.4f} | acc_norm {res['acc_norm']:.4f}"
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
