"""Bad input at every subcommand, in real subprocesses on real files (issue 14): exit code 2, exactly one stderr line
starting `error:`, and every file that was there before has the same sha256 after.

Sections follow the issue's classes: 1 checkpoints and sidecars, 2 experiment values, 3 prep and pull-hermes3,
4 sample / chat / eval / export. Locks (5) are in tests/test_runlock.py, a full disk (6) in tests/test_diskfull.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint, config
from microgpt.engine import memory, precision
from tests.conftest import REPO, TINY, cli, one_error, write_experiment


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under roots."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.is_dir() else [root] if root.exists() else []:
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def refused(res: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 and exactly one stderr line `error: ...` holding every needle; the line."""
    return one_error(res, 2, *needles)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run folder with checkpoints at steps 2 and 3 (trained once; tests copy it)."""
    root = tmp_path_factory.mktemp("trained")
    exp = write_experiment(root, train={"steps": 3, "ckpt_every": 2})
    res = cli("train", str(exp), "--out", str(root / "run"))
    assert res.returncode == 0, res.stderr
    return root


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(experiment, run folder, its step-3 checkpoint): a private copy of the trained run."""
    shutil.copytree(trained, tmp_path / "t")
    root = tmp_path / "t"
    return root / "exp.json", root / "run", root / "run" / "ckpt" / checkpoint.ckpt_name(3)


# --- 1. checkpoints and sidecars ------------------------------------------------------------------------------------
SIDECARS = {
    "a list": b"[1, 2]",
    "a string": b'"step-3"',
    "config.model a list": None,  # built from the real sidecar below
    "tokenizer a string": None,
    "not UTF-8": b'{"config": "\xff\xfe"}',
    "a key twice": None,
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
}


def hostile_sidecar(kind: str, real: dict) -> bytes:
    if SIDECARS[kind] is not None:
        return SIDECARS[kind]
    if kind == "config.model a list":
        return json.dumps({**real, "config": {**real["config"], "model": [1, 2]}}).encode()
    if kind == "tokenizer a string":
        return json.dumps({**real, "tokenizer": "bytes"}).encode()
    text = json.dumps(real)
    return ('{"step": 99, ' + text[1:]).encode()  # a key twice: json.loads would keep one silently


@pytest.mark.parametrize("kind", list(SIDECARS))
def test_hostile_sidecar_for_resume_and_sample(run: tuple[Path, Path, Path], kind: str) -> None:
    exp, out, ck = run
    side = checkpoint.sidecar_path(ck)
    side.write_bytes(hostile_sidecar(kind, json.loads(side.read_text())))
    before = snapshot(out)
    refused(cli("train", str(exp), "--out", str(out), "--steps", "5", "--resume", str(ck)), str(side))
    refused(cli("sample", str(ck), "--tokens", "2"), str(side))
    assert snapshot(out) == before


def rewrite(ck: Path, section: str, value: float) -> None:
    """Set one value of the weights, Adam m or v, with the sidecar's sha256 kept in step (so that check passes)."""
    got = checkpoint.read_checkpoint(ck)
    arrays = {"weights": got.weights.copy(), "m": got.m.copy(), "v": got.v.copy()}
    arrays[section][5] = value
    side = checkpoint.read_sidecar(ck)
    meta = {k: v for k, v in side.items() if k not in ("format", "step", "n_params", "bin", "sha256")}
    checkpoint.write_checkpoint(ck, got.step, arrays["weights"], arrays["m"], arrays["v"], meta)


ADAM = [("m", np.nan, "Adam m"), ("v", np.inf, "Adam v"), ("v", -1e-3, "Adam v"), ("weights", np.nan, "weights")]


@pytest.mark.parametrize("section, value, needle", ADAM)
def test_adam_state_is_checked(run: tuple[Path, Path, Path], section: str, value: float, needle: str) -> None:
    exp, out, ck = run
    rewrite(ck, section, value)
    before = snapshot(out)
    refused(cli("train", str(exp), "--out", str(out), "--steps", "5", "--resume", str(ck)), str(ck), needle)
    refused(cli("sample", str(ck), "--tokens", "1"), str(ck), needle)
    assert snapshot(out) == before


