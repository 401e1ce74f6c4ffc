"""Byte-level BPE: exact round trip on any text, atomic special tokens, fixed ids, hash-checked loading."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest
from tokenizers import AddedToken

from microgpt.data.tokenizer import (
    MAX_TRAIN_RUN,
    SPECIAL_TOKENS,
    ByteTokenizer,
    PieceCache,
    TokenizerError,
    bounded_runs,
    load_tokenizer,
    train_bpe,
)

CORPUS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. " * 20, "naïve café 東京"]
HARD = [
    "",
    "  leading spaces and trailing \n\n\t",
    "<|im_start|>user\nHi 😀 ünï<|im_end|>\n<|im_start|>assistant\n  x<|im_end|>\n<|endoftext|>",
    "never seen bytes: \x00\x01 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﷽",
    "<|im_start|><|im_start|>",
    "<|im_sta",  # a prefix of a special token is ordinary text
]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(CORPUS, 300).save(path)
    return path


def test_round_trip_and_special_ids(tok_path: Path) -> None:
    tok = load_tokenizer(tok_path)
    assert tok.vocab_size == 300
    assert [tok.tok.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3]
    for text in HARD:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("<|im_start|>assistant\nok<|im_end|>")
    assert ids[0] == tok.im_start_id and ids[-1] == tok.im_end_id and ids.count(tok.im_start_id) == 1
    batch = tok.encode_batch(HARD)
    assert [b.tolist() for b in batch] == [tok.encode(t) for t in HARD]


def test_training_is_deterministic(tok_path: Path, tmp_path: Path) -> None:
    train_bpe(CORPUS, 300).save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == tok_path.read_bytes()


def test_run_record_and_bad_files(tok_path: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(tok_path)
    assert load_tokenizer({"path": str(tok_path), "sha256": tok.sha256}).vocab_size == 300
    with pytest.raises(TokenizerError, match="field 'sha256' differs"):
        load_tokenizer({"path": str(tok_path), "sha256": "0" * 64})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError) as exc:
        load_tokenizer(tmp_path / "bad.json")
    assert str(exc.value).startswith(f"{tmp_path / 'bad.json'}: not a tokenizers tokenizer.json") and "\n" not in str(
        exc.value
    )
    with pytest.raises(TokenizerError, match="vocab_size must be"):
        train_bpe(CORPUS, 200)


def test_bounded_runs_cut_only_long_runs() -> None:
    n = MAX_TRAIN_RUN
    texts = ["ordinary text, " * 100, "x" * (3 * n + 5) + " tail", " " * (n + 1) + "é" * (2 * n)]
    pieces = list(bounded_runs(texts))
    assert pieces[0] == texts[0]  # nothing to cut: passed whole, so its counts are what they were
    assert "".join(pieces[1:]) == texts[1] + texts[2]  # cut, never changed
    assert max(len(r) for p in pieces for r in re.findall(r"\S+|\s+", p)) == n


def test_training_is_linear_in_a_line_without_whitespace() -> None:
    """tokenizers' trainer costs the square of a piece: a 200,000-character word took tens of seconds (a 3 MB
    minified file, hours). Cut into bounded runs it trains in well under a second; 10 s is a loaded CI's margin."""
    for line in ("a" * 200_000, "é" * 200_000):
        t0 = time.perf_counter()
        tok = train_bpe([line], 300)
        assert time.perf_counter() - t0 < 10
        assert tok.decode(tok.encode(line[:5000])) == line[:5000]


def _texts(rng: random.Random, n: int) -> list[str]:
    """Text cut anywhere, with special tokens, their prefixes and whitespace between the cuts."""
    seps = [*SPECIAL_TOKENS, " ", "\n", "  \n", "<|im_", "|>", "<|endoftext|", "<<|im_end|>>", ""]
    src = "".join(CORPUS + HARD)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 6)):
            a = rng.randrange(len(src))
            parts += [src[a : a + rng.randint(0, 40)], rng.choice(seps)]
        out.append("".join(parts))
    return out


def test_piece_cache_encodes_as_the_tokenizer_does(tok_path: Path) -> None:
    tok = load_tokenizer(tok_path)
    pieces = PieceCache(tok, max_chars=64)  # small: pieces are dropped and encoded again as the texts go on
    texts = HARD + _texts(random.Random(0), 400)
    for text in texts + texts:  # the second round reads what the first kept
        assert pieces.encode(text) == tok.encode(text), repr(text)
    assert 0 < pieces.chars <= 64 and pieces.chars == sum(map(len, pieces.pieces))


def test_piece_cache_encodes_a_chats_history_once() -> None:
    from microgpt.data.chatml import prompt_text

    tok = train_bpe(CORPUS, 300)
    pieces = PieceCache(tok)
    history = [{"role": "system", "content": CORPUS[1]}]
    for turn in range(4):
        history.append({"role": "user", "content": f"turn {turn}: {CORPUS[turn % 3]}"})
        text = prompt_text(history)
        kept = dict(pieces.pieces)
        assert pieces.encode(text) == tok.encode(text)
        new = [p for p in pieces.pieces if p not in kept]
        # after the first turn, what a turn encodes is what is new to it: its message and the last reply
        assert turn == 0 or sorted(new) == sorted(
            [f"assistant\nreply {turn - 1}", f"user\nturn {turn}: {CORPUS[turn % 3]}"]
        )
        history.append({"role": "assistant", "content": f"reply {turn}"})


def test_piece_cache_encodes_whole_where_a_special_token_strips_spaces(tok_path: Path) -> None:
    tok = load_tokenizer(tok_path)
    tok.tok.add_special_tokens([AddedToken("<|sep|>", rstrip=True, lstrip=True)])
    pieces = PieceCache(tok)
    assert pieces.split is None  # "a <|sep|> b": the token takes the spaces, which the plain string's split keeps
    for text in ["a <|sep|> b<|im_end|>\n", "x<|sep|>y", *HARD]:
        assert pieces.encode(text) == tok.encode(text)
    assert PieceCache(ByteTokenizer()).encode("<|im_end|> é") == ByteTokenizer().encode("<|im_end|> é")
