"""The report card of a run: `<out>/report.md` (for people) and `<out>/report.json` (the same numbers), written by
`microgpt train` when a run ends and when it is stopped (SIGTERM), from the run folder's log (train.jsonl, every
process of the run) and the trainer's state at its last step.

    recipe       the command, the experiment file and its sha256, the overrides (--set, --steps, --seed, --backend,
                 --precision, --init)
    tokens seen  the steps' tokens (all ranks): micro-batches read x micro_batch x seq_len x ranks, the micro-batches
                 steps x n_micro, less what a batch warmup's first steps left out (data/loader.py MicroSchedule)
    losses       the last step's train loss and the mean of the last LAST_STEPS steps, the last evaluation's val
                 loss (which windows it scores: Trainer.eval_windows), in nats per token and in bits per byte:
                 loss / ln 2 / (bytes per token of the scored targets: the last step's batches for train, the
                 evaluated windows for val; a special token counts its string's bytes, as `microgpt eval` does)
    speed        tokens/s: the median of this process's step records, its first step (warm-up, compile) left out;
                 MFU = tokens/s x FLOPs/token / (peak FLOP/s x ranks), FLOPs/token = 6N + 12 L T d (PaLM's count)
                 with N every parameter a token's forward multiplies by (engine/params.py flops_params); the
                 peak is the GPU's dense bf16/fp16 tensor-core one (PEAKS), so there is no MFU in fp32 or on the CPU
    memory       the plan's total against the measured peak: the GPU allocator's (torch.cuda.max_memory_allocated),
                 or on the CPU the process's peak resident memory (the arena plus Python, NumPy's temporaries, data)
    time         this process's training seconds, and the run's (elapsed_s: every process's, from the checkpoints)
    device, versions, checkpoints, and a few samples from the final weights (SAMPLE_TOKENS tokens each, seed =
                 the step; a chat prompt's reply stops at <|im_end|>)
    git          the commit of the checkout the package was run from (trainer.git_commit); "unknown" for a
                 package installed into site-packages or anywhere outside a git checkout

    hellaswag    the last HellaSwag score of a run with train.hellaswag (acc, acc_norm, examples, step); without
                 it, none (`microgpt eval --hellaswag FILE` measures a checkpoint)
    log          the log's path, its records and the lines passed over as unreadable (runlog.load_log: the card is
                 made from the rest, and the terminal is told once)

report.json is strict JSON (a number that is not finite is null). A card that cannot be written is one `error:`
line: exit 4 when the disk refuses it (full, read-only), exit 2 when the path does (report.md a folder).
"""

from __future__ import annotations

import math
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import checkpoint, runlog
from microgpt.data.chatml import prompt_text
from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine import memory, params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.infer import make_infer_state
from microgpt.engine.trained import load_trained
from microgpt.errors import InputError, output_error
from microgpt.fileio import atomic_write_bytes, atomic_write_json, finite
from microgpt.use import sample
from microgpt.use.chat import STOPS
from microgpt.use.evaluate import token_bytes

REPORT_FORMAT = "microgpt-report-1"
JSON_NAME, MD_NAME = "report.json", "report.md"  # in the run folder
LAST_STEPS = 10
SAMPLE_TOKENS = 48
DEFAULT_PROMPTS: list[Any] = ["def ", "class ", "import "]  # the proxy's defaults too (proxy/phases.py)
CHAT_PROMPTS: list[Any] = [[{"role": "user", "content": "Hello! What can you do?"}]]  # loss-masked (chat) data
RSS_NAME = "peak resident memory of the process (ru_maxrss)"
# Dense bf16/fp16 tensor-core peaks (NVIDIA datasheets, FLOP/s per GPU), for MFU; the first match wins. The
# dashboard reads the peak from the start record (peak_flops): this table is its one home.
PEAKS = (("GH200", 989e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("B200", 2250e12),
         ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12), (" L4", 121e12), ("RTX 4090", 165e12))  # fmt: skip
# The compute dtypes with a tensor-core peak. A run's MFU is counted against its compute dtype's peak, also where
# its GEMMs run in a narrower format (fp8 computes in bf16), so that its MFU compares with bf16's.
MFU_COMPUTE = ("bf16", "fp16")


def peak_flops(device: str, compute: str) -> float | None:
    """The device's dense tensor-core peak for MFU of a run computing in `compute` (its precision's compute dtype),
    or None (the CPU, an unknown GPU, fp32)."""
    if compute not in MFU_COMPUTE:
        return None
    return next((peak for name, peak in PEAKS if name in device), None)