def test_explicit_resume_checks_the_sha256(run: tuple[Path, Path, Path]) -> None:
    exp, out, ck = run
    data = bytearray(ck.read_bytes())
    data[100] ^= 1  # still a finite float: only the sha256 tells
    ck.write_bytes(bytes(data))
    before = snapshot(out)
    refused(cli("train", str(exp), "--out", str(out), "--steps", "5", "--resume", str(ck)), str(ck), "sha256")
    assert snapshot(out) == before


def test_resume_beyond_steps_is_complete_and_names_the_flag_or_the_field(run: tuple[Path, Path, Path]) -> None:
    """A checkpoint past --steps (the run was trained on further, `run --steps N`): complete, exit 0, nothing
    rewritten; the line names the flag or the field and how to train on."""
    exp, out, ck = run
    before = snapshot(out)
    for args, named in (
        (["--steps", "2", "--resume", str(ck)], "--steps 2"),
        (["--set", "train.steps=2", "--resume", "latest"], "train.steps 2"),
    ):
        res = cli("train", str(exp), "--out", str(out), *args)
        lines = res.stderr.splitlines()
        assert res.returncode == 0 and len(lines) == 1 and lines[0].startswith("already complete: "), res.stderr
        assert named in lines[0] and "step 3" in lines[0] and "--steps above 3 trains on" in lines[0]
    assert snapshot(out) == before


def test_a_finished_run_is_already_complete(run: tuple[Path, Path, Path]) -> None:
    """Issue 16: the newest checkpoint at train.steps: one line, exit 0, the final checkpoint not rewritten."""
    exp, out, ck = run
    before = snapshot(out)
    res = cli("train", str(exp), "--out", str(out), "--resume", "latest")
    assert res.returncode == 0 and res.stdout == "", res
    assert res.stderr.splitlines() == [res.stderr.strip()] and "already complete" in res.stderr
    assert snapshot(out) == before


# --- 2. experiment values -------------------------------------------------------------------------------------------
def text_with(field: str, literal: str) -> str:
    """The tiny experiment with train/model field set to a raw JSON literal (NaN, Infinity, ...)."""
    section, name = field.split(".")
    raw = json.loads(json.dumps(TINY))
    raw["train"].update(steps=3, ckpt_every=2)
    raw[section][name] = "@@"
    return json.dumps(raw).replace('"@@"', literal)


@pytest.mark.parametrize(
    "field, literal, needles",
    [
        ("train.eps", "NaN", ["'eps'", "finite"]),
        ("train.weight_decay", "Infinity", ["'weight_decay'", "finite"]),
        ("train.grad_clip", "-Infinity", ["'grad_clip'", "finite"]),
        ("train.lr", "NaN", ["'lr'", "finite"]),
        ("train.log_every", "0", ["train.log_every"]),
        ("train.seed", "-1", ["train.seed"]),
        ("train.steps", "4294967296", ["train.steps"]),
        ("model.seq_len", "1000000000000", ["memory plan", "bytes", "model.seq_len"]),
        ("model.d_model", "1099511627776", ["memory plan", "bytes"]),
        ("train.micro_batch", "1000000000", ["memory plan", "bytes", "train.micro_batch"]),
        ("model.vocab_size", "100000", ["model.vocab_size"]),
    ],
)
def test_bad_experiment_values(run: tuple[Path, Path, Path], field: str, literal: str, needles: list[str]) -> None:
    exp, out, ck = run
    exp.write_text(text_with(field, literal))
    before = snapshot(out, exp)
    resume = ["--resume", "latest"] if field.startswith("train.") else []  # a new model: its own folder
    where = out if resume else out.parent / "fresh"
    refused(cli("train", str(exp), "--out", str(where), "--steps", "5", *resume), *needles)
    assert snapshot(out, exp) == before and not list((out.parent / "fresh").glob("*/*"))


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"name": "a", "name": "b"}', "appears twice"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"model": {"d_model": 1' + "0" * 5000 + "}}", "invalid JSON"),
    ],
)
def test_experiment_json_is_strict(tmp_path: Path, text: str, needle: str) -> None:
    exp = tmp_path / "exp.json"
    exp.write_text(text)
    refused(cli("train", str(exp), "--out", str(tmp_path / "run")), str(exp), needle)
    refused(cli("run", str(exp), "--out", str(tmp_path / "run")), str(exp), needle)
    assert not (tmp_path / "run").exists()


