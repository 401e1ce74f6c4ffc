"""`microgpt chat`: a ChatML conversation with a checkpoint, one user turn per line of stdin.

Each turn renders the whole history (system prompt + turns, data/chat.py's `render`, the format the model was
trained on) plus an open `<|im_start|>assistant\\n` header, and the model continues it. The history is kept within
seq_len minus the room a reply needs: the oldest user/assistant turns are dropped first, the system prompt is kept.

The KV cache is reused across turns: the new prompt usually starts with the tokens already in the cache (the last
prompt and the reply), so only the new suffix runs through the model, in one window of the inference step
(model.gpt_infer); the cache is rewound to the longest common prefix, which also covers a dropped turn or a reply
that re-tokenizes differently.

A reply stops at `<|im_end|>` (or `<|endoftext|>`), at --tokens, or when the context is full. The stop is found in
the decoded text, so it works for byte tokenizers (where `<|im_end|>` is ten ordinary tokens) as for BPE (one
special token). The stop string itself is never printed: a reply is its text, then a newline. Text is streamed as
it becomes final: a trailing incomplete UTF-8 character or a trailing prefix of a stop string is held back.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

import numpy as np

from microgpt.data.chatml import Message, prompt_text
from microgpt.data.tokenizer import EOT, IM_END
from microgpt.engine.backend import add_flags
from microgpt.errors import ArgParser
from microgpt.use import sample

STOPS = (IM_END, EOT)


def fit_history(
    messages: list[Message], encode: Callable[[str], list[int]], budget: int
) -> tuple[list[Message], list[int]]:
    """Drop the oldest turns (never the system prompt, never the last message) until the prompt has at most
    budget tokens; the kept messages and the prompt's ids. If the system prompt and the last message alone are
    too long, the prompt keeps its last budget tokens."""
    kept = list(messages)
    ids = encode(prompt_text(kept))
    first = 1 if kept and kept[0]["role"] == "system" else 0
    while len(ids) > budget and len(kept) - first > 1:
        del kept[first]
        ids = encode(prompt_text(kept))
    return kept, ids[-budget:]


class Stream:
    """Incremental decoding of a reply: push() the ids so far (one list, grown between pushes), get the newly final
    text and whether it stopped (at the first of `stops` in the text, which is never returned).

    A push decodes only the ids past the last clean point: where the text so far ended on a whole character (its
    decode did not end in U+FFFD, which both tokenizers put for bytes of a character yet to come). The tokenizers
    decode bytes as UTF-8, which starts afresh after a whole character, so decode(ids[:k]) + decode(ids[k:]) is
    decode(ids) at such a k. The stops are looked for from the last push's clean text on (less a stop's length), since
    any one before it was found there. A reply's ids are then decoded once or about once, not once a token each
    (serve pushes every token of every stream)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = STOPS):
        self.decode, self.stops = decode, tuple(stops)
        self.shown = 0  # characters of the reply already returned
        self.clean = 0  # ids whose text (`head`) no later id changes
        self.head = ""
        self.longest = max(map(len, self.stops), default=1)

    def push(self, ids: list[int], last: bool = False) -> tuple[str, bool]:
        tail = self.decode(ids[self.clean :])
        text = self.head + tail
        start = max(0, len(self.head) - self.longest + 1)  # a stop before it lies in the head: found at its push
        cut = min((i for i in (text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        stopped = cut >= 0
        if tail and not tail.endswith("\ufffd"):
            self.head, self.clean = text, len(ids)
        if stopped:
            text = text[:cut]
        elif not last:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character: wait for its other bytes
            for s in self.stops:  # a stop string may be arriving: hold back its prefix
                text = text[: len(text) - held_prefix(text, s)]
        new = text[self.shown :]
        self.shown = max(self.shown, len(text))
        return new, stopped


def held_prefix(text: str, stop: str) -> int:
    """The length of the longest proper prefix of stop that text ends with (0: none). Only the places of stop's first
    character among text's last len(stop) - 1 are tried, each with one comparison, not every prefix length: serve
    pushes every token of every stream, with up to 16 stop strings (oai.MAX_STOPS) of up to 256 characters."""
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i >= 0:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0


class Chat:
    """One conversation: the history, the model with its cache, and the tokens the cache holds."""

    def __init__(self, gen: sample.Generator, tok: Any, args: argparse.Namespace, system: str | None = None):
        self.gen, self.tok, self.args = gen, tok, args
        self.messages: list[Message] = [{"role": "system", "content": system}] if system else []
        self.fed: list[int] = []  # the token at each cached position 0..gen.pos-1
        self.rng, self.sampling = np.random.default_rng(args.seed), sample.sampling(args)
        T = gen.m.seq_len
        self.budget = T - min(args.tokens, T // 2)  # the prompt's share of the context; the rest is the reply's

    def prefill(self, ids: list[int]) -> np.ndarray:
        """Put ids in the cache, reusing the common prefix already there; the next-token logits."""
        same = 0
        while same < min(len(ids) - 1, len(self.fed)) and ids[same] == self.fed[same]:  # feed at least one
            same += 1
        self.gen.pos, self.fed = same, list(ids)
        return self.gen.feed(ids[same:])

    def turn(self, text: str, out: IO[str]) -> str:
        """Add a user turn, stream the reply to out (flushed per piece), add it to the history and return it."""
        self.messages, ids = fit_history(
            [*self.messages, {"role": "user", "content": text}], self.tok.encode, self.budget
        )
        logits = self.prefill(ids)
        a, reply, stream = self.args, [], Stream(self.tok.decode)
        stopped = False
        for _ in range(a.tokens):
            reply.append(sample.pick(logits, self.sampling, self.rng))
            piece, stopped = stream.push(reply)
            out.write(piece)
            out.flush()
            if stopped or self.gen.pos == self.gen.m.seq_len:
                break
            logits = self.gen.feed(reply[-1:])
            self.fed.append(reply[-1])
        if not stopped:
            out.write(stream.push(reply, last=True)[0])
        out.write("\n")
        out.flush()
        answer = self.tok.decode(reply)[: stream.shown]
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def run(chat: Chat, stdin: IO[str], stdout: IO[str], marker: str = "") -> int:
    """Read user turns from stdin, one a line, until EOF; blank lines are skipped. A line that is not UTF-8 (stdin
    decodes with surrogate escapes) ends the chat with one `error:` line naming it."""
    n = 0
    while True:
        if marker:
            stdout.write(marker)
            stdout.flush()
        try:
            line = stdin.readline()
        except OSError as e:  # fd 0 open for writing only (EBADF), a device that fails (EIO)
            raise sample.SampleError(f"stdin line {n + 1}: cannot read ({e.strerror or e})") from None
        n += 1
        if not line:
            if marker:
                stdout.write("\n")
            return 0
        text = line.rstrip("\r\n")
        sample.check_text(text, f"stdin line {n}")
        if text.strip():
            chat.turn(text, stdout)


def parser() -> ArgParser:
    p = ArgParser(prog="microgpt chat", description="Chat with a checkpoint (ChatML); one user turn per stdin line.")
    p.add_argument("checkpoint", help="a step-*.bin checkpoint, or a run folder (its newest valid checkpoint)")
    p.add_argument("--system", default="", help="system prompt, kept when old turns are dropped")
    p.add_argument("--tokens", type=int, default=200, help="most tokens per reply")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample among the K likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="then among the likeliest tokens of probability P (1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    add_flags(p)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    sample.check_flags(args)
    if sys.stdin is None:  # started with fd 0 closed (`<&-`): Python has no stdin object at all
        raise sample.SampleError("stdin is closed: chat reads one user turn per line of stdin (pipe them in)")
    gen, tok, _ = sample.load(args.checkpoint, 1, args.backend, args.precision)
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")  # a bad byte is reported by line, not as a traceback
    try:
        return run(Chat(gen, tok, args, args.system), sys.stdin, sys.stdout, "> " if sys.stdin.isatty() else "")
    except KeyboardInterrupt:  # Ctrl-C at the prompt or mid-reply: end quietly, with the shell's code for SIGINT
        print()
        return 130


def sample_chat(args: argparse.Namespace) -> int:
    """`sample --chat`: the prompt is one user turn, formatted as chat formats it; print the assistant reply."""
    sample.check_flags(args)
    if args.num_samples != 1:
        raise sample.SampleError("--num-samples: sample --chat draws one reply (chat's streaming turn)")
    gen, tok, step = sample.load(args.checkpoint, 1, args.backend, args.precision)
    chat, buf = Chat(gen, tok, args), io.StringIO()
    reply = chat.turn(args.prompt, buf if args.json else sys.stdout)
    if args.json:
        rec = {"step": step, "prompt": args.prompt, "text": reply, "temperature": args.temperature, "chat": True}
        print(json.dumps(rec))
    return 0
