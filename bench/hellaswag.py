"""HellaSwag timing: `microgpt eval --hellaswag` against Hugging Face transformers scoring the same file with the
same model (the checkpoint as `microgpt export` writes it), one JSON line per side on stdout.

    python3 bench/hellaswag.py                                  # ANDREA-120M at random init, 10,042 examples
    python3 bench/hellaswag.py --backend triton                 # microgpt's eval on the GPU (eval's --backend)
    python3 bench/hellaswag.py --ckpt runs/x --file hellaswag_val.jsonl --work /tmp/hs   # a run, the real file

The file: --file as it is (the real validation set is
https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl), or --examples of them written
in its layout to WORK/hellaswag.jsonl: one object a line with ind, activity_label, ctx_a, ctx_b, ctx (ctx_a + " " +
ctx_b), split "val", split_type, label (0-3), endings (4) and source_id. The text is spans of the built-in corpus's
stdlib documents (whitespace collapsed to single spaces, as the real file's one-line prose), drawn by --seed in
tokens of the checkpoint's tokenizer: a context of 40-120 tokens, and as endings its true continuation and three
spans from elsewhere, 10-40 tokens each (a trained model scores above chance on it; a random one near 25%).

The model: --ckpt (a checkpoint or run folder), or WORK/ckpt/step-00000000.bin: ANDREA-120M's model
(experiments/ANDREA-120M-TRAIN.json; --shape tiny for the CPU test) at params.init_weights(--seed), with a
byte-level BPE of at most the model's vocab_size entries trained on the same corpus (data/tokenizer.train_bpe).

microgpt: `python3 -m microgpt eval CKPT --hellaswag FILE --json [--backend B]` in a subprocess, as a user runs it;
its seconds are the process's wall time (start, checkpoint load, tokenizing, scoring). transformers:
GPT2LMHeadModel.from_pretrained on the exported folder, bf16 with SDPA on a GPU or fp32 on the CPU, in this
process; its seconds run from from_pretrained to the last score. It scores by evaluate.py's rule with
data/hellaswag.tokenize (context + " " + ending, the last seq_len + 1 tokens; only the ending's tokens scored) on
the folder's tokenizer: acc picks the lowest sum of the ending's token losses, acc_norm the lowest mean. Examples
are sorted by length and packed, 4 rows each, into batches of at most --hf-tokens tokens, right-padded (a causal
model: what follows a row's tokens changes nothing in them). agree counts the examples where both sides pick the
same ending by the sum: microgpt's correct count on a copy of the file whose labels are transformers' picks (a
second eval run, whose wall time is seconds_again: the same work, with Triton's kernel cache warm).

A side that fails prints its line with "error" (the other side's line still comes); the exit code is then 1. Bad
input (a file, a checkpoint, a --work that is not empty) is one `error:` line and exit 2; a disk that refuses the
work folder's files, exit 4.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt import checkpoint, config  # noqa: E402
from microgpt.data import corpus  # noqa: E402
from microgpt.data.hellaswag_file import read, tokenize  # noqa: E402
from microgpt.data.tokenizer import file_sha256, load_tokenizer, train_bpe  # noqa: E402
from microgpt.engine import params  # noqa: E402
from microgpt.errors import ArgParser, InputError, check_number, exit_on_input_error, output_error  # noqa: E402
from microgpt.fileio import atomic_write_bytes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
N_REAL = 10_042  # the real validation file's examples
CTX_TOKENS, END_TOKENS = (40, 120), (10, 40)  # inclusive ranges of the drawn spans, in the checkpoint's tokens
TINY = {"name": "hellaswag-tiny", "model": {"vocab_size": 512, "d_model": 64, "n_layer": 2, "n_head": 2,
        "seq_len": 256}, "train": {"backend": "numpy", "precision": "fp32"}, "data": {"source": "builtin"}}  # fmt: skip
SHAPES = {"120m": REPO / "experiments" / "ANDREA-120M-TRAIN.json", "tiny": TINY}


def corpus_docs(max_bytes: int) -> list[str]:
    """The built-in corpus's stdlib documents (its first max_bytes), each on one line: whitespace runs -> " "."""
    settings = corpus.builtin_settings(256, 0.05, max_bytes)
    return [" ".join(doc.text.split()) for doc in corpus.builtin_sources(settings)[0][1]]


