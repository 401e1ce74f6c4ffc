"""Inference throughput: microgpt's prefill and decode step against Hugging Face transformers on the same weights.

    python3 bench/decode.py                          # GPU: ANDREA-120M, bf16, batches 1 and 32, every impl
    python3 bench/decode.py --checkpoint RUN_OR_BIN  # a trained model's weights instead of random ones
    python3 bench/decode.py --device cpu             # the smoke check: a tiny model, NumPy backend vs transformers

One JSON line per (impl, batch) on stdout. Impls: microgpt (the triton backend on a GPU: prefill through
model.gpt_infer, decoding through InferState.decode, one CUDA graph per batch size, replayed per token; the NumPy
backend on the CPU), hf (transformers' GPT2LMHeadModel from the folder microgpt/use/export.py writes, SDPA attention,
generate() with its dynamic KV cache) and hf-compile (the same with a static cache, which generate() compiles with
torch.compile on a GPU; a failure becomes the row's "error"). Weights: a checkpoint's, or the seeded init moved off
it (so that greedy tokens are not decided by near-ties), exported once for transformers in the run's precision
(bf16 on the GPU, fp32 on the CPU).

Each batch row has its own random prompt of --prompt tokens; every impl continues all rows greedily by --new
tokens. Prefill tokens/s: batch x prompt over one prefill and the first token's pick. Decode tokens/s: batch x
(new - 1) over the steps after the first. microgpt's steps run from its graph on the GPU with the greedy pick on
the device (the step's own argmax into the plan's next_ids; the prefill's by torch.argmax, the bench's glue), fed
back into the planned tokens buffer by the bench; transformers' through
generate(), whose decode time is generate(new) less generate(1). Times are medians of --repeats runs after one
untimed (compiles, tunes, captures). Rows also give each impl's greedy tokens (every row's), peak device memory
(torch.cuda.max_memory_allocated less what was allocated when the row began: what earlier rows leave allocated,
transformers' compiled graphs and caches, is not the row's) and, for microgpt, the inference plan's bytes; its peak
adds the cuBLAS workspace the plan counts, which its backend allocated before the first row. The token record and the
pick's index buffer (bench_bytes) lie outside the plan.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt import checkpoint  # noqa: E402
from microgpt.config import Experiment, ModelConfig  # noqa: E402
from microgpt.engine import memory, params  # noqa: E402
from microgpt.engine.backend import Backend, numpy_backend, triton_backend  # noqa: E402
from microgpt.engine.infer import make_infer_state  # noqa: E402
from microgpt.engine.trained import load_trained
from microgpt.use import export  # noqa: E402

SHAPES = {
    "andrea-120m": ModelConfig(vocab_size=50304, d_model=768, n_layer=12, n_head=12, seq_len=1024),
    "tiny": ModelConfig(vocab_size=256, d_model=32, n_layer=2, n_head=2, seq_len=64),
    # ANDREA-120M's vocabulary on a model too small to cost: what the host does per token (dev/serve_profile.py)
    "tiny-wide": ModelConfig(vocab_size=50304, d_model=8, n_layer=1, n_head=2, seq_len=512),
    # a step that costs the CPU little beside the host's work per token (a BPE's decoding): bench/serve.py on the CPU
    "tiny-host": ModelConfig(vocab_size=2048, d_model=8, n_layer=1, n_head=2, seq_len=512),
}
IMPLS = ["microgpt", "hf", "hf-compile"]


def weights(args: argparse.Namespace, folder: Path) -> tuple[ModelConfig, np.ndarray, Path]:
    """The model, its flat fp32 weights and the checkpoint they are in (written to folder for random weights)."""
    if args.checkpoint:
        ld = load_trained(args.checkpoint)
        return ld.exp.model, ld.weights, ld.path
    return random_checkpoint(args.shape, folder)


def random_checkpoint(shape: str, folder: Path, tokenizer: dict | None = None) -> tuple[ModelConfig, np.ndarray, Path]:
    """SHAPES[shape] at the seeded init moved off it (so that greedy tokens are not decided by near-ties), written to
    folder as step-0.bin with `tokenizer` as its sidecar's record (default: the byte tokenizer). bench/serve.py uses
    it too."""
    m = SHAPES[shape]
    w = params.init_weights(m, 0)
    w += np.random.default_rng(0).standard_normal(w.shape).astype(np.float32) * 0.05
    meta = {"config": Experiment(name=f"bench-{shape}", model=m).to_dict(), "tokenizer": tokenizer or {"kind": "bytes"}}
    zeros = np.zeros_like(w)
    return m, w, checkpoint.write_checkpoint(folder / "step-0.bin", 0, w, zeros, zeros, meta)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], repeats: int, cuda: bool) -> float:
    """Median seconds of fn over `repeats` runs after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        sync(cuda)
        t0 = time.perf_counter()
        fn()
        sync(cuda)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def backend(args: argparse.Namespace) -> Backend:
    """microgpt's backend for every row of the run: one runtime, so one side stream and one cuBLAS workspace (a
    second runtime's stream would hold a second workspace, which no plan counts)."""
    return triton_backend(args.precision) if args.device == "cuda" else numpy_backend()


