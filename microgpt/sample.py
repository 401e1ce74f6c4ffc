"""Text generation from a checkpoint, on the CPU, with a KV cache.

Each new token runs one position through the model: the layernorm, linear and mlp forwards of the op
pairs on a (1, C) row, and attention of that one query against the cached keys and values of all
earlier positions (the training attention op is for whole causal sequences, so the single-query case is
written out here). The context slides when it reaches seq_len: the cache is rebuilt from the last
seq_len - 1 tokens.
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


class KVModel:
    """A model's weights plus a (L, T, C) key/value cache for one sequence."""

    def __init__(self, m: config.ModelConfig, P: dict[str, np.ndarray]):
        self.m, self.P = m, P  # named weights (checkpoint.Trained.params)
        C = m.d_model
        self.k = np.zeros((m.n_layer, m.seq_len, C), np.float32)
        self.v = np.zeros_like(self.k)
        self.pos = 0
        self.buf = {n: np.zeros((1, C), np.float32) for n in ("x", "ln", "q", "att", "proj", "x2")}
        self.h, self.a = np.zeros((1, 4 * C), np.float32), np.zeros((1, 4 * C), np.float32)
        self.mean, self.rstd = np.zeros(1, np.float32), np.zeros(1, np.float32)
        self.K = numpy_backend()

    def _attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """One query (C,) against cached positions [0, pos]: causal by construction."""
        H, T = self.m.n_head, self.pos + 1
        hs = self.m.d_model // H
        k = self.k[layer, :T].reshape(T, H, hs)
        v = self.v[layer, :T].reshape(T, H, hs)
        scores = np.einsum("hd,thd->ht", q.reshape(H, hs), k) / np.sqrt(hs)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        return np.einsum("ht,thd->hd", p, v).reshape(1, -1)

    def step(self, token: int) -> np.ndarray:
        """Feed one token at the next position; return the next-token logits (V,)."""
        P, b, t, ops = self.P, self.buf, self.pos, self.K
        x = b["x"]
        x[0] = P["wte"][token] + P["wpe"][t]
        for layer in range(self.m.n_layer):
            h = f"h{layer}."
            ops.layernorm_forward(b["ln"], self.mean, self.rstd, x, P[h + "ln1_w"], P[h + "ln1_b"])
            ops.linear_forward(b["q"], b["ln"], P[h + "w_q"])
            ops.linear_forward(self.k[layer, t : t + 1], b["ln"], P[h + "w_k"])
            ops.linear_forward(self.v[layer, t : t + 1], b["ln"], P[h + "w_v"])
            b["att"][...] = self._attend(layer, b["q"][0])
            ops.linear_forward(b["proj"], b["att"], P[h + "w_o"])
            ops.residual_forward(b["x2"], x, b["proj"])
            ops.layernorm_forward(b["ln"], self.mean, self.rstd, b["x2"], P[h + "ln2_w"], P[h + "ln2_b"])
            ops.mlp_forward(b["proj"], self.h, self.a, b["ln"], P[h + "w_1"], P[h + "w_2"])
            ops.residual_forward(x, b["x2"], b["proj"])
        ops.layernorm_forward(b["ln"], self.mean, self.rstd, x, P["lnf_w"], P["lnf_b"])
        self.pos += 1
        return P["wte"] @ b["ln"][0]  # the tied LM head


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


def generate(kv: KVModel, prompt: list[int], n_tokens: int, temperature: float, top_k: int, seed: int) -> list[int]:
    """Continue a non-empty prompt by n_tokens tokens."""
    rng = np.random.default_rng(seed)
    ids, T = list(prompt), kv.m.seq_len
    for tok in ids[-(T - 1) :]:
        logits = kv.step(tok)
    out = []
    for _ in range(n_tokens):
        nxt = pick(logits, temperature, top_k, rng)
        out.append(nxt)
        ids.append(nxt)
        if kv.pos == T:  # context full: rebuild the cache from the last T - 1 tokens
            kv.pos = 0
            for tok in ids[-(T - 1) : -1]:
                kv.step(tok)
        logits = kv.step(nxt)
    return out


def load(where: str) -> tuple[KVModel, Any, int]:
    """The model of a checkpoint or run folder with an empty cache, its tokenizer, and the checkpoint's step."""
    ld = checkpoint.load_trained(where)
    try:
        tok = load_tokenizer(ld.side.get("tokenizer", {}))
    except InputError as e:
        raise SampleError(f"{checkpoint.sidecar_path(ld.path)}: field 'tokenizer': {e}") from None
    return KVModel(ld.exp.model, ld.params()), tok, ld.step


def main(args: argparse.Namespace) -> int:
    check_flags(args)
    kv, tok, step = load(args.checkpoint)
    prompt = tok.encode(args.prompt) or [getattr(tok, "bos_id", 0)]  # empty prompt: start a new document
    out = generate(kv, prompt, args.tokens, args.temperature, args.top_k, args.seed)
    text = tok.decode(out)
    if args.json:
        print(json.dumps({"step": step, "prompt": args.prompt, "text": text, "temperature": args.temperature}))
    else:
        print(args.prompt + text)
    return 0
