"""`sample`, `chat` and `serve` on the triton backend (the interpreter in CI, the device on the GPU machine) against
the NumPy backend on the same checkpoint: at temperature 0 and fp32 the same tokens, prefill through gpt_infer and
every further token through the decode step (InferState.decode); and the flags' refusals, one line each."""

from __future__ import annotations

from pathlib import Path

import pytest

from microgpt.engine.backend import numpy_backend, triton_backend
from microgpt.engine.trained import load_trained
from microgpt.use import sample
from tests.conftest import cli, json_lines, one_error, write_experiment

from ._kutil import ON_GPU, check

DEVICE_ENV = {} if ON_GPU else {"TRITON_INTERPRET": "1"}


def greedy(run: Path, backend: str, *flags: str) -> list[dict]:
    res = cli(
        "sample",
        str(run),
        "--backend",
        backend,
        "--precision",
        "fp32",
        "--prompt",
        "def ",
        "--tokens",
        "10",
        "--temperature",
        "0",
        "--json",
        *flags,
        env=DEVICE_ENV,
    )
    assert res.returncode == 0, res.stderr
    return json_lines(res.stdout)


def test_sample_on_triton_draws_numpy_greedy_tokens(run_256: Path) -> None:
    """One sequence and a batch of three (`--num-samples 3`: the decode step of b = 3, one CUDA graph on a GPU)."""
    for flags in ((), ("--num-samples", "3")):
        want, got = greedy(run_256, "numpy", *flags), greedy(run_256, "triton", *flags)
        assert [r["text"] for r in got] == [r["text"] for r in want]
        assert len(got) == (3 if flags else 1) and all(r["text"] for r in got)


def test_chat_on_triton_answers_as_numpy(run_256: Path) -> None:
    def reply(backend: str) -> str:
        res = cli(
            "chat",
            str(run_256),
            "--backend",
            backend,
            "--precision",
            "fp32",
            "--temperature",
            "0",
            "--tokens",
            "12",
            input="hello\n",
            env=DEVICE_ENV,
        )
        assert res.returncode == 0, res.stderr
        return res.stdout

    assert reply("triton") == reply("numpy")


@pytest.mark.parametrize("command", ["sample", "chat", "serve"])
def test_a_precision_the_backend_does_not_run_is_one_line(run_256: Path, command: str) -> None:
    res = cli(command, str(run_256), "--backend", "numpy", "--precision", "bf16", input="")
    one_error(res, 2, "--precision bf16: the numpy backend runs fp32, fp8")
    res = cli(command, str(run_256), "--backend", "triton", "--precision", "fp16", input="", env=DEVICE_ENV)
    one_error(res, 2, "--precision fp16:", "trained in fp32")


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_triton_without_a_gpu_is_one_line_naming_the_flag(run_256: Path) -> None:
    res = cli("sample", str(run_256), "--backend", "triton", env={"TRITON_INTERPRET": "0"})
    one_error(res, 2, "--backend 'triton'")


def test_an_fp8_run_decodes_on_triton_as_on_numpy(tmp_path: Path) -> None:
    """A run trained in fp8 (2 steps: its sidecar carries the amax histories) through sample.open_trained on both
    backends in fp8, prompt and 12 greedy tokens of the NumPy run fed to both: each step's logits agree, so the
    triton state scales by the sidecar's histories as the NumPy one does. The triton side computes between fp32
    activations (precision.make's compute), where the E4M3 operands are the reference's (bf16 activations move
    some across E4M3's rounding steps: tests/kernels/test_gpu_decode.py holds those to the forward's own distance);
    the CLI's own fp8 run on the triton backend then answers."""
    exp = write_experiment(tmp_path, train={"precision": "fp8", "backend": "numpy", "steps": 2, "eval_every": 100})
    assert cli("train", str(exp), "--out", str(tmp_path / "run")).returncode == 0
    ld = load_trained(str(tmp_path / "run"))
    assert "fp8_amax_history" in ld.side
    logits = []
    for K in (numpy_backend(precision_name="fp8"), triton_backend("fp8", compute="fp32")):
        gen, tok = sample.open_trained(ld, 1, K)
        ids = tok.encode("def ")
        steps = [gen.feed(ids)]
        if not logits:
            fed = sample.generate(gen, ids, 12, sample.Sampling(), [0])[0]
            gen.pos = len(ids)  # the same tokens through the other backend's decode steps below
        steps += [gen.feed([t]) for t in fed[:-1]]
        logits.append(steps)
    for i, (a, b) in enumerate(zip(*logits)):
        check(f"step {i}", a, b, 1e-2 if ON_GPU else 1e-5)
    res = cli(
        "sample",
        str(tmp_path / "run"),
        "--backend",
        "triton",
        "--precision",
        "fp8",
        "--prompt",
        "def ",
        "--tokens",
        "4",
        env=DEVICE_ENV,
    )
    assert res.returncode == 0 and res.stdout.startswith("def "), res.stderr
