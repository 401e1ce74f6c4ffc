"""What encoding a chat's history costs serve's event loop a request: the tokenizer's whole encode against
data/tokenizer.PieceCache's (the text between special tokens encoded once and kept), turn after turn.

    python3 dev/encode_profile.py                     # BPE of 2,048 and 50,304 entries, 8 turns of 400 characters
    python3 dev/encode_profile.py --vocab 50304 --turns 16 --chars 1000

The BPE is trained on the running Python's standard library (as the built-in corpus's), the messages are cuts of that
text. Each turn's request is the history so far (a system message, then user and assistant messages) rendered as
ChatML with the assistant's turn open, as serve renders /v1/chat/completions. A JSON line per vocabulary: the turn's
tokens, and the median microseconds of the whole encode and of the cached one, the cache as the turns before left
it (what serve's cache holds when a conversation's next turn comes: the turn's own message and the last reply are
new), less the median time of copying that cache (each repeat starts from a copy). The ids are checked equal on
every turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from collections import OrderedDict
from pathlib import Path

from microgpt.data.chatml import prompt_text
from microgpt.data.tokenizer import PieceCache, train_bpe


def median_us(fn, text: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(text)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[2048, 50304])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--chars", type=int, default=400, help="characters of each message")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in sorted(stdlib.glob("*.py"))]
    for vocab in args.vocab:
        tok = train_bpe(texts, vocab)
        pieces = PieceCache(tok)
        history = [{"role": "system", "content": texts[0][: args.chars]}]
        rows = []
        for turn in range(args.turns):
            history.append({"role": "user", "content": texts[2 * turn + 1][: args.chars]})
            text = prompt_text(history)
            before = OrderedDict(pieces.pieces), pieces.chars  # the cache as the turns before left it

            def cached(text: str) -> list[int]:
                fresh = PieceCache(tok)
                fresh.pieces, fresh.chars = OrderedDict(before[0]), before[1]
                return fresh.encode(text)

            ids = pieces.encode(text)
            assert ids == tok.encode(text), f"turn {turn}: the cached ids differ from the whole encode"
            copy = median_us(lambda _: PieceCache(tok).pieces.update(before[0]), text, args.repeats)
            rows.append(
                {
                    "turn": turn,
                    "chars": len(text),
                    "tokens": len(ids),
                    "whole_us": round(median_us(tok.encode, text, args.repeats), 1),
                    "cached_us": round(median_us(cached, text, args.repeats) - copy, 1),
                }
            )
            history.append({"role": "assistant", "content": texts[2 * turn + 2][: args.chars]})
        print(json.dumps({"vocab": vocab, "turns": rows}), flush=True)


if __name__ == "__main__":
    main()
