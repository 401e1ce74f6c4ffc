"""Text generation from a checkpoint, through the model's inference step (model.gpt_infer) on the backend the
checkpoint is loaded on (`load`'s backend: the NumPy one, fp32, unless told).

The prompt is prefilled in one window from position 0 (the training forward's attention over it), then each new
token is one row of the decode step (model.gpt_decode: the same op pairs at one position a row, attending to the KV
cache of every earlier position; on a GPU one CUDA graph per batch size, replayed). The context slides when it
reaches seq_len: the cache is rebuilt from the last seq_len - 1 tokens.

A token is drawn from the logits by `pick`: temperature (0: greedy, the argmax), then top-k (the k likeliest
tokens), then top-p (nucleus sampling: the likeliest tokens until their probability reaches p; the likeliest one
always), each off at its neutral value (top_k 0, top_p 1), where the draw is exactly the one made before they
existed. Every draw takes one number from the row's own np.random.Generator, so a seed gives one sequence.

Batches: `--num-samples N` decodes N sequences of one prompt together, rows 0 .. N-1 of one inference plan of B = N
(each linear one GEMM over N rows, not N runs one after another). Row i draws from its own stream,
np.random.default_rng(seed + i), so sample i of `--num-samples N --seed S` is the sample `--seed S+i` draws alone:
the same tokens wherever the GEMM over N rows rounds each row as the GEMM of one row does. NumPy's matmul of one row
is a matrix-vector product (BLAS gemv), of several a gemm, whose sums can differ in the last bit (about 1e-7
relative), so a near-tie between two tokens may fall the other way; at temperature 0 on a trained model that is
rare, and tests/test_sample.py checks the tokens agree.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import checkpoint, config
from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine import model
from microgpt.engine.backend import Backend, for_trained
from microgpt.engine.infer import InferState, trained_infer_state
from microgpt.engine.trained import Trained, load_trained
from microgpt.errors import InputError, check_number

MAX_SAMPLES = 4096  # --num-samples: sequences in one batch (the memory plan refuses what this machine cannot hold)


class SampleError(InputError):
    """A sampling flag out of range (--tokens, --temperature, --top-k, --top-p, --seed, --num-samples), or a prompt
    that is not UTF-8."""


@dataclass(frozen=True)
class Sampling:
    """How `pick` draws the next token: temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


def sampling(args: argparse.Namespace) -> Sampling:
    """The Sampling of `sample`'s and `chat`'s flags."""
    return Sampling(args.temperature, args.top_k, args.top_p)


def check_text(text: str | None, flag: str) -> None:
    """Text from argv or stdin that is not UTF-8 arrives with surrogate escapes; refuse it naming the flag."""
    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError as e:
        raise SampleError(f"{flag}: not UTF-8 text (character {e.start})") from None


def check_flags(args: argparse.Namespace, samples: int = 1) -> None:
    """The flags `sample` and `chat` share, checked before the model is loaded; `samples` sequences take the seeds
    seed .. seed + samples - 1."""
    check_number(args.tokens, "--tokens", 0, config.MAX_TOKENS, integer=True, error=SampleError)
    check_number(args.temperature, "--temperature (0: greedy)", 0, error=SampleError)
    check_number(args.top_k, "--top-k (0: off)", 0, config.INT_MAX, integer=True, error=SampleError)
    check_number(args.top_p, "--top-p (1: off)", 0, 1, error=SampleError)
    seed = "--seed" if samples == 1 else f"--seed (with {samples} samples)"
    check_number(args.seed, seed, 0, config.SEED_MAX - samples + 1, integer=True, error=SampleError)
    for flag in ("prompt", "system"):
        check_text(getattr(args, flag, None), f"--{flag}")


