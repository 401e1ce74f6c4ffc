"""Text generation from a checkpoint, through the model's inference step (model.gpt_infer) on the NumPy backend.

The prompt is prefilled in one window from position 0 (the training forward's attention over it), then each new
token runs one position through the same op pairs, attending to the KV cache of every earlier position. The
context slides when it reaches seq_len: the cache is rebuilt from the last seq_len - 1 tokens.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from microgpt import checkpoint, config
from microgpt.backend import numpy_backend
from microgpt.data.tokenizer import load_tokenizer
from microgpt.errors import InputError, check_number
from microgpt.state import InferState, make_infer_state


class SampleError(InputError):
    """A sampling flag out of range: --tokens, --temperature, --top-k, --seed, or a prompt that is not UTF-8."""


def check_text(text: str | None, flag: str) -> None:
    """Text from argv or stdin that is not UTF-8 arrives with surrogate escapes; refuse it naming the flag."""
    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError as e:
        raise SampleError(f"{flag}: not UTF-8 text (character {e.start})") from None


def check_flags(args: argparse.Namespace) -> None:
    """The flags `sample` and `chat` share, checked before the model is loaded."""
    check_number(args.tokens, "--tokens", 0, config.MAX_TOKENS, integer=True, error=SampleError)
    check_number(args.temperature, "--temperature (0: greedy)", 0, error=SampleError)
    check_number(args.top_k, "--top-k (0: off)", 0, config.INT_MAX, integer=True, error=SampleError)
    check_number(args.seed, "--seed", 0, config.SEED_MAX, integer=True, error=SampleError)
    for flag in ("prompt", "system"):
        check_text(getattr(args, flag, None), f"--{flag}")


class Generator:
    """One sequence through the inference step (model.gpt_infer) on an inference state of one sequence: `pos`
    positions of its KV cache hold the tokens fed so far (rewinding `pos` forgets those after it)."""

    def __init__(self, S: InferState) -> None:
        self.S, self.m, self.pos = S, S.m, 0

    def feed(self, ids: list[int]) -> np.ndarray:
        """Run ids (at least one) at positions pos .. pos + len - 1; return the next-token logits (V,) after them."""
        S, t = self.S, len(ids)
        tokens, _ = S.inputs(1, t)
        S.K.copy_in(tokens, np.asarray(ids, np.int32)[None])
        S.run(tokens, self.pos)
        self.pos += t
        return S.K.to_numpy(S.arena["next_logits"][0]).copy()


def pick(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # shifted first: a subnormal temperature gives -inf and 0, never inf - inf
        z = (z - z.max()) / temperature
    if 0 < top_k < z.size:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    p = np.exp(z - z.max())
    return int(rng.choice(z.size, p=p / p.sum()))


def generate(gen: Generator, prompt: list[int], n_tokens: int, temperature: float, top_k: int,
             seed: int) -> list[int]:  # fmt: skip
    """Continue a non-empty prompt by n_tokens tokens. A full context slides: the cache is rebuilt from the last
    seq_len - 1 tokens."""
    rng = np.random.default_rng(seed)
    ids, T = list(prompt), gen.m.seq_len
    gen.pos = 0
    logits = gen.feed(ids[-(T - 1) :])
    out = []
    for _ in range(n_tokens):
        nxt = pick(logits, temperature, top_k, rng)
        out.append(nxt)
        ids.append(nxt)
        if gen.pos == T:  # context full: rebuild the cache from the last T - 1 tokens
            gen.pos = 0
            logits = gen.feed(ids[-(T - 1) :])
        else:
            logits = gen.feed([nxt])
    return out


def load(where: str) -> tuple[Generator, Any, int]:
    """The model of a checkpoint or run folder on the NumPy backend (fp32) with an empty cache of one sequence, its
    tokenizer, and the checkpoint's step."""
    ld = checkpoint.load_trained(where)
    try:
        tok = load_tokenizer(ld.side.get("tokenizer", {}))
    except InputError as e:
        raise SampleError(f"{checkpoint.sidecar_path(ld.path)}: field 'tokenizer': {e}") from None
    return Generator(make_infer_state(ld.exp.model, numpy_backend(), 1, ld.weights)), tok, ld.step


def main(args: argparse.Namespace) -> int:
    check_flags(args)
    gen, tok, step = load(args.checkpoint)
    prompt = tok.encode(args.prompt) or [getattr(tok, "bos_id", 0)]  # empty prompt: start a new document
    out = generate(gen, prompt, args.tokens, args.temperature, args.top_k, args.seed)
    text = tok.decode(out)
    if args.json:
        print(json.dumps({"step": step, "prompt": args.prompt, "text": text, "temperature": args.temperature}))
    else:
        print(args.prompt + text)
    return 0
