"""`sample`, `chat` and `serve` on the triton backend (the interpreter in CI, the device on the GPU machine) against
the NumPy backend on the same checkpoint: at temperature 0 and fp32 the same tokens, prefill through gpt_infer and
every further token through the decode step (InferState.decode); and the flags' refusals, one line each."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import cli, json_lines, one_error

from ._kutil import ON_GPU

DEVICE_ENV = {} if ON_GPU else {"TRITON_INTERPRET": "1"}


def greedy(run: Path, backend: str, *flags: str) -> list[dict]:
    res = cli("sample", str(run), "--backend", backend, "--precision", "fp32", "--prompt", "def ", "--tokens", "10",
              "--temperature", "0", "--json", *flags, env=DEVICE_ENV)  # fmt: skip
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
        res = cli("chat", str(run_256), "--backend", backend, "--precision", "fp32", "--temperature", "0",
                  "--tokens", "12", input="hello\n", env=DEVICE_ENV)  # fmt: skip
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
