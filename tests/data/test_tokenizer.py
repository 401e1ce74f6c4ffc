"""Byte-level BPE: exact round trip on any text, atomic special tokens, fixed ids, hash-checked loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from microgpt.data.tokenizer import SPECIAL_TOKENS, TokenizerError, load_tokenizer, train_bpe

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