def make_checkpoint(work: Path, shape: str, seed: int, docs: list[str]) -> Path:
    """A step-0 checkpoint of the shape's model at init, with a BPE trained on docs beside it, as the trainer's
    sidecar records it (config, seed, tokenizer): what `microgpt eval` and `microgpt export` read."""
    src = SHAPES[shape]
    exp = config.load(src) if isinstance(src, Path) else config.from_dict(src, shape)
    m = exp.model
    tok = train_bpe(docs, min(m.vocab_size, 65536))
    tok.save(work / "tokenizer.json")
    record = {
        "kind": "bpe",
        "path": str((work / "tokenizer.json").resolve()),
        "sha256": file_sha256(work / "tokenizer.json"),
        "vocab_size": tok.vocab_size,
    }
    weights = params.init_weights(m, seed)
    zeros = np.zeros_like(weights)
    meta = {
        "config": exp.to_dict(),
        "seed": seed,
        "tokenizer": record,
        "backend": exp.train.backend,
        "precision": exp.train.precision,
        "reason": "init (bench/hellaswag.py)",
        "params": [[name, list(s)] for name, s in params.param_shapes(m)],
    }
    return checkpoint.write_checkpoint(work / "ckpt" / checkpoint.ckpt_name(0), 0, weights, zeros, zeros, meta)


class Words:
    """docs as words with their token counts (each " " + word alone: GPT-2's pre-tokenizer splits at the spaces,
    so a run of words costs about the sum), for spans of a given token length that start and end at words."""

    def __init__(self, tok: Any, docs: list[str], need: int) -> None:
        words = [d.split(" ") for d in docs]
        csum = [
            np.concatenate([[0], np.cumsum([len(a) for a in tok.encode_batch([" " + w for w in ws])])]) for ws in words
        ]
        keep = [i for i, c in enumerate(csum) if c[-1] > need]
        if not keep:
            raise InputError(f"--corpus-bytes: no document of more than {need} tokens to draw examples from")
        self.words, self.csum = [words[i] for i in keep], [csum[i] for i in keep]
        self.p = np.array([c[-1] for c in self.csum], np.float64) / sum(c[-1] for c in self.csum)

    def start(self, rng: np.random.Generator, room: int) -> tuple[int, int]:
        """(document, word) drawn by token count, with at least room tokens from the word to the document's end."""
        doc = int(rng.choice(len(self.words), p=self.p))
        c = self.csum[doc]
        return doc, int(rng.integers(0, max(1, int(np.searchsorted(c, c[-1] - room, side="right")))))

    def span(self, doc: int, word: int, n_tokens: int) -> tuple[str, int]:
        """The words from `word` on that first reach n_tokens (at least one), and the index of the word after."""
        c = self.csum[doc]
        end = min(max(int(np.searchsorted(c, c[word] + n_tokens)), word + 1), len(self.words[doc]))
        return " ".join(self.words[doc][word:end]), end


def make_examples(tok: Any, docs: list[str], n: int, seed: int) -> list[dict[str, Any]]:
    """n examples in the real file's layout (the module's docstring), drawn from docs by seed."""
    rng = np.random.default_rng(seed)
    W = Words(tok, docs, CTX_TOKENS[1] + END_TOKENS[1])
    out = []
    for ind in range(n):
        n_ctx, n_end = int(rng.integers(CTX_TOKENS[0], CTX_TOKENS[1] + 1)), rng.integers(*END_TOKENS, 4, endpoint=True)
        doc, word = W.start(rng, n_ctx + END_TOKENS[1])
        ctx, after = W.span(doc, word, n_ctx)
        label = int(rng.integers(4))
        endings = [W.span(*W.start(rng, int(e)), int(e))[0] for e in n_end]
        endings[label] = W.span(doc, after, int(n_end[label]))[0]  # the context's own continuation
        words = ctx.split(" ")
        k = min(int(rng.integers(1, 4)), len(words) - 1)  # ctx_b: the last 1-3 words, which the endings go on from
        ctx_a, ctx_b = " ".join(words[: len(words) - k]), " ".join(words[len(words) - k :])
        out.append(
            {
                "ind": ind,
                "activity_label": f"builtin corpus document {doc}",
                "ctx_a": ctx_a,
                "ctx_b": ctx_b,
                "ctx": f"{ctx_a} {ctx_b}".strip(),
                "split": "val",
                "split_type": ["indomain", "zeroshot"][int(rng.integers(2))],
                "label": label,
                "endings": endings,
                "source_id": f"builtin~{doc}-{word}",
            }
        )
    return out


def write_jsonl(path: Path, examples: list[dict[str, Any]]) -> None:
    atomic_write_bytes(path, ["".join(json.dumps(ex) + "\n" for ex in examples).encode()])


