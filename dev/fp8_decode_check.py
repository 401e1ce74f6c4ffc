"""How far the GPU's decode step is from the NumPy reference, against how far the GPU's own forward is: one row
prefilled and decoded on both backends, bf16 and fp8, with the fp8 scales primed by each call (a checkpoint without
amax histories) or read from histories (a checkpoint trained in fp8).

    python3 dev/fp8_decode_check.py [--steps 8] [--prompt 600]

One JSON line per (shape, precision, activations, scaling), fp8 also between fp32 activations on the GPU
(precision.make's compute: the E4M3 operands free of bf16's rounding). `forward` is the relative error of the
prefill's next-token logits (the training forward's window, model.gpt_infer) against NumPy's; `decode` the largest
over the decode steps' logits against NumPy's (the same tokens fed to both); `self` the largest of the GPU decode
step's logits against the GPU's own forward over the same tokens from position 0. The decode step is as faithful as
the forward when `decode` is about `forward`, and agrees with the GPU's own forward when `self` is about bf16's
rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt.config import ModelConfig  # noqa: E402
from microgpt.engine import params  # noqa: E402
from microgpt.engine.backend import numpy_backend, triton_backend  # noqa: E402
from microgpt.engine.infer import InferState, make_infer_state  # noqa: E402
from tests.kernels.test_gpu_decode import fp8_histories  # noqa: E402  # the GPU test's: one way to make them

SHAPES = {
    "mid": ModelConfig(vocab_size=512, d_model=128, n_layer=2, n_head=4, seq_len=1024),
    "12m": ModelConfig(vocab_size=4096, d_model=384, n_layer=6, n_head=6, seq_len=1024),
}
# (precision, fp8's activation dtype on the GPU where not bf16, fp8's scaling)
CASES = [("bf16", None, "-"), ("fp8", None, "primed"), ("fp8", None, "history"), ("fp8", "fp32", "primed"),
         ("fp8", "fp32", "history")]  # fmt: skip


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def prefill(S: InferState, ids: np.ndarray) -> np.ndarray:
    """The next-token logits after ids (1, t) from position 0 (the training forward's window)."""
    tokens, _ = S.inputs(*ids.shape)
    S.K.copy_in(tokens, ids)
    S.run(tokens, 0)
    return S.K.to_numpy(S.arena["next_logits"][:1]).copy()


def run(
    m: ModelConfig,
    precision: str,
    compute: str | None,
    side: dict | None,
    w: np.ndarray,
    prompt: np.ndarray,
    steps: int,
) -> dict:
    states = {
        "numpy": make_infer_state(m, numpy_backend(precision_name=precision), 1, w),
        "gpu": make_infer_state(m, triton_backend(precision, compute=compute), 1, w),
    }
    for S in states.values():
        if side is not None:
            S.prec.load_sidecar(side, "the check's histories")
    first = {k: prefill(S, prompt) for k, S in states.items()}
    seq, t, dec = list(prompt[0]), prompt.shape[1], {k: [] for k in states}
    for j in range(steps):
        tok = int(first["numpy"][0].argmax()) if j == 0 else int(dec["numpy"][-1][0].argmax())
        seq.append(tok)
        for k, S in states.items():
            dec[k].append(S.K.to_numpy(S.decode([tok], [t + j], [0])).copy())
    own = [prefill(states["gpu"], np.array([seq[: t + j + 1]], np.int32)) for j in range(steps)]
    return {
        "forward": rel(first["gpu"], first["numpy"]),
        "decode": max(rel(a, b) for a, b in zip(dec["gpu"], dec["numpy"])),
        "self": max(rel(a, b) for a, b in zip(dec["gpu"], own)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompt", type=int, default=600)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    args = p.parse_args()
    for shape in args.shapes:
        m = SHAPES[shape]
        w = params.init_weights(m, 0)
        w += np.random.default_rng(1).standard_normal(w.shape).astype(np.float32) * 0.05
        prompt = np.random.default_rng(2).integers(0, m.vocab_size, (1, args.prompt)).astype(np.int32)
        side = fp8_histories(m, w, prompt)
        for precision, compute, scaling in CASES:
            res = run(m, precision, compute, side if scaling == "history" else None, w, prompt, args.steps)
            print(
                json.dumps(
                    {
                        "shape": shape,
                        "precision": precision,
                        "activations": compute or "bf16",
                        "scaling": scaling,
                        **res,
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
