"""prep: mixed sources -> shards that decode back to exactly the rendered documents; masks; determinism."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from microgpt.data import prep, pull, shards
from microgpt.data.chatml import parse_record, render
from microgpt.data.sources import Doc, SourceError
from microgpt.data.tokenizer import EOT, IM_END, TokenizerError, load_tokenizer
from tests.conftest import cli
from tests.data.fixtures import GOOD_JSONL, write_jsonl

TEXTS = ["plain text document one.\nWith two lines.", "Zwei: ünïcödé text ✓ and code: def f(x): return x"]
OPENAI = [
    {"messages": [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "Two."}]},
    {"messages": [{"role": "system", "content": "Brief."}, {"role": "user", "content": "Hi"}]},  # no assistant
]


def make_sources(tmp: Path) -> None:
    """Hermes-3 (normalized by pull-hermes3, weight 2), a folder of plain text, OpenAI-messages JSONL."""
    write_jsonl(tmp / "raw.jsonl")
    pull.main(["--from", str(tmp / "raw.jsonl"), "--out", str(tmp / "hermes.jsonl")])
    (tmp / "texts").mkdir()
    for i, t in enumerate(TEXTS):
        (tmp / "texts" / f"{i}.txt").write_text(t, encoding="utf-8")
    (tmp / "oa.jsonl").write_text("\n".join(json.dumps(r) for r in OPENAI) + "\n")


def run_prep(tmp: Path, out: str, *extra: str) -> Path:
    argv = ["--out", str(tmp / out), "--vocab-size", "320", "--shard-tokens", "61", "--val-fraction", "0.3"]
    argv += ["--loss-mask", "--quiet", *extra]
    for spec in (f"{tmp / 'hermes.jsonl'}@2", str(tmp / "texts"), str(tmp / "oa.jsonl")):
        argv += ["--source", spec]
    assert prep.main(argv) == 0
    return tmp / out


def expected_docs() -> Counter:
    chats = [render(parse_record(r))[0] for r in GOOD_JSONL] * 2  # weight 2
    # oa.jsonl keeps one conversation: a source of one document is split into train and val parts
    chats += [d.text for d in prep.split_document(Doc(*render(parse_record(OPENAI[0]))), 0.3, "oa.jsonl")]
    return Counter(chats + TEXTS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("prep")
    make_sources(tmp)
    return run_prep(tmp, "out")


def test_shards_decode_back_to_the_rendered_documents(corpus: Path) -> None:
    tok = load_tokenizer(corpus / "tokenizer.json")
    manifest = json.loads((corpus / "manifest.json").read_text())
    seen: Counter = Counter()
    for split in ("train", "val"):
        paths = shards.list_shards(corpus, split)
        assert [p.name for p in paths] == manifest["splits"][split]["shards"]
        ids = shards.read_tokens(paths, tok.vocab_size)
        assert len(ids) == manifest["splits"][split]["tokens"]
        text = tok.decode(ids)
        assert text.startswith(EOT)
        docs = text.split(EOT)[1:]
        assert len(docs) == manifest["splits"][split]["documents"]
        seen.update(docs)
    assert len(shards.list_shards(corpus, "train")) > 3  # 97-token shards: documents span shard boundaries
    assert seen == expected_docs()


def test_manifest_counts(corpus: Path) -> None:
    m = json.loads((corpus / "manifest.json").read_text())
    by_name = {Path(s["name"]).name: s for s in m["sources"]}
    h, t, o = by_name["hermes.jsonl"], by_name["texts"], by_name["oa.jsonl"]
    assert (h["documents_read"], h["weight"], sum(h["documents"].values())) == (4, 2.0, 8)
    assert (t["kind"], t["documents_read"], sum(t["documents"].values())) == ("text", 2, 2)
    assert o["documents_read"] == 1 and o["skipped_by_reason"] == {"no assistant turn": 1}
    assert m["skipped"] == 1 and m["vocab_size"] == 320 and m["tokenizer_trained"]
    assert sum(sum(s["tokens"].values()) for s in m["sources"]) == sum(v["tokens"] for v in m["splits"].values())
    assert m["special_tokens"] == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|pad|>": 3}


def test_loss_mask_keeps_assistant_content_and_im_end(corpus: Path) -> None:
    tok = load_tokenizer(corpus / "tokenizer.json")
    kept: Counter = Counter()
    for split in ("train", "val"):
        paths = shards.list_shards(corpus, split)
        ids = shards.read_tokens(paths)
        mask = np.concatenate([shards.open_shard(shards.mask_path(p), "mask") for p in paths])
        assert len(mask) == len(ids)
        starts = np.flatnonzero(ids == tok.eot_id).tolist() + [len(ids)]
        for a, b in zip(starts[:-1], starts[1:]):  # one document each; decode only its masked-in tokens
            kept[tok.decode(ids[a:b][mask[a:b] == 1])] += 1
    want: Counter = Counter()
    for record in GOOD_JSONL * 2 + OPENAI[:1]:
        want["".join(m["content"] + IM_END for m in parse_record(record) if m["role"] == "assistant")] += 1
    want[""] += len(TEXTS) + 1  # plain text has no assistant tokens, nor the user half of oa.jsonl's conversation
    assert kept == want


def test_deterministic_and_tokenizer_reuse(corpus: Path, tmp_path: Path) -> None:
    again = run_prep(corpus.parent, "again")
    for f in sorted(p.name for p in corpus.iterdir()):
        assert (corpus / f).read_bytes() == (again / f).read_bytes(), f
    reused = run_prep(corpus.parent, "reused", "--tokenizer", str(corpus / "tokenizer.json"), "--seed", "5")
    m = json.loads((reused / "manifest.json").read_text())
    assert not m["tokenizer_trained"]
    assert m["tokenizer_sha256"] == json.loads((corpus / "manifest.json").read_text())["tokenizer_sha256"]
    assert (reused / "train_000000.bin").read_bytes() != (corpus / "train_000000.bin").read_bytes()  # other seed


def test_a_killed_preps_temp_folder_is_removed_by_the_next(tmp_path: Path) -> None:
    """A prep killed mid-run leaves `.<out>.tmp-<pid>`; the next prep into the same --out removes it (its process is
    gone), and leaves a running prep's folder alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".builtin.tmp-{dead.pid}"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "train_000000.bin").write_bytes(b"x" * 100)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    running = tmp_path / f".builtin.tmp-{alive.pid}"
    running.mkdir()
    other = tmp_path / ".builtin-notes.tmp-1"  # not prep's name pattern for this --out
    other.mkdir()
    out = tmp_path / "builtin"
    try:
        assert (
            prep.main(["--builtin", "--out", str(out), "--vocab-size", "400", "--max-bytes", "20000", "--quiet"]) == 0
        )
    finally:
        alive.kill()
        alive.wait()
    assert not stale.exists() and running.is_dir() and other.is_dir() and (out / "manifest.json").is_file()


