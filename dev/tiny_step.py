"""A tiny model's steps on the triton backend (eager, then one graph replay): for compute-sanitizer."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt import memory, model  # noqa: E402
from microgpt.config import ModelConfig, TrainConfig  # noqa: E402
from microgpt.kernels import TritonBackend  # noqa: E402
from microgpt.kernels.step import GraphStep  # noqa: E402

m = ModelConfig(vocab_size=384, d_model=64, n_layer=2, n_head=2, seq_len=64)
t = TrainConfig(micro_batch=2, n_micro=2, precision=sys.argv[1] if len(sys.argv) > 1 else "bf16", backend="triton")
K = TritonBackend(t.precision)
bufs = memory.plan(m, t.micro_batch, 32)
K.reserve_for(bufs, m, t)
A = memory.Arena(bufs, K.alloc)
host = {name: np.zeros(shape, np.float32) for name, shape in memory.param_shapes(m)}
model.init_params(host, m, np.random.default_rng(0))
K.copy_in(A.flat_f32("params"), np.concatenate([a.reshape(-1) for a in host.values()]))
rng = np.random.default_rng(1)
data = [(rng.integers(0, 384, (2, 64)).astype(np.int32), rng.integers(0, 384, (2, 64)).astype(np.int32)) for _ in "ab"]
step = GraphStep(K, m, t, A, use_graph=False)
print("eager", step.step(data, 1e-3, 1))
step.use_graph = True
print("graph", step.step(data, 1e-3, 2), step.step(data, 1e-3, 3))