class Generator:
    """Sequences through the inference step (model.gpt_infer) on an inference state of S.B rows. `feed` and
    `feed_rows` keep rows 0 .. b-1 in step: `pos` positions of their KV cache hold the tokens fed so far (rewinding
    `pos` forgets those after it); `run` puts each row at a position and cache row of its own (model.windows)."""

    def __init__(self, S: InferState) -> None:
        self.S, self.m, self.pos = S, S.m, 0

    def run(self, ids: np.ndarray, pos: int | Sequence[int], slots: Sequence[int] | None = None) -> np.ndarray:
        """ids (b, t) at positions pos .. pos + t - 1: one pos for rows 0 .. b-1, or one each in cache rows slots
        (model.windows). The next-token logits after them, (b, V) float32 on the host. One token a row (t = 1) is
        the decode step (InferState.decode: model.gpt_decode, on a GPU one CUDA graph per b); a longer window, the
        prefill, goes through model.gpt_infer."""
        S, (b, t) = self.S, ids.shape
        if t == 1:
            at, rows = [], []
            for group, p, cached in model.windows(b, pos, slots):
                at += [p] * (group.stop - group.start)
                rows += range(cached.start, cached.stop) if isinstance(cached, slice) else cached
            return S.K.to_numpy(S.decode(ids[:, 0], np.array(at), np.array(rows))).copy()
        tokens, _ = S.inputs(b, t)
        S.K.copy_in(tokens, ids)
        S.run(tokens, pos, slots=slots)
        return S.K.to_numpy(S.arena["next_logits"][:b]).copy()

    def logits(self, row: int) -> np.ndarray:
        """Row `row`'s next-token logits (V,) float32 of the last decode step, on the host (serve's scheduler: only
        the rows that sample pay for V logits)."""
        return self.S.K.to_numpy(self.S.arena["next_logits"][row]).copy()

    def feed_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows 0 .. b-1 take ids (b, t) at positions pos .. pos + t - 1; their next-token logits (b, V)."""
        logits = self.run(ids, self.pos)
        self.pos += ids.shape[1]
        return logits

    def feed(self, ids: list[int]) -> np.ndarray:
        """One sequence (row 0): ids (at least one) at pos .. pos + len - 1; the next-token logits (V,) after them."""
        return self.feed_rows(np.asarray(ids, np.int32)[None])[0]


def pick(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """The next token from logits (V,) as s says, one draw from rng (none at temperature 0).

    The draw is rng.choice(V, p=p) over the softmax p in float64, written out (numpy's own steps: the cumulative sums,
    normalized by the last, searched for one rng.random()), so the tokens of a seed are those rng.choice gives; its
    checks of p, three more passes over V, reduce to the one that can fail (NaN logits: the same ValueError)."""
    if s.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # shifted first: a subnormal temperature gives -inf and 0, never inf - inf
        z -= z.max()
        z /= s.temperature
    if 0 < s.top_k < z.size:
        z[z < np.partition(z, -s.top_k)[-s.top_k]] = -np.inf
    top = z.max()
    if top != 0:  # 0 (the shift's) unless every logit is -inf or a NaN: exp(z - 0) is exp(z)
        z -= top
    p = np.exp(z, out=z)
    total = p.sum()
    if np.isnan(total):
        raise ValueError("Probabilities contain NaN")  # rng.choice's words
    p /= total
    if s.top_p < 1:
        p[~nucleus(p, s.top_p)] = 0
        p /= p.sum()
    cdf = np.cumsum(p, out=p)
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


NUCLEUS_MARGIN = 1e-12  # far above the rounding of a running sum of probabilities (<= ~1: ulps of 2.2e-16)


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Which tokens top-p keeps (a bool mask): in np.argsort(-p, kind="stable")'s order (likeliest first, ties by
    index), those whose likelier ones' probability (np.cumsum of that order, less their own) is below top_p, and the
    likeliest always. Only the likeliest k are sorted (every token tied with the k-th too), k growing until their
    running sum passes top_p by NUCLEUS_MARGIN: the sums of that prefix are the whole order's, bit for bit, and every
    token after it has a sum of likelier ones no smaller than the prefix's, less a rounding, so it is dropped."""
    k = 64
    while True:
        if k < p.size:
            cand = np.flatnonzero(p >= np.partition(p, -k)[-k])
            order = cand[np.argsort(-p[cand], kind="stable")]
        else:
            order = np.argsort(-p, kind="stable")
        q = p[order]
        running = np.cumsum(q)
        if k >= p.size or running[-1] >= top_p + NUCLEUS_MARGIN:
            break
        k *= 8
    keep = np.zeros(p.size, bool)
    keep[order[running - q < top_p]] = True
    keep[order[0]] = True
    return keep