def bits_per_byte(loss: float | None, ys: list[np.ndarray], nbytes: np.ndarray | None) -> float | None:
    """loss (nats per token) over the bytes the scored targets (y >= 0) stand for; None without a byte table."""
    if loss is None or nbytes is None:
        return None
    scored = np.concatenate([y[y >= 0].reshape(-1) for y in ys])
    total = int(nbytes[scored].sum())
    return loss / math.log(2) * len(scored) / total if total else None


def _is_number(v: Any) -> bool:
    """A number the log holds (runlog: null where it was not finite)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _losses(tr: Any, records: list[dict[str, Any]], nbytes: np.ndarray | None) -> dict[str, Any]:
    """Final train and val losses from the log (a later record of a step replaces an earlier one: a resume)."""
    train = {r["step"]: r["loss"] for r in records if r["event"] == "step" and r["step"] <= tr.step}
    evals = [r for r in records if r["event"] == "eval" and _is_number(r.get("val_loss")) and r["step"] <= tr.step]
    last = [train[s] for s in sorted(train)[-LAST_STEPS:]]
    t, val = tr.t, evals[-1] if evals else None
    val_ys = [ld.val_batch(i)[1] for ld in tr.val_data.sources.values() for i in range(t.eval_batches)]
    loss = train.get(tr.step)
    return {
        "unit": "nats per token",
        "train": loss,
        "train_step": tr.step if loss is not None else None,
        "train_mean_last": statistics.fmean(last) if last else None,
        "train_mean_steps": len(last),
        "train_bits_per_byte": bits_per_byte(loss, tr.last_targets, nbytes) if tr.last_targets else None,
        "val": val["val_loss"] if val else None,
        "val_step": val["step"] if val else None,
        "val_windows": tr.eval_windows(),
        "val_bits_per_byte": bits_per_byte(val["val_loss"] if val else None, val_ys, nbytes),
    }


def _hellaswag(tr: Any, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last HellaSwag score in the log (train.hellaswag), or None."""
    hs = [r for r in records if r["event"] == "eval" and _is_number(r.get("hellaswag")) and r["step"] <= tr.step]
    if not hs:
        return None
    r = hs[-1]
    return {
        "acc": r["hellaswag"],
        "acc_norm": r.get("hellaswag_acc_norm"),
        "examples": r.get("hellaswag_examples"),
        "step": r["step"],
        "file": tr.t.hellaswag,
    }


def _speed(tr: Any, records: list[dict[str, Any]], start: int) -> dict[str, Any]:
    mine = [r["tokens_per_s"] for r in records[start:] if r["event"] == "step" and _is_number(r.get("tokens_per_s"))]
    tps = statistics.median(mine[1:] or mine) if mine else None
    fpt, (n, what) = params.flops_per_token(tr.m), params.flops_params(tr.m)
    peak = peak_flops(tr.K.device, tr.K.precision.compute)
    mfu = tps * fpt / (peak * tr.world) if tps and peak else None
    why = None if mfu is not None else f"no known dense peak for {tr.K.device} in {tr.t.precision}"
    return {
        "tokens_per_s": tps,
        "flops_per_token": fpt,
        "n_params": n,
        "peak_flops": peak,
        "mfu": mfu,
        "mfu_missing": why,
        "formula": "6N + 12*L*T*d",
        "n": what,
    }


def _samples(path: Path, exp: Any) -> list[dict[str, Any]]:
    """A few continuations from the checkpoint at `path` (the final weights), on the CPU (sample.py)."""
    ld = load_trained(path)
    try:
        tok = load_tokenizer(ld.side.get("tokenizer", {}))
    except InputError as e:
        return [{"error": f"no tokenizer to sample with: {e}"}]
    prompts = exp.extra.get("proxy", {}).get("prompts") if isinstance(exp.extra.get("proxy"), dict) else None
    if not isinstance(prompts, list) or not prompts:
        prompts = CHAT_PROMPTS if exp.data.loss_mask else DEFAULT_PROMPTS
    out, gen = [], sample.Generator(make_infer_state(ld.exp.model, numpy_backend(), 1, ld.weights))
    for prompt in prompts[:3]:
        ids = tok.encode(prompt_text(prompt)) or [tok.eot_id]
        text = tok.decode(sample.generate(gen, ids, SAMPLE_TOKENS, sample.Sampling(0.8, 40), [ld.step])[0])
        if not isinstance(prompt, str):  # a chat reply ends at its <|im_end|> (or <|endoftext|>)
            text = text[: min([text.find(s) for s in STOPS if s in text] or [len(text)])]
        out.append({"prompt": prompt, "text": text, "tokens": SAMPLE_TOKENS, "temperature": 0.8, "seed": ld.step})
    return out


