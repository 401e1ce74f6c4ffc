"""(CPU) A run's GGUF export in the real llama.cpp (llama-cpp-python: `make check-gguf`'s .venv-gguf) against microgpt.

    .venv-gguf/bin/python dev/gguf_check.py RUN [--dtype fp32|fp16|q8_0] [--kv f16|f32]

Exports RUN's newest checkpoint (`microgpt export --format gguf`, into a temp folder), loads it in llama.cpp with a
context of model.seq_len and its KV cache in f16 (llama.cpp's default) or f32, and for each prompt: llama.cpp
tokenizes it as microgpt does (else it stops), continues it greedily to the full context, and that text is compared
with `microgpt sample --temperature 0` for as many tokens; llama.cpp's logits at every position of prompt and
continuation against microgpt's decode step fed the same tokens. Prints one line a prompt, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's microgpt, installed or not

PROMPTS = [
    "def ",
    "class ",
    "import ",
    "def add(a, b):\n    return",
    "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
]
KV_TYPES = {"f16": 1, "f32": 0}  # ggml's type ids


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("--dtype", choices=("fp32", "fp16", "q8_0"), default="fp32")
    p.add_argument("--kv", choices=tuple(KV_TYPES), default="f16")
    args = p.parse_args()

    import llama_cpp

    from microgpt.data.tokenizer import load_tokenizer
    from microgpt.engine.trained import load_trained
    from microgpt.use import export, export_gguf, sample

    ld = load_trained(args.run)
    m = ld.exp.model
    tok = load_tokenizer(ld.side["tokenizer"])
    with tempfile.TemporaryDirectory() as tmp:
        path = export.export(args.run, Path(tmp) / "model.gguf", args.dtype, "gguf")
        size = path.stat().st_size
        kv = KV_TYPES[args.kv]
        llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=m.seq_len, n_batch=m.seq_len, n_threads=2, logits_all=True, verbose=False,
            type_k=kv, type_v=kv,
        )  # fmt: skip
        rows = []
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            if llm.tokenize(prompt.encode(), add_bos=False, special=True) != ids:
                print(f"prompt {prompt!r}: llama.cpp tokenizes it otherwise; stopped")
                return 1
            n = m.seq_len - len(ids)  # within the context: llama.cpp does not slide its window as sample does
            llm.reset()
            llm.eval(ids)
            theirs: list[int] = []
            for _ in range(n):
                theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval(theirs[-1:])
            seq = ids + theirs[:-1]
            gen = sample.load(args.run)[0]
            ours = np.stack([gen.feed([t]) for t in seq])
            diff = np.abs(np.array(llm.scores[: len(seq)]) - ours)
            cmd = [sys.executable, "-m", "microgpt.cli", "sample", args.run, "--prompt", prompt]
            res = subprocess.run(
                [*cmd, "--temperature", "0", "--tokens", str(n), "--json"], capture_output=True, text=True
            )
            same = res.returncode == 0 and json.loads(res.stdout)["text"] == tok.decode(theirs)
            rows.append({"prompt": prompt, "tokens": n, "same_text": same, "max_diff": float(diff.max())})
            print(
                f"{prompt!r}: {len(ids)} + {n} tokens; greedy text = microgpt sample's: {same}; logits max |diff| "
                f"{diff.max():.2e} (max |logit| {np.abs(ours).max():.2f})"
            )
    arch = export_gguf.arch(m)
    summary = {"checkpoint": str(ld.path), "arch": arch, "dtype": args.dtype, "kv": args.kv, "bytes": size}
    summary |= {"same_text": sum(r["same_text"] for r in rows), "prompts": len(rows)}
    summary["max_diff"] = max(r["max_diff"] for r in rows)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
