"""The built-in corpus is defined once: the byte tokenizer and a BPE see the same documents in the same split."""

from __future__ import annotations

from pathlib import Path

from microgpt.data import corpus, prep, shards
from microgpt.data.tokenizer import EOT, ByteTokenizer, load_tokenizer


def documents(folder: Path, split: str, tokenizer: str) -> list[str]:
    ids = shards.read_tokens(shards.list_shards(folder, split))
    if tokenizer == "bytes":
        return ByteTokenizer().decode(ids).split("\0")[1:]
    return load_tokenizer(folder / "tokenizer.json").decode(ids).split(EOT)[1:]


def test_bytes_and_bpe_share_documents_and_split(tmp_path: Path) -> None:
    built = {}
    for tokenizer, vocab in (("bytes", 256), ("", 320)):
        settings = corpus.builtin_settings(vocab, 0.1, 30_000, tokenizer)
        how = prep.PrepSettings(tokenizer=tokenizer, vocab_size=vocab, val_fraction=0.1, loss_mask=True, quiet=True)
        manifest = prep.prepare(corpus.builtin_sources(settings), tmp_path / (tokenizer or "bpe"), how)
        built[tokenizer] = {s: documents(tmp_path / (tokenizer or "bpe"), s, tokenizer) for s in ("train", "val")}
        assert manifest["vocab_size"] == vocab and manifest["tokenizer"] == ("bytes" if tokenizer else "tokenizer.json")
    assert built["bytes"] == built[""]
    val = built["bytes"]["val"]
    assert any("<|im_start|>assistant\n" in d for d in val) and any("def " in d for d in val)  # both sources
    assert corpus.builtin_dir(corpus.builtin_settings(256, 0.1, 30_000, "bytes")).name.startswith("v256-")
