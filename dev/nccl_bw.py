"""NCCL all-reduce bandwidth between the GPUs of this machine, at the sizes data parallel sums (fp32).

    python3 dev/nccl_bw.py [N_GPUS]     # prints MB, ms, algorithm and bus bandwidth (nccl-tests' definitions)

Sizes: one ANDREA-120M layer's grads (28 MB), the embedding's bucket (wte + wpe, 157 MB) and all grads (496 MB).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_MB = [28.3, 157.7, 497.8]


def worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    for mb in SIZES_MB:
        x = torch.randn(int(mb * 1e6 / 4), device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            dist.all_reduce(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[len(times) // 2]
        alg = mb * 1e6 / (ms * 1e-3) / 1e9
        if rank == 0:
            print(f"{mb:7.1f} MB  {ms:7.3f} ms  algbw {alg:6.1f} GB/s  busbw {alg * 2 * (world - 1) / world:6.1f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    mp.spawn(worker, args=(n, 29400 + os.getpid() % 500), nprocs=n)
