"""A row of serve's engine (scheduler.py), one choice of one request; and the decode batch of those rows as arrays:
each row with a token to feed keeps one place while it decodes, and what a step needs of it (its position, cache row,
next token or where on the device that token is, its limits) is a column at that place, so a step's inputs and the
bookkeeping of its tokens are array operations, not a loop over rows in Python; a row that leaves gives its place to
the last one.

A step's own record (`Step`) is a copy of the columns at its launch, plus the rows of the prompt tokens it fed: a row
that leaves or moves later leaves the step's record as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from microgpt.use.sample import Sampling
from microgpt.use.wire import RowSpec

FIXED = ("plen", "max_tokens", "stop", "rid", "index")  # a row's columns that stay as they are while it decodes
COLUMNS = ("pos", "slot", "tok", "src", *FIXED)


@dataclass(eq=False)
class Row:
    """One choice of one request: a cache row (slot) while admitted."""

    rid: int
    spec: RowSpec
    prompt: np.ndarray  # int32 ids
    sampling: Sampling
    rng: np.random.Generator
    slot: int = -1
    fed: int = 0  # positions of its cache row written with its prompt (or queued to be), while it is prefilled
    at: int = -1  # its place in the decode batch (Batch), while it decodes
    done: bool = False
    echo: list[tuple[float, dict[int, float]]] = field(default_factory=list)  # the prompt's logprobs so far

    @classmethod
    def of(cls, rid: int, spec: RowSpec) -> Row:
        sampling = Sampling(spec.temperature, spec.top_k, spec.top_p)
        return cls(rid, spec, np.frombuffer(spec.prompt, np.int32), sampling, np.random.default_rng(spec.seed))

    @property
    def host_draws(self) -> bool:
        """Its next token needs its logits on the host (sampling, or logprobs asked)."""
        return self.sampling.temperature > 0 or self.spec.logprobs >= 0

    @property
    def fixed(self) -> tuple[int, ...]:
        """Its FIXED columns: its prompt's length, max_tokens, its stop token (-1: none), its request and choice."""
        stop = self.spec.stop_ids[0] if self.spec.stop_ids else -1
        return (self.prompt.size, self.spec.max_tokens, stop, self.rid, self.spec.index)


class Batch:
    """Columns by place: pos (the position the row feeds next), slot (its cache row), tok (its next token where the
    host knows it) or src (where it does not: the place in the step before whose greedy token it is, carried on the
    device; -1 otherwise), plen (its prompt's length), max_tokens, stop (its stop token, -1: none), rid and index (its
    request and choice). `host` counts the rows that draw on the host (sampling, logprobs)."""

    def __init__(self, n: int) -> None:
        self.rows: list[Row] = []
        for name in COLUMNS:
            setattr(self, name, np.zeros(n, np.int64))
        self.host = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: Row, pos: int, tok: int, src: int) -> None:
        """row joins at the end: feeding tok (src -1) or the greedy token of the step before's place src."""
        j = len(self.rows)
        self.rows.append(row)
        row.at = j
        for name, value in zip(COLUMNS, (pos, row.slot, tok, src, *row.fixed)):
            getattr(self, name)[j] = value
        self.host += row.host_draws

    def remove(self, row: Row) -> int:
        """row leaves (the last row takes its place); the positions its cache row holds."""
        j, last = row.at, len(self.rows) - 1
        fed = int(self.pos[j])
        moved = self.rows.pop()
        if moved is not row:
            self.rows[j] = moved
            moved.at = j
            for name in COLUMNS:
                column = getattr(self, name)
                column[j] = column[last]
        row.at = -1
        self.host -= row.host_draws
        return fed

    def inputs(self, b: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """The step's rows (3b,) int32, the batch's first (tokens, positions, cache rows: the rest are the caller's),
        and the runs (dst, src, n) of tokens to carry from the step before's greedy tokens on the device."""
        nb = len(self.rows)
        out = np.empty(3 * b, np.int32)
        carried = self.src[:nb] >= 0
        out[:nb] = np.where(carried, 0, self.tok[:nb])
        out[b : b + nb], out[2 * b : 2 * b + nb] = self.pos[:nb], self.slot[:nb]
        dst = np.flatnonzero(carried)
        if not dst.size:
            return out, []
        src = self.src[dst]
        cuts = np.flatnonzero((dst[1:] - dst[:-1] != 1) | (src[1:] - src[:-1] != 1)) + 1
        if not cuts.size:  # the batch as the step before left it: one run
            return out, [(int(dst[0]), int(src[0]), dst.size)]
        lo, hi = np.concatenate(([0], cuts)), np.concatenate((cuts, [dst.size]))  # each run's first, past its last
        return out, list(zip(dst[lo].tolist(), src[lo].tolist(), (hi - lo).tolist()))

    def launched(self) -> None:
        """After a step: every row's next token is its own place's greedy token of that step; each moves on one."""
        nb = len(self.rows)
        self.src[:nb] = np.arange(nb)
        self.pos[:nb] += 1


@dataclass(eq=False)
class Step:
    """A decode step launched: the row each place draws for (None: a prompt token before its prompt's last), the
    columns at its launch (positions, cache rows, prompt lengths, limits, stop tokens, requests), and the wait for
    its greedy tokens."""

    rows: list[Row | None]
    cols: dict[str, np.ndarray]
    wait: Callable[[], np.ndarray]
    host: bool  # a row draws on the host: finish it before the next launch