def lengths(tok: Any, examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Token counts of the contexts and of the endings (" " + ending, as they are scored): min, mean, max."""
    ctx = [len(a) for a in tok.encode_batch([ex["ctx"] for ex in examples])]
    ends = [len(a) for a in tok.encode_batch([" " + e for ex in examples for e in ex["endings"]])]
    return {f"{k}_tokens": [min(v), round(float(np.mean(v)), 1), max(v)] for k, v in (("ctx", ctx), ("ending", ends))}


def microgpt_eval(ckpt: Path, path: Path, backend: str | None, timeout: int) -> dict[str, Any]:
    """`microgpt eval CKPT --hellaswag PATH --json` as a subprocess: its JSON and its wall time, or its error."""
    cmd = [sys.executable, "-m", "microgpt", "eval", str(ckpt), "--hellaswag", str(path), "--json"]
    cmd += ["--backend", backend] if backend else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout}s", "command": " ".join(cmd)}
    seconds = time.perf_counter() - t0
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or not lines:
        sys.stderr.write(p.stderr[-3000:])
        tail = p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        return {"error": tail[0], "command": " ".join(cmd)}
    return {**lines[-1], "seconds": seconds, "command": " ".join(cmd)}


class Encoded:
    """A tokenizer for data/hellaswag.tokenize over strings encoded in one batched call beforehand."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        self.ids = dict(zip(texts, tok(texts, add_special_tokens=False)["input_ids"]))

    def encode(self, text: str) -> list[int]:
        return self.ids[text]


def hf_batches(rows: list[tuple[list[list[int]], list[int]]], budget: int) -> list[list[int]]:
    """The scorable examples (every ending has a token to score), sorted by their longest row and packed so that a
    batch's 4 * examples * longest row stays within budget tokens (at least one example a batch)."""
    longest = {e: max(len(s) - 1 for s in seqs) for e, (seqs, n_end) in enumerate(rows) if min(n_end) > 0}
    out: list[list[int]] = []
    for e in sorted(longest, key=longest.get):
        if out and 4 * (len(out[-1]) + 1) * longest[e] <= budget:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def hf_score(folder: Path, examples: list[dict[str, Any]], device: str, budget: int) -> dict[str, Any]:
    """transformers' acc and acc_norm on the examples, its picks by the sum (-1: unscored), and its seconds."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, GPT2LMHeadModel

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = GPT2LMHeadModel.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    load_s = time.perf_counter() - t0
    T = model.config.n_positions
    enc = Encoded(tok, sorted({s for ex in examples for s in [ex["ctx"], *(" " + e for e in ex["endings"])]}))
    rows = [(it.seqs, it.n_end) for it in tokenize(examples, enc, T)]
    sums, means = np.full((len(examples), 4), np.inf), np.full((len(examples), 4), np.inf)
    with torch.inference_mode():
        for batch in hf_batches(rows, budget):
            t = max(len(s) - 1 for e in batch for s in rows[e][0])
            x, y = np.zeros((4 * len(batch), t), np.int64), np.full((4 * len(batch), t), -1, np.int64)
            for k, e in enumerate(batch):
                for r, (seq, n_end) in enumerate(zip(*rows[e])):
                    x[4 * k + r, : len(seq) - 1] = seq[:-1]
                    y[4 * k + r, len(seq) - 1 - n_end : len(seq) - 1] = seq[len(seq) - n_end :]
            yt = torch.from_numpy(y).to(device)
            logits = model(input_ids=torch.from_numpy(x).to(device), use_cache=False).logits
            losses = F.cross_entropy(logits.float().transpose(1, 2), yt, ignore_index=-1, reduction="none")
            s = losses.sum(dim=1, dtype=torch.float64).cpu().numpy().reshape(-1, 4)
            sums[batch], means[batch] = s, s / (y >= 0).sum(axis=1).reshape(-1, 4)
    seconds = time.perf_counter() - t0
    scored = np.isfinite(sums).all(axis=1)
    picks, labels = np.where(scored, np.argmin(sums, axis=1), -1), np.array([ex["label"] for ex in examples])
    correct, correct_norm = int((picks == labels).sum()), int((scored & (np.argmin(means, axis=1) == labels)).sum())
    n = len(examples)
    return {
        "examples": n,
        "seconds": seconds,
        "load_s": load_s,
        "examples_per_s": n / seconds,
        "acc": correct / n,
        "acc_norm": correct_norm / n,
        "correct": correct,
        "correct_norm": correct_norm,
        "unscored": int((~scored).sum()),
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "picks": picks.tolist(),
    }


def export(ckpt: Path, out: Path, timeout: int) -> None:
    """`microgpt export CKPT --out OUT` (fp32 weights), as a user runs it."""
    cmd = [sys.executable, "-m", "microgpt", "export", str(ckpt), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"microgpt export: {(p.stderr.strip().splitlines() or [f'exit {p.returncode}'])[-1]}")


def transformers_side(ckpt: Path, work: Path, examples: list[dict[str, Any]], args: argparse.Namespace) -> dict:
    try:
        import torch

        export(ckpt, work / "hf", args.timeout)
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        budget = args.hf_tokens or (16384 if device == "cuda" else 2048)
        return hf_score(work / "hf", examples, device, budget)
    except Exception as e:  # the side's line says what broke; microgpt's line still comes
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}


def agreement(ckpt: Path, work: Path, file: Path, picks: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """microgpt's eval on the file relabeled with transformers' picks: its correct count is the agreement."""
    relabeled = []
    for line, pick in zip((ln for ln in file.read_text(encoding="utf-8").splitlines() if ln.strip()), picks):
        relabeled.append({**json.loads(line), "label": max(pick, 0)})  # unscored by transformers: never agrees
    write_jsonl(work / "hellaswag-agree.jsonl", relabeled)
    return microgpt_eval(ckpt, work / "hellaswag-agree.jsonl", args.backend, args.timeout)


def prepare(work: Path, args: argparse.Namespace) -> tuple[Path, Path, dict[str, Any]]:
    """(checkpoint, file, the file's token lengths): --ckpt and --file as given, or made in work."""
    file = Path(args.file) if args.file else work / "hellaswag.jsonl"
    given = read(file, "--file") if args.file else None  # a bad file is refused before anything is made
    ckpt = checkpoint.resolve(args.ckpt) if args.ckpt else None
    docs = corpus_docs(args.corpus_bytes) if not (ckpt and given) else []
    ckpt = ckpt or make_checkpoint(work, args.shape, args.seed, docs)
    tok = load_tokenizer(checkpoint.read_sidecar(ckpt).get("tokenizer", {}))
    if given is None:
        write_jsonl(file, make_examples(tok, docs, args.examples, args.seed))
    stats = lengths(tok, given or read(file, "--file"))
    print(f"hellaswag: {file} ({stats}), checkpoint {ckpt}", file=sys.stderr, flush=True)
    return ckpt, file, stats


def parser() -> ArgParser:
    p = ArgParser(prog="bench/hellaswag.py", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="a checkpoint or run folder (default: SHAPE's model at init, made in --work)")
    p.add_argument("--file", help="a HellaSwag JSONL file (default: --examples drawn from the built-in corpus)")
    p.add_argument("--shape", choices=list(SHAPES), default="120m", help="the model made without --ckpt")
    p.add_argument("--examples", type=int, default=N_REAL, help="examples written without --file")
    p.add_argument("--seed", type=int, default=0, help="the init and the drawn examples")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000, help="built-in corpus text for tokenizer and file")
    p.add_argument("--backend", help="passed to `microgpt eval --backend` (default: eval's own)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="transformers' device")
    p.add_argument("--hf-tokens", type=int, help="transformers' tokens a batch (default: 16384 GPU, 2048 CPU)")
    p.add_argument("--work", help="an empty or new folder for the files, kept (default: a temp folder, removed)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds for each microgpt subprocess")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    for flag, value in (
        ("--examples", args.examples),
        ("--corpus-bytes", args.corpus_bytes),
        ("--hf-tokens", args.hf_tokens),
        ("--timeout", args.timeout),
    ):
        if value is not None:
            check_number(value, flag, 1, None, integer=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hellaswag-bench."))
    if args.work and work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise InputError(f"--work {work}: exists and is not an empty folder (nothing overwritten)")
    try:
        work.mkdir(parents=True, exist_ok=True)
        ckpt, file, stats = prepare(work, args)
        mine = microgpt_eval(ckpt, file, args.backend, args.timeout)
        theirs = transformers_side(ckpt, work, read(file, "--file"), args)
        if "error" not in mine and "error" not in theirs:
            again = agreement(ckpt, work, file, theirs["picks"], args)
            if "error" in again:
                mine["agree_error"] = again["error"]
            else:
                mine["seconds_again"], mine["agree"] = again["seconds"], again["correct"]
                theirs["agree"] = again["correct"]
    except OSError as e:
        raise output_error(e, f"--work {work}: cannot write") from None
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    theirs.pop("picks", None)
    for side, res in (("microgpt", mine), ("transformers", theirs)):
        if "seconds" in res and "examples" in res:
            res["examples_per_s"] = res["examples"] / res["seconds"]
        print(json.dumps({"side": side, "file": str(file), "ckpt": str(ckpt), **stats, **res}), flush=True)
    return 1 if "error" in mine or "error" in theirs else 0


if __name__ == "__main__":
    sys.exit(exit_on_input_error(main, sys.argv[1:]))
