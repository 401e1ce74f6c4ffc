"""Where a microgpt step's time goes: per-kernel CUDA time of one eager step (same kernels as the graph).

python3 dev/profile_step.py MB [PRECISION]     # ANDREA-120M shape; prints the top kernels
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import SHAPE, batches  # noqa: E402
from microgpt import memory, model  # noqa: E402
from microgpt.config import TrainConfig  # noqa: E402
from microgpt.kernels import TritonBackend  # noqa: E402
from microgpt.kernels.step import GraphStep  # noqa: E402


def main() -> None:
    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    precision = sys.argv[2] if len(sys.argv) > 2 else "bf16"
    m = SHAPE
    t = TrainConfig(micro_batch=mb, n_micro=1, precision=precision, backend="triton")
    K = TritonBackend(precision)
    bufs = memory.plan(m, mb, K.logits_rows(m, mb))
    K.reserve_for(bufs, m, t)
    A = memory.Arena(bufs, K.alloc)
    host = {name: np.zeros(shape, np.float32) for name, shape in memory.param_shapes(m)}
    model.init_params(host, m, np.random.default_rng(0))
    K.copy_in(A.flat_f32("params"), np.concatenate([a.reshape(-1) for a in host.values()]))
    step = GraphStep(K, m, t, A, use_graph=False)
    data = batches(mb, m)
    for i in range(3):
        step.step([data[i % 4]], 6e-4, i + 1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            step.step([data[i % 4]], 6e-4, i + 4)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