def test_builtin_small(tmp_path: Path) -> None:
    out = tmp_path / "builtin"
    assert prep.main(["--builtin", "--out", str(out), "--vocab-size", "400", "--max-bytes", "60000", "--quiet"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert [s["kind"] for s in m["sources"]] == ["stdlib", "synthetic-chat"]
    assert m["sources"][1]["documents_read"] == 60000 // 800 and m["loss_mask"]
    tok = load_tokenizer(out / "tokenizer.json")
    text = tok.decode(shards.read_tokens(shards.list_shards(out, "train")))
    assert "<|im_start|>assistant\n" in text and "def " in text
    assert m["build"]["max_bytes"] == 60000


def test_bad_inputs_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(SourceError) as exc:
        prep.main(["--source", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")])
    assert str(exc.value) == f"{tmp_path / 'nope.jsonl'}: source not found (--source {tmp_path}/nope.jsonl)"
    (tmp_path / "bad.json").write_text('{"vocab": 1}')
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(TokenizerError) as exc:
        prep.main(
            [
                "--source",
                str(tmp_path / "t.txt"),
                "--out",
                str(tmp_path / "o"),
                "--tokenizer",
                str(tmp_path / "bad.json"),
            ]
        )
    assert str(exc.value).startswith(f"{tmp_path / 'bad.json'}: not a tokenizers tokenizer.json")
    assert not (tmp_path / "o").exists()


def test_prep_builtin_with_experiment_fills_the_train_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from microgpt import config, data
    from tests.conftest import write_experiment

    monkeypatch.setenv("MICROGPT_DATA_DIR", str(tmp_path / "cache"))
    exp_file = write_experiment(tmp_path, model={"vocab_size": 300}, data={"source": "builtin", "max_bytes": 30000})
    assert prep.main(["--builtin", "--experiment", str(exp_file), "--quiet"]) == 0
    exp = config.load(exp_file)
    folder = data.shard_dir(exp)
    before = (folder / "manifest.json").stat().st_mtime_ns
    data.make_loaders(exp, 2)  # what `microgpt train` calls: finds the corpus, does not rebuild it
    assert (folder / "manifest.json").stat().st_mtime_ns == before
    with pytest.raises(prep.PrepError, match="BPE needs more than 260 entries"):
        prep.main(["--builtin", "--experiment", str(write_experiment(tmp_path, model={"vocab_size": 258}))])
    # 256 entries: the same corpus as raw bytes, in the cache folder the train command reads
    exp = config.load(
        write_experiment(tmp_path, model={"vocab_size": 256}, data={"source": "builtin", "max_bytes": 30000})
    )
    assert prep.main(["--builtin", "--experiment", str(tmp_path / "exp.json"), "--quiet"]) == 0
    m = json.loads((data.shard_dir(exp) / "manifest.json").read_text())
    assert m["tokenizer"] == "bytes" and m["vocab_size"] == 256 and m["build"]["tokenizer"] == "bytes"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--source", "nope.jsonl", "--out", "o"], "error: nope.jsonl: source not found (--source nope.jsonl)"),
        (
            ["--builtin", "--vocab-size", "300", "--val-fraction", "1.5"],
            "error: --val-fraction must be a finite number in (0, 1), got 1.5",
        ),
        (["--check", "empty"], "error: empty: no train_*.bin or val_*.bin shards found"),
        (
            ["--out", "o"],
            "error: prep needs --builtin, --source PATH[@W] or --builtin-chats N (and --out DIR without "
            "--builtin), or --experiment FILE alone (its data.prep)",
        ),
    ],
)
def test_cli_bad_input_is_one_error_line_and_exit_2(tmp_path: Path, argv: list[str], message: str) -> None:
    (tmp_path / "empty").mkdir()
    r = cli("prep", *argv, cwd=tmp_path)
    assert (r.returncode, r.stderr.splitlines()) == (2, [message]), r.stderr
    assert not (tmp_path / "o").exists()


def test_a_record_with_a_lone_surrogate_is_skipped_not_a_traceback(tmp_path: Path) -> None:
    """A JSON string escape of half a UTF-16 pair ("\\ud800") is no text: the tokenizer's trainer died on it with a
    traceback (issue 57). The strict JSON reader refuses it, so the record is skipped and counted like any bad one."""
    records = [{"text": f"hello world number {i} " * 20} for i in range(50)] + [{"text": "bad \ud800 here"}]
    (tmp_path / "src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    res = cli("prep", "--source", str(tmp_path / "src.jsonl"), "--out", str(tmp_path / "out"), "--vocab-size", "300")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    (source,) = json.loads((tmp_path / "out" / "manifest.json").read_text())["sources"]
    assert source["skipped_by_reason"] == {"invalid json": 1} and source["documents_read"] == 50