def test_set_flag_is_named(run: tuple[Path, Path, Path]) -> None:
    exp, out, _ = run
    refused(cli("train", str(exp), "--out", str(out), "--set", "train.eps=NaN", "--resume", "latest"), "--set", "eps")
    refused(cli("train", str(exp), "--out", str(out), "--seed", "-5", "--resume", "latest"), "--seed", "train.seed")


# --- 3. prep and pull-hermes3 ---------------------------------------------------------------------------------------
@pytest.fixture
def texts(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"document {i} " * 20)
    return src


@pytest.mark.parametrize("weight", ["nan", "-1", "inf", "1e9"])
def test_prep_source_weight(tmp_path: Path, texts: Path, weight: str) -> None:
    refused(
        cli("prep", "--source", f"{texts}@{weight}", "--out", str(tmp_path / "o"), "--tokenizer", "bytes"),
        "--source",
        "weight",
    )
    assert not (tmp_path / "o").exists()


def test_prep_out_must_be_a_corpus_folder(tmp_path: Path, texts: Path) -> None:
    file = tmp_path / "file.txt"
    file.write_text("mine")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine too")
    before = snapshot(tmp_path)
    for out in (file, folder):
        refused(cli("prep", "--source", str(texts), "--out", str(out), "--tokenizer", "bytes"), f"--out {out}")
    refused(cli("prep", "--source", str(texts), "--bogus"), "unrecognized arguments")
    assert snapshot(tmp_path) == before


def test_pull_keeps_an_existing_output(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}))
    bad.write_text("not json\n")
    out = tmp_path / "out.jsonl"
    assert cli("pull-hermes3", "--from", str(good), "--out", str(out)).returncode == 0
    before = snapshot(tmp_path)
    refused(cli("pull-hermes3", "--from", str(bad), "--out", str(out)), "no valid conversation")
    refused(cli("pull-hermes3", "--from", str(good), "--out", str(tmp_path)), "--out", "folder")
    refused(cli("pull-hermes3", "--from", str(good), "--out", str(good / "x.jsonl")), "--out", "not a folder")
    refused(cli("pull-hermes3", "--bogus"), "unrecognized arguments")
    assert snapshot(tmp_path) == before