def run_microgpt(
    K: Backend, m: ModelConfig, w: np.ndarray, prompts: np.ndarray, n_new: int, args: argparse.Namespace
) -> dict:
    cuda = args.device == "cuda"
    b, t = prompts.shape
    record = torch.zeros(n_new, b, dtype=torch.int64, device=args.device)  # the bench's: outside the plan
    S = make_infer_state(m, K, b, w)
    plan = sum(memory.role_bytes(S.plan, K.precision).values())
    tokens, _ = S.inputs(b, t)
    K.copy_in(tokens, prompts)
    logits, greedy, rows = S.arena["next_logits"][:b], S.arena["next_ids"][:b], np.arange(b)
    run = K.prepare(lambda: S.run(tokens, 0), False)  # on a GPU: a warm-up that times the choices first

    def prefill() -> None:
        run()
        if cuda:
            torch.argmax(logits, dim=-1, out=record[0])
        else:
            record[0] = torch.from_numpy(logits.argmax(-1))

    prefill_s = timed(prefill, args.repeats, cuda)
    S.decode(record[0].cpu().numpy(), np.full(b, t), rows)  # prepares batch b's step (on a GPU: its graph)
    replay, inputs = S.decoders[b], S.decode_inputs(b)

    def steps() -> None:  # tokens 1 .. n_new - 1, each from the step at the position before it
        for i in range(n_new - 1):
            if cuda:  # the pick on the device, fed straight into the planned inputs
                inputs[0].copy_(record[i])
                inputs[1].fill_(t + i)
                replay()
                record[i + 1].copy_(greedy)
            else:
                S.decode(record[i].numpy(), np.full(b, t + i), rows)
                record[i + 1] = torch.from_numpy(greedy.astype(np.int64))

    decode_s = timed(steps, args.repeats, cuda)
    # allocated_before: the plan's runtime row (cuBLAS's workspace), which the backend allocated before the first row
    out = {
        "device": K.device,
        "plan_gib": plan / memory.GIB,
        "bench_bytes": record.numel() * 8,
        "allocated_before": memory.role_bytes(S.plan, K.precision)["runtime"],
    }
    if cuda:
        from microgpt.kernels import decode as kd  # torch and triton's: on the GPU path only

        out["splits"] = kd.split_plan(b, m.seq_len, m.n_head, K.kernel_args["decode_attention"]["sm_count"])[0]
    return {**out, **rates(b, t, n_new, prefill_s, decode_s), "tokens": record.T.tolist()}