def _checkpoints(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in checkpoint.list_checkpoints(out / "ckpt")[:50]:
        try:
            reason = checkpoint.read_sidecar(path).get("reason")
        except checkpoint.CheckpointError:
            reason = "unreadable sidecar"
        rows.append({"path": str(path), "step": checkpoint.step_of(path), "reason": reason})
    return rows


def _records(tr: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The run's records from its log (runlog.load_log: what cannot be read is passed over), and what the card says
    of the log; what was passed over is said once on the terminal."""
    path = tr.log.path
    if path is None:
        return [], {"path": None, "records": 0, "unreadable": 0}
    try:
        log = runlog.load_log(path)
    except InputError as e:  # a log that cannot be read at all: the card says what this process knows
        tr.log.say(f"warning: {e}; the report card leaves the earlier records out")
        return [], {"path": str(path), "records": 0, "unreadable": None}
    note = log.note(path)
    if note is not None:
        tr.log.say(f"warning: {note}; the report card is made from the rest")
    return log.records, {"path": str(path), "records": len(log.records), "unreadable": log.unreadable}


def card(tr: Any, final: Path | None) -> dict[str, Any]:
    """The report card's numbers (report.json) for trainer `tr` at its last step; `final` its checkpoint."""
    records, log = _records(tr)
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    first = records[starts[-1]] if starts else tr.start_record()
    info = tr.tokenizer_info
    nbytes = None if info.get("kind") in (None, "unknown") else token_bytes(load_tokenizer(info), tr.m.vocab_size)
    t, plan = tr.t, sum(memory.role_bytes(tr.S.plan, tr.K.precision).values())
    per_micro = t.micro_batch * tr.m.seq_len * tr.world
    per_step = t.n_micro * per_micro
    peak = tr.memory_peak()
    return {
        "format": REPORT_FORMAT,
        "run": tr.exp.name,
        "outcome": tr.outcome,
        "step": tr.step,
        "steps": t.steps,
        "written": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "recipe": tr.recipe,
        "init": tr.init or None,
        "config": tr.exp.to_dict(),
        "tokens": {"seen": tr.micro.before(tr.step) * per_micro, "per_step": per_step},
        "loss": _losses(tr, records, nbytes),
        "hellaswag": _hellaswag(tr, records),
        "speed": _speed(tr, records, starts[-1] if starts else 0),
        "memory": {
            "plan_bytes": plan,
            "peak_bytes": peak,
            "measured_as": first.get("memory_measure"),
            "peak_over_plan": peak / plan,
        },
        "time": {"process_training_s": tr.elapsed() - tr.elapsed0, "run_training_s": tr.elapsed()},
        "device": tr.K.device,
        "backend": t.backend,
        "precision": t.precision,
        "world_size": tr.world,
        "versions": first.get("versions"),
        "git": first.get("git"),
        "checkpoints": _checkpoints(tr.out),
        "samples": _samples(final, tr.exp) if final is not None else [],
        "log": log,
    }


def write(tr: Any, final: Path | None) -> Path:
    """report.json and report.md in the run folder (atomic writes: a cut-short write keeps the previous card).
    report.json is strict JSON (a number that is not finite is null). A card the disk refuses (full, read-only) is
    a WriteError (exit 4), one a path refuses (report.md a folder) an InputError (exit 2): one line either way."""
    c = finite(card(tr, final))
    path = tr.out / JSON_NAME
    tr.log.check_folder()  # the run folder moved aside: the card is written nowhere
    try:
        atomic_write_json(path, c, anchor=tr.log.anchor)
        path = tr.out / MD_NAME
        atomic_write_bytes(path, [markdown(c).encode()], anchor=tr.log.anchor)
    except OSError as e:
        tr.log.check_folder()  # the folder moved away during the write: that is then what happened
        raise output_error(e, f"{path}: cannot write the report card") from None
    return path


def _num(v: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _hms(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def _recipe(r: dict[str, Any]) -> str:
    changed = [f"`{o}`" for o in r.get("overrides", [])]
    sha = (r.get("experiment_sha256") or "")[:12]
    return (
        f"`{r.get('command', '?')}`; experiment {r.get('experiment', '?')} (sha256 {sha}...); overrides: "
        f"{', '.join(changed) or 'none'}"
    )


def _tokens_seen(tok: dict[str, Any], steps: int) -> str:
    """The tokens read, and how: per step x steps, or fewer than that where a batch warmup's first steps read less."""
    full = tok["per_step"] * steps
    how = "" if tok["seen"] == full else f"; {full - tok['seen']:,} fewer in the batch warmup's first steps"
    return f"{tok['seen']:,} ({tok['per_step']:,} per step x {steps:,} steps{how})"


def markdown(c: dict[str, Any]) -> str:
    """The card for people: one table of the numbers, then the samples."""
    loss, speed, mem, tok, hs = c["loss"], c["speed"], c["memory"], c["tokens"], c.get("hellaswag")
    v = c["versions"] or {}
    mfu = f"{100 * speed['mfu']:.1f}%" if speed["mfu"] else f"n/a ({speed['mfu_missing']})"
    rows = [
        ("recipe", _recipe(c["recipe"])),
        ("init", f"weights of {c['init']['path']} (step {c['init']['step']})" if c["init"] else "none (from seed)"),
        ("tokens seen", _tokens_seen(tok, c["step"])),
        (
            "train loss",
            f"{_num(loss['train'], '.4f')} nats/token at step {loss['train_step']} (mean of the last "
            f"{loss['train_mean_steps']} steps {_num(loss['train_mean_last'], '.4f')}); "
            f"{_num(loss['train_bits_per_byte'], '.4f')} bits/byte",
        ),
        (
            "val loss",
            f"{_num(loss['val'], '.4f')} nats/token at step {loss['val_step']} ({loss['val_windows']}); "
            f"{_num(loss['val_bits_per_byte'], '.4f')} bits/byte",
        ),
        *(
            [
                (
                    "hellaswag",
                    f"acc {hs['acc']:.4f}, acc_norm {_num(hs['acc_norm'], '.4f')} on {hs['examples']:,} "
                    f"examples of {hs['file']} at step {hs['step']}",
                )
            ]
            if hs
            else []
        ),
        ("speed", f"{_num(speed['tokens_per_s'], ',.0f')} tokens/s (median of this process's steps); MFU {mfu}"),
        ("FLOPs/token", f"{speed['flops_per_token']:,} = {speed['formula']}, N = {speed['n_params']:,} = {speed['n']}"),
        (
            "memory",
            f"plan {_mib(mem['plan_bytes'])}; measured peak {_mib(mem['peak_bytes'])}, "
            f"{mem['peak_over_plan']:.2f}x the plan: {mem['measured_as']}",
        ),
        (
            "time",
            f"{_hms(c['time']['process_training_s'])} of training in this process, "
            f"{_hms(c['time']['run_training_s'])} in the run",
        ),
        ("device", f"{c['device']} ({c['backend']} backend, {c['precision']}), {c['world_size']} process(es)"),
        ("versions", ", ".join(f"{k} {x}" for k, x in v.items()) + f"; git {(c['git'] or 'unknown')[:12]}"),
        (
            "checkpoints",
            ", ".join(f"{Path(k['path']).name} ({k['reason']})" for k in c["checkpoints"][:6])
            + (f" and {len(c['checkpoints']) - 6} more" if len(c["checkpoints"]) > 6 else ""),
        ),
        *(
            [("log", f"{c['log']['unreadable']} unreadable line(s) of {c['log']['path']} passed over")]
            if c["log"]["unreadable"]
            else []
        ),
    ]
    lines = [
        f"# {c['run']}: report card",
        "",
        f"{c['outcome']} at step {c['step']:,} of {c['steps']:,}, {c['written']}",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {str(x).replace('|', '/')} |" for k, x in rows]
    samples = c["samples"]
    if samples:
        lines += ["", f"## Samples (temperature 0.8, {SAMPLE_TOKENS} tokens, seed = step {c['step']})"]
    for s in samples:
        if "error" in s:
            lines += ["", s["error"]]
            continue
        shown = s["prompt"] if isinstance(s["prompt"], str) else s["prompt"][-1]["content"]
        lines += [
            "",
            f"prompt `{shown!r}`" + ("" if isinstance(s["prompt"], str) else " (a chat turn)"),
            "",
            "```text",
            s["text"].replace("```", "'''"),
            "```",
        ]
    return "\n".join(lines) + "\n"
