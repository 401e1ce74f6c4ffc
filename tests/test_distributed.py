"""Data parallel (microgpt/job.py) on the CPU: N processes with gloo and the NumPy engine.

Two processes with micro-batch b must train the model that one process with micro-batch 2b trains: the same
losses per step and the same final weights, to fp32 rounding (the gradient sums run in another order). Adam
divides each step by sqrt(v), so a near-zero gradient element's rounding can move its weight by a visible
fraction of that element; hence weights are compared as whole vectors, relative to their norm.
The processes here are real launcher + rank processes; each imports torch (several seconds on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint, config, data
from microgpt.engine import collectives, params
from microgpt.events import HEARTBEAT_ENV
from microgpt.run import job
from tests.conftest import REPO, TINY, cli, json_lines, write_experiment
from tests.test_hellaswag import EXAMPLES as HELLASWAG

B = 4  # per-process micro-batch; the one-process runs use 2 * B
REL = 1e-6


def test_loader_shards_are_the_rows_of_the_global_batch() -> None:
    exp = config.from_dict(TINY)
    b, world = 3, 2
    whole_train, whole_val = data.make_loaders(exp, world * b)
    for rank in range(world):
        train, val = data.make_loaders(exp, b, shard=(rank, world))
        rows = slice(rank * b, (rank + 1) * b)
        for step, micro in ((0, 0), (0, 1), (5, 1), (10_000, 0)):  # 10_000: a later epoch
            for got, want in zip(train.batch(step, micro), whole_train.batch(step, micro)):
                np.testing.assert_array_equal(got, want[rows])
        for i in (0, 3):
            for got, want in zip(val.sources["all"].val_batch(i), whole_val.sources["all"].val_batch(i)):
                np.testing.assert_array_equal(got, want[rows])


# --- helpers ------------------------------------------------------------------------------------------------
def records(stdout: str, event: str) -> list[dict]:
    return [r for r in json_lines(stdout) if r["event"] == event]


def assert_close(got: float, want: float, what: str, rel: float = REL) -> None:
    assert abs(got - want) <= rel * abs(want), f"{what}: {got!r} vs {want!r} (rel {abs(got - want) / abs(want):.2e})"


def assert_same_state(path_a: Path, path_b: Path) -> None:
    """Same layout (header, size, sidecar's parameter table); weights, m and v equal to rounding."""
    a, b = checkpoint.read_checkpoint(path_a), checkpoint.read_checkpoint(path_b)
    assert a.step == b.step and path_a.stat().st_size == path_b.stat().st_size
    assert checkpoint.read_sidecar(path_a)["params"] == checkpoint.read_sidecar(path_b)["params"]
    for name in ("weights", "m", "v"):
        x, y = getattr(a, name), getattr(b, name)
        rel = float(np.linalg.norm(x - y) / np.linalg.norm(x))
        i = int(np.argmax(np.abs(x - y)))
        assert rel <= REL, f"{name}: |a-b|/|a| = {rel:.2e}; largest difference at [{i}]: {x[i]!r} vs {y[i]!r}"


def train(exp: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    res = cli("train", str(exp), "--out", str(out), "--json", *args)
    assert res.returncode == 0, res.stderr
    return res


def start(exp: Path, out: Path, *args: str) -> subprocess.Popen:
    """The run in the background, its heartbeat every 50 ms: the beats land among its records (and after the last
    one) every time, as a run slowed past the 10-s beat by a loaded machine has them."""
    cmd = [sys.executable, "-m", "microgpt.cli", "train", str(exp), "--out", str(out), "--json", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", HEARTBEAT_ENV: "0.05"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)


def read_until(proc: subprocess.Popen, seen: list[dict], done) -> dict:
    """The run's records (heartbeats left out) into seen, up to the first for which done() holds."""
    for line in proc.stdout:
        rec = json.loads(line)
        if rec["event"] == "heartbeat":
            continue
        seen.append(rec)
        if done(rec):
            return rec
    raise AssertionError(f"the run ended early (rc {proc.wait()}): {proc.stderr.read()}")


def ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's children, from /proc (Linux)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == launcher:
                env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
                found[int(env["RANK"])] = int(entry.name)
        except (OSError, ValueError, IndexError, KeyError):
            continue
    return found


def gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    """One process with micro-batch 2B, and two processes with B; 6 steps, a checkpoint at step 3; HellaSwag with
    each evaluation (the two ranks score every other example)."""
    tmp = tmp_path_factory.mktemp("dp")
    hs = tmp / "hs.jsonl"
    hs.write_text("".join(json.dumps(ex) + "\n" for ex in HELLASWAG))
    exp = write_experiment(tmp, train={"micro_batch": B, "ckpt_every": 3, "hellaswag": str(hs)})
    one = train(exp, tmp / "one", "--steps", "6", "--set", f"train.micro_batch={2 * B}")
    two = train(exp, tmp / "two", "--steps", "6", "--procs", "2")
    return {"tmp": tmp, "exp": exp, "one": one, "two": two}


# --- equivalence, checkpoints, resume -----------------------------------------------------------------------
def test_two_processes_match_one_with_the_doubled_micro_batch(runs) -> None:
    one, two = runs["one"].stdout, runs["two"].stdout
    assert records(two, "start")[0]["world_size"] == 2 and len(records(two, "start")) == 1  # rank 0 alone speaks
    s1, s2 = records(one, "step"), records(two, "step")
    assert [r["step"] for r in s2] == list(range(1, 7))
    for a, b in zip(s1, s2):
        assert_close(b["loss"], a["loss"], f"step {a['step']} loss")
        assert_close(b["grad_norm"], a["grad_norm"], f"step {a['step']} grad_norm", rel=1e-5)
        assert b["tokens"] == a["tokens"] and b["lr"] == a["lr"]
    for a, b in zip(records(one, "eval"), records(two, "eval")):
        assert_close(b["val_loss"], a["val_loss"], f"step {a['step']} val_loss")
        assert b["hellaswag_examples"] == a["hellaswag_examples"] == len(HELLASWAG)
        assert (b["hellaswag"], b["hellaswag_acc_norm"]) == (a["hellaswag"], a["hellaswag_acc_norm"])
    name = checkpoint.ckpt_name(6)
    assert [r["reason"] for r in records(two, "checkpoint")] == ["periodic", "final"]
    assert_same_state(runs["tmp"] / "one/ckpt" / name, runs["tmp"] / "two/ckpt" / name)
    assert checkpoint.verify_sha(runs["tmp"] / "two/ckpt" / name)


def test_one_process_resumes_a_two_process_checkpoint(runs) -> None:
    tmp = runs["tmp"]
    ck3 = tmp / "two/ckpt" / checkpoint.ckpt_name(3)
    res = train(
        runs["exp"], tmp / "resumed", "--steps", "6", "--resume", str(ck3), "--set", f"train.micro_batch={2 * B}"
    )
    want = records(runs["one"].stdout, "step")[3:]
    got = records(res.stdout, "step")
    assert [r["step"] for r in got] == [4, 5, 6]
    for a, b in zip(want, got):
        assert_close(b["loss"], a["loss"], f"step {a['step']} loss")
    name = checkpoint.ckpt_name(6)
    assert_same_state(tmp / "one/ckpt" / name, tmp / "resumed/ckpt" / name)


def test_a_batch_warmup_under_data_parallel_matches_one_process_and_resumes_bit_exactly(tmp_path: Path) -> None:
    """GPT-2's block with a batch warmup (n_micro 3 from 1 micro-batch over 5 steps): both ranks follow the schedule
    (the tokens of each step, the losses of one process with the doubled micro-batch), and two processes resumed
    from their step-3 checkpoint, inside the warmup, end on the bytes of their uninterrupted run; one process too."""
    warm = {"micro_batch": B, "n_micro": 3, "batch_warmup_steps": 5, "batch_warmup_start": 1, "ckpt_every": 3}
    exp = write_experiment(tmp_path, train=warm)
    one = train(exp, tmp_path / "one", "--steps", "6", "--set", f"train.micro_batch={2 * B}")
    two = train(exp, tmp_path / "two", "--steps", "6", "--procs", "2")
    s1, s2 = records(one.stdout, "step"), records(two.stdout, "step")
    per = 2 * B * TINY["model"]["seq_len"]  # both ranks' micro-batch
    assert [r["tokens"] for r in s1] == [r["tokens"] for r in s2] == [per * c for c in (1, 1, 1, 2, 2, 3)]
    for a, b in zip(s1, s2):
        assert_close(b["loss"], a["loss"], f"step {a['step']} loss")
    name, ck3 = checkpoint.ckpt_name(6), checkpoint.ckpt_name(3)
    assert_same_state(tmp_path / "one/ckpt" / name, tmp_path / "two/ckpt" / name)
    again = train(exp, tmp_path / "again", "--steps", "6", "--procs", "2", "--resume", str(tmp_path / "two/ckpt" / ck3))
    assert [r["step"] for r in records(again.stdout, "step")] == [4, 5, 6]
    assert (tmp_path / "two/ckpt" / name).read_bytes() == (tmp_path / "again/ckpt" / name).read_bytes()
    alone = ("--set", f"train.micro_batch={2 * B}", "--resume", str(tmp_path / "one/ckpt" / ck3))
    train(exp, tmp_path / "one_again", "--steps", "6", *alone)
    assert (tmp_path / "one/ckpt" / name).read_bytes() == (tmp_path / "one_again/ckpt" / name).read_bytes()


def test_fp8_ranks_share_one_history_and_match_one_process(tmp_path: Path) -> None:
    """fp8 on 2 processes: the amaxes are the max over ranks before each roll, so the ranks keep one history (the
    replica check would stop a run whose weights drifted apart) and it is the one process's with micro-batch 2B,
    whose amax is the max over the same rows. (The priming micro-batch scales each rank by its own amax, so the
    runs agree to fp8's rounding, not bit for bit.)"""
    exp = write_experiment(
        tmp_path, train={"micro_batch": B, "precision": "fp8", "backend": "numpy", "eval_every": 100}
    )
    one = train(exp, tmp_path / "one", "--steps", "3", "--set", f"train.micro_batch={2 * B}")
    two = train(exp, tmp_path / "two", "--steps", "3", "--procs", "2")
    for a, b in zip(records(one.stdout, "step"), records(two.stdout, "step")):
        assert_close(b["loss"], a["loss"], f"step {a['step']} loss", rel=1e-2)
    name = checkpoint.ckpt_name(3)
    h1, h2 = (
        np.array(checkpoint.read_sidecar(tmp_path / r / "ckpt" / name)["fp8_amax_history"]).reshape(-1, 2, 16)
        for r in ("one", "two")
    )
    assert (h2[..., :6] > 0).all() and not h2[..., 6:].any()
    np.testing.assert_allclose(h2[:, 0], h1[:, 0], rtol=1e-2)  # the sites' inputs
    # output gradients: a rank's loss is the mean over its B rows, so its gradients are twice the 2B process's; a
    # gradient's amax is one element, which the priming step's per-rank scales move by up to a few percent
    np.testing.assert_allclose(h2[:, 1], 2 * h1[:, 1], rtol=0.1)


def test_grad_buckets_are_the_layers_in_the_canonical_order() -> None:
    """Layer l's bucket is exactly h{l}.*'s grads (the last layer's takes lnf too); with the rest (wte, wpe) they
    tile the flat gradient array once."""
    for m in (config.from_dict(TINY).model, config.load(REPO / "experiments/ANDREA-120M-TRAIN.json").model):
        layers, rest = collectives.grad_buckets(m)
        sizes = {name: int(np.prod(shape)) for name, shape in params.param_shapes(m)}
        assert rest == (0, sizes["wte"] + sizes["wpe"])
        assert [b[0] for b in layers[1:]] == [b[1] for b in layers[:-1]] and layers[0][0] == rest[1]
        assert layers[-1][1] == params.n_params(m)
        for layer, (first, end) in enumerate(layers):
            own = sum(n for name, n in sizes.items() if name.startswith(f"h{layer}."))
            tail = sizes["lnf_w"] + sizes["lnf_b"] if layer == m.n_layer - 1 else 0
            assert end - first == own + tail


def test_two_simulated_nodes_under_torchrun_train_what_the_launcher_trains(runs) -> None:
    """Multi-node through torchrun's environment: two torchrun agents on localhost, one node each (gloo),
    give the final checkpoint bytes of `--procs 2`."""
    tmp, port = runs["tmp"], job.free_port()
    torchrun = Path(sys.executable).parent / "torchrun"
    nodes = []
    for rank in range(2):
        cmd = [
            str(torchrun),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--no-python",
            sys.executable,
            "-m",
            "microgpt.cli",
            "train",
            str(runs["exp"]),
            "--out",
            str(tmp / f"node{rank}"),
            "--steps",
            "6",
            "--json",
        ]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
    results = [p.communicate(timeout=240) for p in nodes]
    for p, (out, err) in zip(nodes, results):
        assert p.returncode == 0, err[-3000:]
    assert records(results[0][0], "start")[0]["world_size"] == 2
    name = checkpoint.ckpt_name(6)
    want = (tmp / "two/ckpt" / name).read_bytes()
    assert (tmp / "node0/ckpt" / name).read_bytes() == want
    assert not (tmp / "node1/ckpt").exists() or not any((tmp / "node1/ckpt").iterdir())  # rank 0 alone writes


def test_four_processes_match_one_and_resume_bit_exactly_after_sigterm(runs) -> None:
    """Four processes (issue 17 on the CPU: the N-rank path gloo runs here is the one NCCL runs on GPUs): micro-batch
    B/2 each trains what one process with 2B trains; SIGTERM to the launcher mid-run, then --resume latest, ends on
    the final checkpoint bytes of an uninterrupted four-process run."""
    tmp, exp = runs["tmp"], runs["exp"]
    half = ("--set", f"train.micro_batch={B // 2}", "--procs", "4")
    whole = train(exp, tmp / "four", "--steps", "6", *half)
    assert records(whole.stdout, "start")[0]["world_size"] == 4
    for a, b in zip(records(runs["one"].stdout, "step"), records(whole.stdout, "step")):
        assert_close(b["loss"], a["loss"], f"step {a['step']} loss")
    name = checkpoint.ckpt_name(6)
    assert_same_state(tmp / "one/ckpt" / name, tmp / "four/ckpt" / name)
    proc = start(exp, tmp / "four_cut", "--steps", "6", *half, "--set", "train.ckpt_every=1000")
    seen: list[dict] = []
    read_until(proc, seen, lambda r: r["event"] == "step" and r["step"] >= 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    stopped, report = json_lines(out)[-2:]  # then the report card of the stop
    assert report["event"] == "report" and report["step"] == stopped["step"]
    assert stopped["event"] == "stopped" and stopped["reason"] == "SIGTERM" and stopped["step"] < 6, stopped
    train(exp, tmp / "four_cut", "--steps", "6", *half, "--resume", "latest")
    assert (tmp / "four/ckpt" / name).read_bytes() == (tmp / "four_cut/ckpt" / name).read_bytes()


# --- signals and failures -----------------------------------------------------------------------------------
def test_signals_to_the_launcher_reach_every_rank(runs) -> None:
    """Two processes resumed from a ONE-process checkpoint; SIGUSR1 then SIGTERM: one checkpoint each, exit 0."""
    tmp = runs["tmp"]
    ck3 = tmp / "one/ckpt" / checkpoint.ckpt_name(3)
    proc = start(
        runs["exp"],
        tmp / "sig",
        "--steps",
        "500",
        "--procs",
        "2",
        "--resume",
        str(ck3),
        "--set",
        "train.ckpt_every=1000",
    )
    seen: list[dict] = []
    first = read_until(proc, seen, lambda r: r["event"] == "step")
    assert_close(first["loss"], records(runs["one"].stdout, "step")[3]["loss"], "resumed step 4 loss")
    children = ranks_of(proc.pid)
    assert sorted(children) == [0, 1], children
    proc.send_signal(signal.SIGUSR1)
    usr1 = read_until(proc, seen, lambda r: r["event"] == "checkpoint")
    read_until(proc, seen, lambda r: r["event"] == "step" and r["step"] >= usr1["step"] + 2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    read_until(proc, seen, lambda r: r["event"] == "stopped")
    elapsed = time.monotonic() - t0  # the engine's answer: the checkpoint written, the run stopped
    # then the ranks' exits: a Python process that imported torch takes seconds to tear down on a loaded machine
    # (5 to 10 s measured at load 13 on 2 cores), which says nothing about the signal's handling
    out, err = proc.communicate(timeout=120)
    recs = seen + json_lines(out)
    assert proc.returncode == 0 and elapsed < 10, (proc.returncode, elapsed, err)
    ck = [r for r in recs if r["event"] == "checkpoint"]
    assert [r["reason"] for r in ck] == ["SIGUSR1", "SIGTERM"], ck
    stop = {k: v for k, v in recs[-2].items() if k != "time"}
    assert stop == {"event": "stopped", "step": ck[1]["step"], "reason": "SIGTERM"} and recs[-1]["event"] == "report"
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps == list(range(4, ck[1]["step"] + 1))  # every step once: one rank prints
    for r in ck:
        assert checkpoint.read_checkpoint(r["path"]).step == r["step"] and checkpoint.verify_sha(r["path"])
    assert all(gone(pid) for pid in children.values())


def test_a_killed_rank_takes_the_job_down(runs) -> None:
    proc = start(runs["exp"], runs["tmp"] / "kill", "--steps", "500", "--procs", "2")
    read_until(proc, [], lambda r: r["event"] == "step" and r["step"] >= 2)
    children = ranks_of(proc.pid)
    t0 = time.monotonic()
    os.kill(children[1], signal.SIGKILL)
    proc.communicate(timeout=30)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0 and elapsed < 5, (proc.returncode, elapsed)
    assert all(gone(pid) for pid in children.values())


DIVERGE = """
    import numpy as np
    from microgpt.engine import collectives
    from microgpt.run import job
    dp = job.from_env("numpy")
    w = np.linspace(-1, 1, 1000, dtype=np.float32)
    dp.check_replicas(0, [w])  # identical: passes
    if dp.rank == 1:
        w[123] = np.nextafter(w[123], np.float32(2))  # one bit
    dp.check_replicas(5, [w])
"""


def test_replicas_that_diverge_stop_the_run() -> None:
    script = [sys.executable, "-c", textwrap.dedent(DIVERGE)]
    code = f"import sys; from microgpt.run import job; sys.exit(job.launch({script!r}, 2))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode != 0
    assert "DivergenceError: step 5: rank(s) [1]" in res.stderr, res.stderr


# --- the one-process path and the flag ----------------------------------------------------------------------
def test_one_process_does_not_import_torch(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path, train={"steps": 1})
    argv = ["train", str(exp), "--out", str(tmp_path / "r"), "--procs", "1"]
    code = f"import sys; from microgpt import cli; assert cli.main({argv!r}) == 0; assert 'torch' not in sys.modules"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr


def test_more_than_one_process_needs_torch(monkeypatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    with pytest.raises(config.ConfigError, match="needs PyTorch"):
        job.launch([sys.executable, "-c", "pass"], 2)


def test_procs_must_match_the_job(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(config.ConfigError, match="--procs 3"):
        job.from_env("numpy", procs=3)
    res = cli("train", str(write_experiment(tmp_path)), "--procs", "0")
    assert res.returncode == 2 and res.stderr.startswith("error: --procs must be an integer"), res.stderr


@pytest.mark.parametrize("code, lines", [(2, 1), (4, 1), (3, 2)])
def test_a_failed_ranks_error_line_is_the_jobs_last(capfd: pytest.CaptureFixture, code: int, lines: int) -> None:
    """A rank that exits 2 or 4 has said its one `error:` line; the launcher added its own after it, so the job said
    two and its last was not the error (issue 57's class). It adds one only where the rank may have said none."""
    rank0 = f"import sys; print('error: x.json: bad', file=sys.stderr); sys.exit({code})"
    procs = [subprocess.Popen([sys.executable, "-c", rank0]), subprocess.Popen([sys.executable, "-c", "1"])]
    try:
        assert job._wait(procs) == code
    finally:
        for p in procs:
            p.wait()
    err = capfd.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("error: ")][:1] == ["error: x.json: bad"] and len(err) == lines
