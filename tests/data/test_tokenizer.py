"""Byte-level BPE: exact round trip on any text, atomic special tokens, fixed ids, hash-checked loading."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from microgpt.data.tokenizer import (
    MAX_TRAIN_RUN,
    SPECIAL_TOKENS,
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
