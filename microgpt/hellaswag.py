"""HellaSwag: the examples of a JSONL file (ctx, endings (4), label), scored as llm.c's dev/data/hellaswag.py.

Each ending is tokenized as " " + ending after the context, and only the ending's tokens are scored: acc picks the
ending with the lowest sum of token losses, acc_norm the lowest mean loss per token. The real validation set
(10,042 examples) is https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl.

One scorer for both users: `microgpt eval --hellaswag` (an inference plan of the checkpoint's model) and the trainer
(`train.hellaswag`: the weights it is training, over its own arena; state.training_infer_state). Each scored
sequence (an ending after its context) is one row of a window from position 0; rows are packed by length into
batches of at most `budget` tokens (the plan's rows: micro_batch x seq_len), each batch as long as its longest row,
so a 60-token example costs 60 positions, never seq_len. The packing depends only on the examples and the budget, so
the trainer and `eval` on the checkpoint of that step (the same micro_batch) score the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from microgpt.errors import InputError, brief
from microgpt.fileio import parse_json
from microgpt.state import InferState

LABELS = {0: 0, 1: 1, 2: 2, 3: 3, "0": 0, "1": 1, "2": 2, "3": 3}  # the data set writes its label as a string


class HellaswagError(InputError):
    """A HellaSwag file that cannot be read or has a malformed line; str(err) names the flag or field, the file
    and the line."""


@dataclass
class Item:
    """One example, tokenized: its 4 scored sequences, the ending tokens each scores (the last n_end of the
    sequence's targets) and the right ending."""

    seqs: list[list[int]]
    n_end: list[int]
    label: int

    @property
    def judged(self) -> bool:
        """False where some ending has no token to score (an empty context and a one-token ending: that token starts
        the sequence, and nothing predicts it)."""
        return min(self.n_end) > 0


def read(path: Path, name: str) -> list[dict[str, Any]]:
    """Every line checked before any scoring (fileio's strict reader: nesting, duplicate keys, NaN); one
    HellaswagError naming `name` (the flag or config field), the file and the line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise HellaswagError(f"{name} {path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    out = []
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name} {path}:{k}"
        ex = parse_json(line, where, HellaswagError, allow_nan=False)
        if not isinstance(ex, dict) or not isinstance(ex.get("ctx"), str):
            raise HellaswagError(f"{where}: field 'ctx' missing or not a string")
        ends = ex.get("endings")
        if not isinstance(ends, list) or len(ends) != 4 or not all(isinstance(e, str) and e for e in ends):
            raise HellaswagError(f"{where}: field 'endings' must be a list of 4 non-empty strings")
        label = ex.get("label")
        if isinstance(label, bool) or not isinstance(label, (int, str)) or label not in LABELS:
            raise HellaswagError(f"{where}: field 'label' must be 0, 1, 2 or 3, got {brief(label)}")
        out.append({"ctx": ex["ctx"], "endings": ends, "label": LABELS[label]})
    if not out:
        raise HellaswagError(f"{name} {path}: no examples")
    return out


def tokenize(examples: list[dict[str, Any]], tok: Any, T: int) -> list[Item]:
    """Each example's 4 sequences: context + " " + ending, the last T + 1 tokens where longer (the ending must
    fit: its tokens are what is scored)."""
    items = []
    for ex in examples:
        ctx, seqs, n_end = tok.encode(ex["ctx"]), [], []
        for ending in ex["endings"]:
            end = tok.encode(" " + ending)
            seq = (ctx + end)[-(T + 1) :]
            seqs.append(seq)
            n_end.append(min(len(end), len(seq) - 1))
        items.append(Item(seqs, n_end, ex["label"]))
    return items


def batches(items: list[Item], budget: int) -> list[list[tuple[int, int]]]:
    """The judged items' rows as (item, ending) pairs, shortest first, in batches of at most `budget` tokens at
    the batch's longest row (each row is at most seq_len <= budget tokens)."""
    rows = sorted(((i, r) for i, it in enumerate(items) if it.judged for r in range(4)),
                  key=lambda ir: len(items[ir[0]].seqs[ir[1]]))  # fmt: skip
    out: list[list[tuple[int, int]]] = []
    for row in rows:
        t = len(items[row[0]].seqs[row[1]]) - 1  # rows come shortest first: this one is the batch's longest
        if not out or (len(out[-1]) + 1) * t > budget:
            out.append([])
        out[-1].append(row)
    return out


def ending_losses(S: InferState, items: list[Item]) -> np.ndarray:
    """(len(items), 4) float64: each ending's sum of token losses (NaN for the rows of an example not judged)."""
    sums = np.full((len(items), 4), np.nan)
    for batch in batches(items, S.B * S.m.seq_len):
        t = max(len(items[i].seqs[r]) - 1 for i, r in batch)
        x, y = np.zeros((len(batch), t), np.int32), np.full((len(batch), t), -1, np.int32)
        for k, (i, r) in enumerate(batch):
            seq, n = items[i].seqs[r], items[i].n_end[r]
            x[k, : len(seq) - 1] = seq[:-1]
            y[k, len(seq) - 1 - n : len(seq) - 1] = seq[len(seq) - n :]
        _, _, losses = S.score(x, y)
        row_sums = np.where(y >= 0, losses, 0.0).sum(axis=1, dtype=np.float64)
        for k, (i, r) in enumerate(batch):
            sums[i, r] = row_sums[k]
    return sums


def accuracy(items: list[Item], sums: np.ndarray) -> dict[str, Any]:
    """acc and acc_norm over the items, from their ending loss sums. An example not judged counts among the
    examples, never as correct, and is reported as unscored."""
    judged = np.array([it.judged for it in items])
    labels = np.array([it.label for it in items])
    means = sums / np.maximum(1, np.array([it.n_end for it in items]).reshape(-1, 4))
    correct = int((np.argmin(np.where(judged[:, None], sums, 0.0), axis=1) == labels)[judged].sum())
    correct_norm = int((np.argmin(np.where(judged[:, None], means, 0.0), axis=1) == labels)[judged].sum())
    n = len(items)
    return {"examples": n, "acc": correct / n, "acc_norm": correct_norm / n, "correct": correct,
            "correct_norm": correct_norm, "unscored": n - int(judged.sum())}  # fmt: skip


def score(S: InferState, items: list[Item]) -> dict[str, Any]:
    """accuracy() of the items on S's model."""
    return accuracy(items, ending_losses(S, items))
