"""A tiny model's steps on the triton backend (eager, then one graph replay): for compute-sanitizer.

python3 dev/tiny_step.py [PRECISION]      # also runs on the CPU under TRITON_INTERPRET=1 (no graph there)
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt.config import ModelConfig, TrainConfig  # noqa: E402
from microgpt.engine.backend import triton_backend  # noqa: E402
from microgpt.engine.state import make_state  # noqa: E402
from microgpt.engine.step import Step  # noqa: E402

m = ModelConfig(vocab_size=384, d_model=64, n_layer=2, n_head=2, seq_len=64)
precision = sys.argv[1] if len(sys.argv) > 1 else "bf16"
t = TrainConfig(micro_batch=2, n_micro=2, precision=precision, backend="triton", seed=0)
S = make_state(m, t, triton_backend(precision))
rng = np.random.default_rng(1)
data = [(rng.integers(0, 384, (2, 64)).astype(np.int32), rng.integers(0, 384, (2, 64)).astype(np.int32)) for _ in "ab"]
print("eager", Step(S, graph=False)(data, 1e-3))  # a warm-up (updates nothing), then the step function itself
step = Step(S)
print("graph", step(data, 1e-3), step(data, 1e-3))  # a warm-up, the capture, two replays
