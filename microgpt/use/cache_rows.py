"""serve's KV-cache rows as the engine's host knows them (use/scheduler.py): which are free, what each holds, and
which a new prompt takes (prefix reuse).

The inference plan has max_batch cache rows (engine/infer.py). A row keeps its tokens after its request ends, so a
later prompt that starts the same way (a conversation's next turn, a system prompt many share) skips what is there:

    ids[r, :known[r]]   the tokens of cache row r the host knows: its prompt's, then each token as it is read back
    fed[r]              its positions written, or queued in a launched step (the scheduler keeps it)
    held(r, prompt)     min(the common prefix of ids[r] and the prompt but its last token, fed[r], known[r])

A prompt takes the free row that holds the most of it, or, where a busy row holds more, the least recently used free
row with that prefix copied into it (InferState.copy_rows: a shared system prompt is computed once).
"""

from __future__ import annotations

import numpy as np

from microgpt.engine.infer import InferState


class CacheRows:
    """The bookkeeping of the first `rows` (default all) of S's S.B cache rows of T positions (the module docstring;
    serve's scheduler keeps the last for padding); reuse False: no prefix reuse."""

    def __init__(self, S: InferState, T: int, reuse: bool = True, rows: int | None = None) -> None:
        n = S.B if rows is None else rows
        self.S, self.T, self.reuse = S, T, reuse
        self.ids = np.zeros((n, T), np.int32)  # each cache row's tokens, where the host knows them
        self.fed = np.zeros(n, np.int64)  # positions of each cache row written (or queued)
        self.known = np.zeros(n, np.int64)  # positions of each cache row whose token the host knows
        self.free = list(range(n))  # free cache rows, the least recently used first

    def take(self, prompt: np.ndarray, reuse: bool = True) -> tuple[int, int, int]:
        """A free cache row for prompt -> (the row, the prompt tokens it holds, how many of those were copied from a
        busy row). Its last token is never held: the decode step feeds it. reuse False: none held (a prompt whose
        every logprob is asked: echo)."""
        target, n = prompt[:-1], prompt.size - 1
        lcp = np.zeros(len(self.fed), np.int64)
        if n and self.reuse and reuse:
            eq = self.ids[:, :n] == target
            lcp = np.minimum(np.where(eq.all(1), n, eq.argmin(1)), np.minimum(self.fed, self.known))
        free = np.array(self.free)
        best_free = free[np.argmax(lcp[free])]
        donor = int(np.argmax(lcp))
        if lcp[best_free] >= lcp[donor] and lcp[best_free] > 0:
            slot, held, copied = int(best_free), int(lcp[best_free]), 0
        else:
            slot, held = self.free[0], int(lcp[donor])
            copied = held  # into the least recently used free row
            if held:
                self.S.copy_rows(slot, donor, held)
        self.free.remove(slot)
        known = min(prompt.size, self.T)  # a scored prompt may hold T + 1 tokens: the last is never fed
        self.ids[slot, :known] = prompt[:known]
        self.fed[slot], self.known[slot] = held, known
        return slot, held, copied

    def drawn(self, slots: np.ndarray, pos: np.ndarray, tokens: np.ndarray) -> None:
        """tokens read back from a step: each the token at position pos + 1 (< T) of its cache row."""
        self.ids[slots, pos + 1] = tokens
        self.known[slots] = np.maximum(self.known[slots], pos + 2)

    def release(self, slot: int) -> None:
        """slot is free again, the most recently used; its tokens stay for a later prompt."""
        self.free.append(slot)
