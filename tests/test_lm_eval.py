"""lm-evaluation-harness, the real client, scores a multiple-choice task against a real `microgpt serve`: its
local-completions model (token-id prompts in batches, max_tokens 1, logprobs 1, echo; the tokenizer of `microgpt
export`'s folder, or serve's own through its tokenizer routes) on a task written here (a YAML and a local JSONL: no
network, no Hugging Face hub), and gets microgpt's own numbers for the same examples: every choice's loglikelihood
to 1e-4 (from its log_samples), the same acc as `microgpt eval --hellaswag` on the same file, and the acc_norm
lm-eval's rule gives from microgpt's sums. And docs/SERVE.md's `lm_eval` commands, run as written by the `lm_eval`
program against a `microgpt serve` process.

lm_eval[api] is in the test extra; the test is skipped, saying so, where it is not importable."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from microgpt import config
from microgpt.data import hellaswag_file
from microgpt.data.chatml import prompt_text
from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine.trained import load_trained
from microgpt.use import evaluate, hellaswag
from tests.conftest import REPO, cli, json_lines, write_experiment
from tests.ops._util import check
from tests.test_serve import served

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed (pip install 'lm_eval[api]==0.4.13', the test extra's)"
)

# HellaSwag's shape (ctx, 4 endings, label), so `microgpt eval --hellaswag` reads the same file; every example fits
# the 256-token context whole, so both sides score every ending. The last one's longest sequence is 256 tokens: lm-eval
# (max_length 257) sends the whole context with max_tokens 1, which serve takes (the drawn token needs no position).
LONG = ["print(x)", "zz", "x = 2", "def f():"]
EXAMPLES = [
    ("def add(a, b):", ["return a + b", "zzq qq", "import os", "class A:"], 0),
    ("The cat sat on the", ["mat.", "def", "}", "1234"], 0),
    ("for i in", ["range(10):", "the house", "x", "self"], 0),
    ("import numpy as", ["np", "if", "else", "pass"], 0),
    ("class Foo:", ["def __init__(self):", "0", "1", "2"], 0),
    ("x = [1, 2,", ["3]", "{", "while", "end."], 0),
    ("if x is None:", ["return", "cat", "==", "9"], 0),
    ("print(", ['"hello")', "))", "def", "a b c"], 1),
    ("with open(path) as", ["f:", "the", "0.5", "(("], 0),
    ("while True:", ["break", "dog", "]]", "import"], 2),
    ("# a comment about", ["the code", "!!", "\n\n", "123"], 0),
    ("try:", ["pass", "except", "yes", "the end"], 3),
    ("return self.", ["x", "  ", "def", "12"], 0),
    ("from typing import", ["Any", "cat", "0", "+"], 0),
    ("lambda x:", ["x + 1", "the", "::", "class"], 1),
    ("assert len(a) ==", ["3", "cat", "def", "]"], 0),
    (("x = 1\n" * 50)[: 256 - 1 - max(map(len, LONG))], LONG, 0),
]

TASK = """task: microgpt_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.mark.parametrize(
    "batch_size, tokenized, backend",
    [(8, True, "huggingface"), (1, False, "huggingface"), (8, True, "remote")],
    ids=["token-ids-batched", "text-one-at-a-time", "remote-tokenizer"],
)
def test_lm_eval_scores_a_task_against_serve_as_microgpt_does(
    run_256: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch_size: int, tokenized: bool, backend: str
) -> None:
    """Token-id prompts 8 to a request, and one prompt a request sent as text (tokenized_requests False: serve
    tokenizes; lm-eval's tokenizer only counts each context's tokens), with the exported folder's tokenizer; and
    token ids with serve's own (tokenizer_backend "remote": its /tokenize, /detokenize and /tokenizer_info, no
    exported folder), which lm-eval's default ("auto") finds there. No network: the task's data is a local file."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"ctx": c, "endings": e, "label": y}) + "\n" for c, e, y in EXAMPLES))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "microgpt_mc.yaml").write_text(TASK.format(data=data, cache=tmp_path / "datasets"))
    if backend == "huggingface":
        res = cli("export", str(run_256), "--out", str(tmp_path / "hf"))
        assert res.returncode == 0, res.stderr

    # microgpt's own numbers: the CLI's accuracy, and each ending's sum of token losses from eval's scorer
    res = cli("eval", str(run_256), "--hellaswag", str(data), "--backend", "numpy", "--json")
    assert res.returncode == 0, res.stderr
    (want,) = json_lines(res.stdout)
    ld = load_trained(run_256)
    examples = hellaswag_file.read(data, "--hellaswag")
    items = hellaswag_file.tokenize(examples, load_tokenizer(ld.side["tokenizer"]), ld.exp.model.seq_len)
    assert all(it.judged and not it.truncated for it in items) and max(len(s) for s in items[-1].seqs) == 256
    sums = hellaswag.ending_losses(evaluate.scorer(ld, evaluate.eval_backend(ld, "numpy", None)), items)

    from lm_eval.tasks import TaskManager
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    with served(run_256, "--max-batch", "4", "--queue", "16") as (a, _, url):
        if backend == "remote":
            assert check_remote_tokenizer_support(f"{url}/completions")
            chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
            assert RemoteTokenizer(f"{url}/completions").apply_chat_template(chat) == prompt_text(chat)
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": a.name,
                "base_url": f"{url}/completions",
                "tokenizer_backend": backend,
                **({"tokenizer": str(tmp_path / "hf")} if backend == "huggingface" else {}),
                "max_length": ld.exp.model.seq_len + 1,
                "batch_size": batch_size,
                "tokenized_requests": tokenized,
            },
            tasks=["microgpt_mc"],
            task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
            num_fewshot=0,
            log_samples=True,
            bootstrap_iters=0,
        )
    samples = sorted(out["samples"]["microgpt_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(EXAMPLES)
    lls = np.array([[float(r[0]) for r in s["filtered_resps"]] for s in samples])
    check("each choice's loglikelihood through lm-eval", -lls, sums, 1e-4)
    got = out["results"]["microgpt_mc"]
    assert got["acc,none"] == want["acc"]
    n_chars = np.array([[len(e) for e in ex["endings"]] for ex in examples])
    labels = np.array([ex["label"] for ex in examples])
    assert got["acc_norm,none"] == np.mean(np.argmax(-sums / n_chars, axis=1) == labels)  # lm-eval's rule: chars


# --- docs/SERVE.md's commands, as written -------------------------------------------------------------------------
SERVE_DOC = REPO / "docs" / "SERVE.md"
# What the doc marks as placeholders (its text before the commands), and what this test puts in their place.
ADDRESS, EXPORT_DIR, TASK_FLAG = "127.0.0.1:8000", "EXPORT_DIR", "--tasks hellaswag "


def documented_lm_eval_commands() -> list[str]:
    """Each fenced block of docs/SERVE.md that is an `lm_eval` command, as the doc has it (a shell runs it)."""
    blocks, block = [], None
    for line in SERVE_DOC.read_text().splitlines():
        if line.startswith("```"):  # a fence opens a block or closes the open one
            blocks, block = (blocks + [block], None) if block is not None else (blocks, [])
        elif block is not None:
            block.append(line)
    return ["\n".join(b) for b in blocks if b and b[0].startswith("lm_eval ")]


def test_the_documented_lm_eval_commands_run_as_written(tmp_path: Path) -> None:
    """docs/SERVE.md's two `lm_eval` commands (the exported tokenizer, then serve's own), run by the `lm_eval`
    program as written but for serve's address, EXPORT_DIR and the task (a local task YAML: no network), against a
    `microgpt serve` process of a model named andrea-12m with ANDREA-12M's context (max_length=513 is its seq_len + 1):
    each exits 0 and prints the accuracy `microgpt eval --hellaswag` gives on the same file."""
    commands = documented_lm_eval_commands()
    assert len(commands) == 2, commands
    assert config.load(REPO / "experiments/ANDREA-12M-TRAIN.json").model.seq_len + 1 == 513
    exp = write_experiment(tmp_path, name="andrea-12m", model={"seq_len": 512}, train={"steps": 3})
    run = tmp_path / "andrea-12m"
    for args in (("train", str(exp), "--out", str(run)), ("export", str(run), "--out", str(tmp_path / "hf"))):
        res = cli(*args)
        assert res.returncode == 0, res.stderr
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"ctx": c, "endings": e, "label": y}) + "\n" for c, e, y in EXAMPLES))
    res = cli("eval", str(run), "--hellaswag", str(data), "--backend", "numpy", "--json")
    assert res.returncode == 0, res.stderr
    (want,) = json_lines(res.stdout)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the venv's lm_eval program
    log, clients = tmp_path / "serve.log", []
    with log.open("w") as f:
        cmd = [sys.executable, "-m", "microgpt.cli", "serve", str(run), "--port", "0"]
        serve = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (lines := [x for x in log.read_text().splitlines() if x.startswith("serve: http://")]):
            assert serve.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        address = lines[0].split("//", 1)[1].split("/", 1)[0]
        for command in commands:
            for mark in (ADDRESS, TASK_FLAG):
                assert command.count(mark) == 1, (mark, command)
            task = tmp_path / f"microgpt_mc{len(clients)}.yaml"  # each client its own datasets cache: they run at once
            task.write_text(TASK.format(data=data, cache=tmp_path / f"datasets{len(clients)}"))
            command = command.replace(ADDRESS, address).replace(TASK_FLAG, f"--tasks {shlex.quote(str(task))} ")
            command = command.replace(EXPORT_DIR, shlex.quote(str(tmp_path / "hf")))
            argv = ["sh", "-c", command]  # the doc's lines as a user pastes them: the shell joins them, finds lm_eval
            err = (tmp_path / f"lm_eval{len(clients)}.err").open("w")  # its log: a file, never a full pipe
            clients.append(
                (subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=tmp_path, env=env), err)
            )
        for command, (client, err) in zip(commands, clients):
            out, _ = client.communicate(timeout=300)
            err.close()
            assert client.returncode == 0, f"{command}\n{Path(err.name).read_text()[-3000:]}"
            (row,) = [r for r in out.splitlines() if r.startswith("|microgpt_mc|")]  # the results table's first row
            cells = [c.strip() for c in row.split("|")]
            assert cells[5] == "acc" and cells[7] == f"{want['acc']:.4f}", (command, out)
    finally:
        for client, _ in clients:  # one left running by a failed check of the other
            if client.poll() is None:
                client.kill()
                client.wait()
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