def rates(b: int, t: int, n_new: int, prefill: float, decode: float) -> dict:
    """The row's rates: b rows of t prompt tokens in `prefill` seconds, n_new - 1 tokens each in `decode`."""
    per_token = decode / (n_new - 1)
    return {
        "prefill_ms": 1e3 * prefill,
        "prefill_tokens_per_s": b * t / prefill,
        "decode_ms_per_token": 1e3 * per_token,
        "decode_tokens_per_s": b / per_token,
    }


def run_hf(folder: Path, prompts: np.ndarray, n_new: int, args: argparse.Namespace, compiled: bool) -> dict:
    from transformers import GPT2LMHeadModel

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    net = GPT2LMHeadModel.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
    net.generation_config.eos_token_id = None  # every row runs --new tokens (no stop token)
    ids = torch.from_numpy(prompts).long().to(args.device)
    kw = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    kw |= {"cache_implementation": "static"} if compiled else {"disable_compile": True}
    got: list[torch.Tensor] = []

    def gen(n: int) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                got[:] = [net.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)]

        return run

    prefill = timed(gen(1), args.repeats, cuda)
    both = timed(gen(n_new), args.repeats, cuda)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    return {
        "device": device,
        **rates(*prompts.shape, n_new, prefill, both - prefill),
        "tokens": got[0][:, prompts.shape[1] :].tolist(),
    }


def row(
    impl: str, b: int, args: argparse.Namespace, K: Backend | None, m: ModelConfig, w: np.ndarray, folder: Path
) -> dict:
    """One impl at batch b, its failure caught into "error" (torch.compile's where it does not run)."""
    prompts = np.random.default_rng(b).integers(0, m.vocab_size, (b, args.prompt)).astype(np.int32)
    base = {"impl": impl, "batch": b, "prompt": args.prompt, "new": args.new, "precision": args.precision}
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()  # what earlier rows left (compiled graphs, caches) is not this row's
    try:
        if impl == "microgpt":
            res = run_microgpt(K, m, w, prompts, args.new, args)
        else:
            with torch.cuda.stream(torch.cuda.default_stream()) if args.device == "cuda" else nullcontext():
                res = run_hf(folder, prompts, args.new, args, impl == "hf-compile")
    except Exception as e:
        lines = str(e).strip().splitlines() or [""]
        res = {"error": f"{type(e).__name__}: {lines[0][:300]}"}
    if args.device == "cuda":
        grown = torch.cuda.max_memory_allocated() - start + res.pop("allocated_before", 0)
        res["peak_gib"] = grown / memory.GIB
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {**base, **res}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=SHAPES, help="default: andrea-120m on cuda, tiny on cpu")
    p.add_argument("--checkpoint", help="a step-*.bin or run folder whose weights to use (default: random)")
    p.add_argument("--batches", type=int, nargs="+", help="default: 1 32 on cuda, 1 3 on cpu")
    p.add_argument("--prompt", type=int, help="prompt tokens a row (default: 512 on cuda, 16 on cpu)")
    p.add_argument("--new", type=int, help="tokens generated a row (default: 128 on cuda, 8 on cpu)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="default: all on cuda, microgpt hf on cpu")
    p.add_argument("--repeats", type=int, default=3)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    gpu = args.device == "cuda"
    args.shape = args.shape or ("andrea-120m" if gpu else "tiny")
    args.batches = args.batches or ([1, 32] if gpu else [1, 3])
    args.prompt, args.new = args.prompt or (512 if gpu else 16), args.new or (128 if gpu else 8)
    args.impls = args.impls or (IMPLS if gpu else ["microgpt", "hf"])
    args.precision = "bf16" if gpu else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        m, w, ckpt = weights(args, Path(tmp))
        if args.prompt + args.new > m.seq_len or args.new < 2:
            print(f"error: --prompt + --new must be at most seq_len {m.seq_len}, --new at least 2", file=sys.stderr)
            return 2
        folder = export.export(ckpt, Path(tmp) / "hf", args.precision)
        K = backend(args) if "microgpt" in args.impls else None
        for b in args.batches:
            for impl in args.impls:
                print(json.dumps(row(impl, b, args, K, m, w, folder)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
