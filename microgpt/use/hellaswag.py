"""HellaSwag: the examples of a JSONL file (ctx, endings (4), label), scored as llm.c's dev/data/hellaswag.py.

Each ending is tokenized as " " + ending after the context, and only the ending's tokens are scored: acc picks the
ending with the lowest sum of token losses, acc_norm the lowest mean loss per token. The real validation set
(10,042 examples) is https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl.

One scorer for both users: `microgpt eval --hellaswag` (an inference plan of the checkpoint's model) and the trainer
(`train.hellaswag`: the weights it is training, over its own arena; infer.training_infer_state). Each scored
sequence (an ending after its context) is one row of a window from position 0; rows are packed by length into
batches of at most `budget` tokens (the plan's rows: micro_batch x seq_len), each batch as long as its longest row,
so a 60-token example costs 60 positions, never seq_len. The packing depends only on the examples and the budget, so
the trainer and `eval` on the checkpoint of that step (the same micro_batch) score the same batches.

Longer than the model's context (seq_len + 1 tokens, the last seq_len of them predicted): the context loses its
first tokens, as lm-evaluation-harness cuts a context from the left, so the ending keeps every token (the example is
counted as `truncated`). An ending that does not fit seq_len alone, or an example where some ending has no token to
score (an empty context and a one-token ending: nothing predicts the sequence's first token), cannot be judged: it
counts among the examples, never as correct, and is reported as `unscored`. Neither refuses the file: a small model
of a short context still gets a number, and the counts say what it stands on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from microgpt import data
from microgpt.config import Experiment
from microgpt.data.hellaswag_file import Item, read, tokenize
from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine.infer import InferState, training_infer_state
from microgpt.engine.state import TrainState


def batches(items: list[Item], budget: int) -> list[list[tuple[int, int]]]:
    """The judged items' rows as (item, ending) pairs, shortest first, in batches of at most `budget` tokens at
    the batch's longest row (each row is at most seq_len <= budget tokens)."""
    rows = sorted(
        ((i, r) for i, it in enumerate(items) if it.judged for r in range(4)),
        key=lambda ir: len(items[ir[0]].seqs[ir[1]]),
    )
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


def counts(items: list[Item], sums: np.ndarray) -> dict[str, int]:
    """How many items there are, how many each rule picks right, how many are unscored or were cut."""
    judged = np.array([it.judged for it in items], dtype=bool)
    labels = np.array([it.label for it in items], dtype=np.int64)
    n_end = np.array([it.n_end for it in items], dtype=np.int64).reshape(-1, 4)
    means = sums / np.maximum(1, n_end)
    correct = int((np.argmin(np.where(judged[:, None], sums, 0.0), axis=1) == labels)[judged].sum())
    correct_norm = int((np.argmin(np.where(judged[:, None], means, 0.0), axis=1) == labels)[judged].sum())
    return {
        "examples": len(items),
        "correct": correct,
        "correct_norm": correct_norm,
        "unscored": len(items) - int(judged.sum()),
        "truncated": sum(it.truncated for it in items),
    }


def accuracy(c: dict[str, int]) -> dict[str, Any]:
    """acc and acc_norm from counts(): an example not judged counts among the examples, never as correct."""
    n = max(1, c["examples"])
    return {
        "examples": c["examples"],
        "acc": c["correct"] / n,
        "acc_norm": c["correct_norm"] / n,
        **{k: c[k] for k in ("correct", "correct_norm", "unscored", "truncated")},
    }


def score(S: InferState, items: list[Item]) -> dict[str, Any]:
    """accuracy() of the items on S's model."""
    return accuracy(counts(items, ending_losses(S, items)))


@dataclass
class DuringTraining:
    """train.hellaswag in a run: the file's examples (the first train.hellaswag_examples; 0: all) tokenized once,
    scored every `every` steps and at the last on the weights being trained, over the training arena
    (infer.training_infer_state: no memory beyond the training plan). Under data parallel each rank scores every
    world-th example and the counts are summed, so the result does not depend on the number of ranks."""

    path: str
    items: list[Item]  # this rank's share
    total: int  # examples over all ranks
    every: int
    seq_len: int
    truncated: int  # over all ranks, for the start line
    unscored: int

    @classmethod
    def make(cls, exp: Experiment, rank: int, world: int) -> DuringTraining | None:
        """None without train.hellaswag; `every` is train.hellaswag_every, or train.eval_every where that is 0. The
        examples are tokenized with the data's tokenizer (built by now; data.hellaswag.check has seen that there is
        one)."""
        t = exp.train
        if not t.hellaswag:
            return None
        examples = read(t.hellaswag, "train.hellaswag")[: t.hellaswag_examples or None]
        items = tokenize(examples, load_tokenizer(data.tokenizer_info(exp)), exp.model.seq_len)
        cut, unscored = sum(it.truncated for it in items), sum(not it.judged for it in items)
        every = t.hellaswag_every or t.eval_every
        return cls(t.hellaswag, items[rank::world], len(items), every, exp.model.seq_len, cut, unscored)

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last

    def describe(self) -> str:
        """The start line: what is scored, how often, and what does not fit seq_len."""
        notes = [f"{self.truncated} with the context cut to fit seq_len {self.seq_len}"] if self.truncated else []
        notes += [f"{self.unscored} with nothing to score (counted wrong)"] if self.unscored else []
        return f"hellaswag: {self.total:,} examples of {self.path}, every {self.every} steps" + (
            f" ({'; '.join(notes)})" if notes else ""
        )

    def __call__(self, S: TrainState, dp: Any = None) -> dict[str, Any]:
        """The eval record's fields: hellaswag (acc), hellaswag_acc_norm, hellaswag_examples, hellaswag_seconds."""
        t0 = time.perf_counter()
        c = counts(self.items, ending_losses(training_infer_state(S), self.items))
        keys = ("correct", "correct_norm")
        if dp is not None:
            c.update(zip(keys, (int(v) for v in dp.sum_scalars(*(c[k] for k in keys)))))
        n = max(1, self.total)
        return {
            "hellaswag": c["correct"] / n,
            "hellaswag_acc_norm": c["correct_norm"] / n,
            "hellaswag_examples": self.total,
            "hellaswag_seconds": round(time.perf_counter() - t0, 3),
        }


def progress(ev: dict[str, Any]) -> str:
    """The terminal's words for an eval record's HellaSwag fields (DuringTraining's)."""
    return (
        f"hellaswag {ev['hellaswag']:.4f} (acc_norm {ev['hellaswag_acc_norm']:.4f}, "
        f"{ev['hellaswag_examples']:,} examples, {ev['hellaswag_seconds']:.1f} s)"
    )
