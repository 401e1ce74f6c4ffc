"""HellaSwag's file format: a JSONL file of examples (ctx, endings (4), label), checked line by line, and each example
tokenized into the 4 sequences the scorer reads (microgpt/use/hellaswag.py: how they are scored, and what happens to an
example longer than the model's context). Here in the data layer so that `microgpt run` checks train.hellaswag
before it starts an engine, without loading one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from microgpt.config import Experiment
from microgpt.data.experiment import tokenizer_path, uses_bytes
from microgpt.errors import InputError, brief
from microgpt.fileio import parse_json, read_input_text

LABELS = {0: 0, 1: 1, 2: 2, 3: 3, "0": 0, "1": 1, "2": 2, "3": 3}  # the data set writes its label as a string


class HellaswagError(InputError):
    """A HellaSwag file that cannot be read or has a malformed line; str(err) names the flag or field, the file
    and the line."""


@dataclass
class Item:
    """One example, tokenized: its 4 scored sequences, the ending tokens each scores (the last n_end of the
    sequence's targets; 0 where none can be), the right ending, and whether the context was cut to fit."""

    seqs: list[list[int]]
    n_end: list[int]
    label: int
    truncated: bool = False

    @property
    def judged(self) -> bool:
        """False where some ending has no token to score (microgpt/use/hellaswag.py says when)."""
        return min(self.n_end) > 0


def read(path: str | Path, name: str) -> list[dict[str, Any]]:
    """Every line checked before any scoring (fileio's strict reader: nesting, duplicate keys, NaN); one
    HellaswagError naming `name` (the flag or config field), the file and the line."""
    try:
        lines = read_input_text(path, "HellaSwag file", HellaswagError).splitlines()  # a regular file, size-bound
    except FileNotFoundError:
        raise HellaswagError(f"{name} {path}: cannot read (No such file or directory)") from None
    except HellaswagError as e:
        raise HellaswagError(f"{name} {e}") from None
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


def check(exp: Experiment, src: str) -> None:
    """train.hellaswag, where set, read and checked line by line before a run writes anything, and the data's
    tokenizer there to tokenize it (shards without a tokenizer.json have none): a HellaswagError naming src (the
    experiment), the field, the file and the line."""
    t = exp.train
    if not t.hellaswag:
        return
    read(t.hellaswag, f"{src}: train.hellaswag")
    if exp.data.source == "shards" and not uses_bytes(exp) and tokenizer_path(exp) is None:
        raise HellaswagError(
            f"{src}: train.hellaswag {t.hellaswag}: needs the data's tokenizer to tokenize its "
            f"examples; {exp.data.path} has no tokenizer.json (set data.tokenizer)"
        )


def tokenize(examples: list[dict[str, Any]], tok: Any, T: int) -> list[Item]:
    """Each example's 4 sequences: context + " " + ending, the context cut from the left to fit T + 1 tokens; an
    ending longer than T tokens scores nothing (n_end 0: the example is unscored)."""
    items = []
    for ex in examples:
        ctx, seqs, n_end, cut = tok.encode(ex["ctx"]), [], [], False
        for ending in ex["endings"]:
            end = tok.encode(" " + ending)
            seq, fits = (ctx + end)[-(T + 1) :], len(end) <= T
            cut = cut or (fits and len(ctx) + len(end) > T + 1)
            seqs.append(seq)
            n_end.append(min(len(end), len(seq) - 1) if fits else 0)
        items.append(Item(seqs, n_end, ex["label"], cut))
    return items