# --- 4. sample, chat, eval, export ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--tokens", "-1"], "--tokens"),
        (["--tokens", "1000000000"], "--tokens"),
        (["--top-k", "-2"], "--top-k"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_sample_flags(run: tuple[Path, Path, Path], flags: list[str], needle: str) -> None:
    _, out, _ = run
    refused(cli("sample", str(out), *flags), needle)
    refused(cli("chat", str(out), *flags, input=""), needle)


def test_sampling_edges_that_stay_valid(run: tuple[Path, Path, Path]) -> None:
    """Temperature 0 is greedy and top-k 0 is off: both run."""
    _, out, _ = run
    res = cli("sample", str(out), "--temperature", "0", "--top-k", "0", "--tokens", "3", "--prompt", "a")
    assert res.returncode == 0, res.stderr


def test_non_utf8_prompt_and_chat_line(run: tuple[Path, Path, Path]) -> None:
    _, out, _ = run
    res = subprocess.run(
        [sys.executable, "-m", "microgpt", "sample", str(out), "--prompt", b"caf\xe9"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    refused(res, "--prompt", "UTF-8")
    res = subprocess.run(
        [sys.executable, "-m", "microgpt", "chat", str(out), "--tokens", "2"],
        input=b"hi\n\xff\n",
        capture_output=True,
        cwd=REPO,
        timeout=300,
    )
    res.stderr = res.stderr.decode()
    refused(res, "stdin line 2", "UTF-8")


def test_missing_run_folder_is_named(tmp_path: Path) -> None:
    """Issue 16: a run folder that does not exist is 'no such run folder', not a missing sidecar."""
    for command in ("sample", "chat", "export", "eval"):
        extra = {"export": ["--out", str(tmp_path / "x")], "eval": ["--text", str(tmp_path / "t.txt")]}
        refused(cli(command, str(tmp_path / "nope"), *extra.get(command, []), input=""), "no such run folder")


def test_eval_and_export_share_the_checked_loader(run: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, out, ck = run
    side = checkpoint.sidecar_path(ck)
    side.write_text(json.dumps({**json.loads(side.read_text()), "tokenizer": "bytes"}))
    (tmp_path / "t.txt").write_text("some text " * 50)
    before = snapshot(out)
    refused(cli("export", str(ck), "--out", str(tmp_path / "hf")), str(side), "tokenizer")
    refused(cli("eval", str(ck), "--text", str(tmp_path / "t.txt")), str(side), "tokenizer")
    assert snapshot(out) == before and not (tmp_path / "hf").exists()


# --- 5. numbers from flags: type and range checked in one place (errors.check_number), issue 35 -------------------
@pytest.mark.parametrize(
    "command, flags, needle",
    [
        ("sample", ["--top-k", "1" + "0" * 30], "--top-k (0: off) must be an integer in [0, 2147483647]"),
        ("sample", ["--seed", str(2**64)], "--seed must be an integer in [0, 9223372036854775807]"),
        ("sample", ["--tokens", "1" + "0" * 20], "--tokens must be an integer in [0, 1000000]"),
        ("chat", ["--temperature=-inf"], "--temperature (0: greedy) must be a finite number"),
        ("eval", ["--text", "t.txt", "--windows", str(10**12)], "--windows must be an integer in [1, 2147483647]"),
        ("eval", ["--text", "t.txt", "--windows", "0"], "--windows must be an integer in [1, 2147483647], got 0"),
    ],
)
def test_numbers_out_of_range(run: tuple[Path, Path, Path], command: str, flags: list[str], needle: str) -> None:
    _, out, _ = run
    (out.parent / "t.txt").write_text("some text " * 20)
    before = snapshot(out)
    refused(cli(command, str(out), *flags, input="", cwd=out.parent), needle)
    assert snapshot(out) == before


def test_a_subnormal_temperature_samples_greedily(run: tuple[Path, Path, Path]) -> None:
    """5e-324 > 0 is a valid temperature: the logits are shifted before the division, so no inf - inf (NaN)."""
    _, out, _ = run
    tiny = cli("sample", str(out), "--temperature", "5e-324", "--tokens", "8", "--prompt", "ab", "--json")
    greedy = cli("sample", str(out), "--temperature", "0", "--tokens", "8", "--prompt", "ab", "--json")
    assert tiny.returncode == 0 and tiny.stderr == "", tiny.stderr
    assert json.loads(tiny.stdout)["text"] == json.loads(greedy.stdout)["text"]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--shard-tokens", "1" + "0" * 20], "--shard-tokens must be an integer in [1, 2147483647]"),
        (["--chunk", "0"], "--chunk must be an integer in [1, 2147483647], got 0"),
        (["--tokenizer-bytes", "-1"], "--tokenizer-bytes must be an integer in [1, 2147483647]"),
        (["--seed", str(2**64)], "--seed must be an integer in [0, 9223372036854775807]"),
        (["--val-fraction", "nan"], "--val-fraction must be a finite number"),
    ],
)
def test_prep_numbers_out_of_range(tmp_path: Path, texts: Path, flags: list[str], needle: str) -> None:
    refused(cli("prep", "--source", str(texts), "--out", str(tmp_path / "o"), "--tokenizer", "bytes", *flags), needle)
    assert not (tmp_path / "o").exists()


# --- 6. --procs: bounded by the machine and checked with the backend before any rank starts ------------------------
def half_the_host() -> list[str]:
    """--set flags giving TINY a NumPy plan of 30-60% of this machine's memory: one arena fits, four do not."""
    exp, host = config.from_dict(TINY), memory.host_memory_bytes()
    prec = precision.make(exp.train.precision, exp.train.backend)

    def plan_bytes(B: int) -> int:
        t = dataclasses.replace(exp.train, micro_batch=B)
        bufs = memory.plan(exp.model, t, prec, memory.cpu_logits_rows(exp.model, B))
        return sum(memory.role_bytes(bufs, prec).values())

    B = exp.train.micro_batch
    while plan_bytes(2 * B) <= 0.6 * host:
        B *= 2
    assert host / 4 < plan_bytes(B) <= host
    return ["--set", f"train.micro_batch={B}"]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--procs", "1000"], "--procs 1000: this machine has"),
        (["--procs", "2", "--backend", "triton"], "--procs 2: train.backend 'triton' needs a CUDA GPU per rank"),
        (["--procs", "4", "half the host"], "1/4 for each rank"),
    ],
)
def test_procs_are_checked_once_before_any_rank(tmp_path: Path, flags: list[str], needle: str) -> None:
    """One `error:` line (not one per rank), for `train` and for `run`, and no rank's output at all."""
    pytest.importorskip("torch")
    flags = [f for flag in flags for f in (half_the_host() if flag == "half the host" else [flag])]
    exp = write_experiment(tmp_path)
    env = {"TRITON_INTERPRET": "0"}  # the triton case is about a machine without CUDA and without the interpreter
    for command in ("train", "run"):
        refused(cli(command, str(exp), "--out", str(tmp_path / command), *flags, env=env), needle)
    assert not list(tmp_path.glob("*/ckpt"))


