"""Starting a data-parallel job: the pre-flight check, joining a job, and the launcher of its processes.

`microgpt train EXP --procs N` (spelled `--gpus N` too) starts N copies of itself with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT); a process that finds RANK and WORLD_SIZE
already set (torchrun, or our launcher) joins as that rank instead. On the triton backend rank r uses GPU
LOCAL_RANK and the gradients go through NCCL; on the NumPy backend the ranks are CPU processes and go through
gloo; the triton backend without CUDA (the interpreter) goes through gloo with CPU tensors. The code path is the
same, which is how CI checks it with 2 CPU processes. torch is imported only here and in engine/collectives.py
(what the ranks do in a step), only for N > 1.

Several machines: run torchrun on each (one node per machine), e.g. for 2 nodes of 8 GPUs
  torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --master-addr HOST0 --master-port 29500 \
      --no-python microgpt train EXP --out RUN
with R = 0 on HOST0 and 1 on the other; every node needs the data at data.path, and resuming needs the run
folder (rank 0 writes the checkpoints) on a filesystem every node reads. CI runs exactly this as 2 simulated
nodes on localhost with gloo (tests/test_distributed.py).

Signals: the launcher forwards SIGTERM/SIGINT/SIGUSR1 to every rank (engine/collectives.py says how the ranks
agree on acting on them). A rank that dies (any exit but 0) makes the launcher kill the others and exit non-zero,
so the proxy restarts the job; ranks die with their launcher (PR_SET_PDEATHSIG), since the proxy may SIGKILL the
launcher alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

from microgpt import config
from microgpt.config import ConfigError, Experiment
from microgpt.engine import memory
from microgpt.engine.backend import numpy_backend
from microgpt.engine.collectives import DataParallel
from microgpt.engine.state import training_plan
from microgpt.errors import EXIT_INPUT, EXIT_WRITE

LAUNCHER_ENV = "MICROGPT_LAUNCHER_PID"  # set by launch(): children die with that process
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# --- before the job --------------------------------------------------------------------------------------------
CPU_RANKS_PER_CORE = 4  # CPU ranks beyond this many per core only contend for the cores (CI runs 4 on 2)


def check_job(exp: Experiment, n: int, flag: str = "--procs") -> None:
    """Whether this machine can run the experiment as n ranks, checked once before any rank starts (one `error:`
    line for the job, not one per rank): the backend is here (triton: a CUDA GPU, or the interpreter), n fits the
    machine (one GPU a rank on CUDA; at most CPU_RANKS_PER_CORE CPU ranks a core otherwise), and on the NumPy
    backend n arenas of the plan fit in the host's memory together. ConfigError or memory.PlanError otherwise."""
    t = exp.train
    config.check_data_parallel(t)
    require_torch()
    if t.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"{flag} {n}: train.backend 'triton' needs a CUDA GPU per rank and this machine has "
                "none (TRITON_INTERPRET=1 runs the kernels on the CPU; train.backend 'numpy' is "
                "the CPU engine)"
            )
        limit, what = torch.cuda.device_count(), "CUDA GPU(s), one per rank"
    else:
        cores = os.cpu_count() or 1
        limit, what = CPU_RANKS_PER_CORE * cores, f"{cores} CPU core(s), for at most {CPU_RANKS_PER_CORE} ranks each"
    if n > limit:
        raise ConfigError(f"{flag} {n}: this machine has {what}: at most {limit} ranks")
    if t.backend == "numpy":
        m, host, K = exp.model, memory.host_memory_bytes(), numpy_backend(precision_name=t.precision)
        share = None if host is None else host // n
        memory.check_fits(training_plan(m, t, K), K.precision, m, share, f"cpu, 1/{n} for each rank")


# --- joining a job ------------------------------------------------------------------------------------------
def require_torch() -> None:
    """More than one process needs torch.distributed, which the one-process CPU install does not bring."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ConfigError(
            "--procs/--gpus N > 1 needs PyTorch for torch.distributed (pip install 'microgpt[gpu]'; "
            "the CPU build of torch is enough for --backend numpy)"
        )


def launched() -> bool:
    """True in a process started as one rank of a job (by launch() or torchrun)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """This process's rank in its job: RANK when launched, else 0."""
    return int(os.environ["RANK"]) if launched() and os.environ["RANK"].isdigit() else 0


def from_env(backend: str, procs: int | None = None) -> DataParallel | None:
    """Join the job described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; None for a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched() else 1
    if procs is not None and procs > 1 and procs != world:
        raise ConfigError(f"--procs {procs}: this process is one rank of a job of WORLD_SIZE={world}")
    if world <= 1:
        return None
    _die_with_launcher()
    require_torch()
    import torch
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if backend == "triton" and torch.cuda.is_available():  # grads on the GPU: NCCL; host scalars: a gloo group
        torch.cuda.set_device(local)  # before the backend allocates the arena
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
        ctrl = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ctrl = None
    if rank != 0:  # rank 0 alone speaks the JSON lines; the other ranks' stdout goes nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    return DataParallel(rank, world, ctrl)


def _die_with_launcher() -> None:
    """Ask Linux to SIGKILL this rank when the launcher dies (a SIGKILLed launcher cannot kill its children)."""
    launcher = int(os.environ.get(LAUNCHER_ENV, "0"))
    if not launcher:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's own kill paths remain
        pass
    if os.getppid() != launcher:  # it died before the request took effect
        os._exit(1)


# --- the launcher -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], n: int, env_extra: dict[str, str] | None = None, pass_fds: Sequence[int] = ()) -> int:
    """Run cmd as ranks 0..n-1 of one job; forward signals; the first rank to fail takes the job down.

    Returns 0 when every rank exits 0, else the failed rank's exit code (128 + signal number if it was killed).
    Children get their own process group, so a terminal's Ctrl-C reaches them once (through us), not twice.
    env_extra and pass_fds go to every rank (the run folder's lock, microgpt/runlock.py).
    """
    require_torch()
    env = {
        **os.environ,
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        LAUNCHER_ENV: str(os.getpid()),
        **(env_extra or {}),
    }
    procs: list[subprocess.Popen] = []

    def forward(signum: int, frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:  # it ended just now: _wait will see it
                    pass

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    previous = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        for rank in range(n):
            procs.append(
                subprocess.Popen(
                    cmd,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    process_group=0,
                    pass_fds=tuple(pass_fds),
                )
            )
        return _wait(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(procs: list[subprocess.Popen]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            if code not in (EXIT_INPUT, EXIT_WRITE):  # 2 and 4: the rank said its `error:` line, the job's one
                print(f"error: rank {rank} ended with {how}; stopping the other ranks", file=sys.stderr, flush=True)
            return code if code > 0 else 128 - code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)
