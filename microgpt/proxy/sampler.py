"""Text samples during training: `microgpt sample CKPT --json ...` run as a subprocess on new checkpoints.

Why a subprocess and not the engine: sampling needs only a checkpoint and its sidecar (config, tokenizer),
so it stays out of the training step (no second model state, no extra memory in the plan) and a slow or
failing sample never stalls or kills training. Samples run in a worker thread, one prompt at a time, on
the CPU, from the same checkpoint file the engine announced; the seed is the step, so a sample is
reproducible from its record (checkpoint, prompt, tokens, temperature, step) with sample_cmd. A prompt is a
string, or chat messages rendered with the chat template and ended by an open assistant turn.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from microgpt.data.chatml import prompt_text
from microgpt.errors import WriteError
from microgpt.proxy.phases import ProxySettings
from microgpt.proxy.runfiles import JsonDoc
from microgpt.runlock import LockError


def sample_cmd(ckpt: str, prompt: str, settings: ProxySettings, step: int) -> list[str]:
    cmd = [sys.executable, "-m", "microgpt.cli", "sample", ckpt, "--prompt", prompt, "--json", "--seed", str(step)]
    return cmd + ["--tokens", str(settings.sample_tokens), "--temperature", str(settings.temperature)]


class Sampler:
    """Samples checkpoints in a worker thread and appends to the samples file; `lock` guards the file."""

    def __init__(self, doc: JsonDoc, settings: ProxySettings, lock: threading.Lock, log: Callable[[str], None]):
        self.doc, self.settings, self.lock, self.log = doc, settings, lock, log
        self.jobs: queue.Queue = queue.Queue()
        self.proc: subprocess.Popen | None = None
        self.closed = False
        self.last_step = 0
        self.thread = threading.Thread(target=self._work, name="sampler", daemon=True)
        self.thread.start()

    def wants(self, step: int, reason: str) -> bool:
        """At the first checkpoint at or after each multiple of sample_every, and at a phase's final one."""
        every = self.settings.sample_every
        if every <= 0 or not self.settings.prompts or step <= self.last_step:
            return False
        return reason == "final" or step // every > self.last_step // every

    def request(self, step: int, phase: str, ckpt: str, reason: str) -> None:
        if self.wants(step, reason):
            self.last_step = step
            self.jobs.put((step, phase, ckpt))

    def drain(self, timeout: float) -> None:
        """Wait (bounded) until every requested sample is written: a phase's last samples belong to it."""
        deadline = time.monotonic() + timeout
        while self.jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self.closed = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        self.jobs.put(None)
        self.thread.join(timeout=5)

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                for prompt in self.settings.prompts:
                    if self.closed:
                        break
                    self._one(*job, prompt)
            finally:
                self.jobs.task_done()

    def _one(self, step: int, phase: str, ckpt: str, prompt: Any) -> None:
        text = prompt_text(prompt)
        s = self.settings
        rec: dict[str, Any] = {
            "step": step,
            "phase": phase,
            "prompt": prompt,
            "temperature": s.temperature,
            "tokens": s.sample_tokens,
            "checkpoint": ckpt,
            "time": time.time(),
        }
        try:
            pipe = subprocess.PIPE
            self.proc = subprocess.Popen(
                sample_cmd(ckpt, text, s, step),
                stdout=pipe,
                stderr=pipe,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            out, err = self.proc.communicate(timeout=s.sample_timeout_s)
            if self.proc.returncode != 0:
                last = err.decode(errors="replace").strip().splitlines()
                rec["error"] = last[-1] if last else f"exit code {self.proc.returncode}"
            else:
                rec["text"] = json.loads(out.decode())["text"]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            rec["error"] = f"timed out after {s.sample_timeout_s:g} s"
        except (OSError, ValueError, KeyError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        if self.closed and "error" in rec:
            return  # killed by close(): not a sampling failure worth recording
        with self.lock:
            self.doc.data["samples"].append(rec)
            try:
                self.doc.flush()
            except (WriteError, LockError) as e:  # a full disk, a moved folder: the proxy's next write stops it
                self.closed = True
                self.log(f"samples not recorded: {e}")
                return
        if "error" in rec:
            self.log(f"sample at step {step} failed: {rec['error']}")