# --- 7. readers: every file checked before use (fileio's strict reader, then each field's type and range) ---------
AMAX = {"numeric strings": ["1.5", "2"], "booleans": [True, False], "an integer of 400 digits": [10**400],
        "a negative number": [-1.0], "a list": [[1.0]]}  # fmt: skip


@pytest.mark.parametrize("kind", list(AMAX))
def test_fp8_amax_history_in_a_sidecar(run: tuple[Path, Path, Path], kind: str) -> None:
    exp, out, ck = run
    side = checkpoint.sidecar_path(ck)
    side.write_text(json.dumps({**json.loads(side.read_text()), "fp8_amax_history": AMAX[kind]}))
    before = snapshot(out)
    needle = "field 'fp8_amax_history' item 0"
    resume = ["--resume", str(ck), "--steps", "5", "--precision", "fp8"]
    refused(cli("train", str(exp), "--out", str(out), *resume), str(side), needle)
    refused(cli("sample", str(ck), "--tokens", "1"), str(side), needle)
    assert snapshot(out) == before


def test_a_sidecar_number_that_overflows_is_refused(run: tuple[Path, Path, Path]) -> None:
    """1e999 parses to infinity; the strict reader refuses it where it refuses NaN."""
    exp, out, ck = run
    side = checkpoint.sidecar_path(ck)
    side.write_text(side.read_text().replace('"val_loss": ', '"val_loss": 1e999, "was": '))
    before = snapshot(out)
    refused(cli("sample", str(ck), "--tokens", "1"), str(side), "overflows")
    refused(cli("train", str(exp), "--out", str(out), "--resume", str(ck), "--steps", "5"), str(side), "overflows")
    assert snapshot(out) == before


def test_pull_skips_a_line_nested_100000_deep(tmp_path: Path) -> None:
    good = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    src = tmp_path / "in.jsonl"
    src.write_text(good + "\n" + "[" * 100_000 + "]" * 100_000 + "\n" + '{"a": 1, "a": 2}\n')
    res = cli("pull-hermes3", "--from", str(src), "--out", str(tmp_path / "out.jsonl"))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert report["kept"] == 1 and report["skipped_by_reason"] == {"invalid json": 2}
    src.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    before = snapshot(tmp_path)
    refused(cli("pull-hermes3", "--from", str(src), "--out", str(tmp_path / "out.jsonl")), "no valid conversation")
    assert snapshot(tmp_path) == before


# --- 8. chat with a closed or unreadable stdin ---------------------------------------------------------------------
@pytest.mark.parametrize("redirect, needle", [("<&-", "stdin is closed"), ("0>stdin.txt", "stdin line 1: cannot read")])
def test_chat_without_a_readable_stdin(run: tuple[Path, Path, Path], redirect: str, needle: str) -> None:
    """fd 0 closed (Python then has no sys.stdin), or open for writing only (its read fails with EBADF)."""
    _, out, _ = run
    cmd = f"{sys.executable} -m microgpt chat {out} --tokens 2 {redirect}"
    res = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=out.parent, timeout=300)
    refused(res, needle)