def generate(gen: Generator, prompt: list[int], n_tokens: int, s: Sampling, seeds: Sequence[int]) -> list[list[int]]:
    """Continue a non-empty prompt by n_tokens tokens in len(seeds) sequences decoded together (rows 0 .. b-1 of
    gen's plan, b <= its B), row i drawing from np.random.default_rng(seeds[i]). A full context slides: the rows'
    caches are rebuilt from their last seq_len - 1 tokens (the rows stay at one position)."""
    rngs = [np.random.default_rng(seed) for seed in seeds]
    seqs, T = [list(prompt) for _ in seeds], gen.m.seq_len
    gen.pos = 0
    logits = gen.feed_rows(np.array([q[-(T - 1) :] for q in seqs], np.int32))
    for i in range(n_tokens):
        nxt = [pick(row, s, rng) for row, rng in zip(logits, rngs)]
        for q, token in zip(seqs, nxt):
            q.append(token)
        if i + 1 == n_tokens:
            break
        if gen.pos == T:  # context full: rebuild the cache from the last T - 1 tokens
            gen.pos = 0
            logits = gen.feed_rows(np.array([q[-(T - 1) :] for q in seqs], np.int32))
        else:
            logits = gen.feed_rows(np.array(nxt, np.int32)[:, None])
    return [q[len(prompt) :] for q in seqs]


def open_trained(
    ld: Trained, rows: int = 1, backend: str | Backend = "numpy", precision: str | None = None
) -> tuple[Generator, Any]:
    """A checkpoint read back (load_trained) as a model with an empty cache of `rows` sequences, and its
    tokenizer. `backend` is a Backend, or the name `--backend` gives (auto, numpy, triton) with `--precision`'s
    (backend.for_trained: default fp32 on numpy, bf16 on triton); what the run's precision keeps (fp8: its amax
    histories) comes from the sidecar."""
    tok = trained_tokenizer(ld)
    if isinstance(backend, str):
        backend = for_trained(backend, precision, ld.precision, str(ld.path), SampleError)
    return Generator(trained_infer_state(ld, backend, rows)), tok


def trained_tokenizer(ld: Trained) -> Any:
    """The tokenizer a checkpoint's sidecar records; SampleError naming the sidecar's field where it cannot load."""
    return side_tokenizer(ld.side, ld.path)


def side_tokenizer(side: dict[str, Any], path: str | Path) -> Any:
    """The tokenizer the sidecar `side` of checkpoint `path` records (serve's HTTP side has the sidecar its engine
    process read, not the checkpoint); SampleError naming the sidecar's field where it cannot load."""
    try:
        return load_tokenizer(side.get("tokenizer", {}))
    except InputError as e:
        raise SampleError(f"{checkpoint.sidecar_path(path)}: field 'tokenizer': {e}") from None


def load(
    where: str, rows: int = 1, backend: str | Backend = "numpy", precision: str | None = None
) -> tuple[Generator, Any, int]:
    """The model of a checkpoint or run folder (open_trained), its tokenizer, and the checkpoint's step."""
    ld = load_trained(where)
    return *open_trained(ld, rows, backend, precision), ld.step


def main(args: argparse.Namespace) -> int:
    n = check_number(args.num_samples, "--num-samples", 1, MAX_SAMPLES, integer=True, error=SampleError)
    check_flags(args, n)
    gen, tok, step = load(args.checkpoint, n, args.backend, args.precision)
    prompt = tok.encode(args.prompt) or [getattr(tok, "bos_id", 0)]  # empty prompt: start a new document
    seeds = [args.seed + i for i in range(n)]
    outs = generate(gen, prompt, args.tokens, sampling(args), seeds)
    for i, (seed, out) in enumerate(zip(seeds, outs)):
        text = tok.decode(out)
        if args.json:
            rec = {"step": step, "prompt": args.prompt, "text": text, "temperature": args.temperature}
            print(json.dumps(rec | ({"sample": i, "seed": seed} if n > 1 else {})))
        else:
            print((f"--- sample {i} (--seed {seed})\n" if n > 1 else "") + args.prompt + text)
    return 0
