"""`microgpt <command> ...`: train, sample, chat, run (the proxy), prep, pull-hermes3.

Bad input (experiment, data, checkpoint, flags) ends with one line `error: ...` naming the file, field or
flag, and exit code 2; nothing already written is touched before the input has been checked.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import microgpt
from microgpt import checkpoint, config, memory, runlock
from microgpt.errors import ArgParser, exit_on_input_error, fail
from microgpt.events import Heartbeat

# Commands whose code lives in other modules: name -> (module with main(argv) -> int, help).
DELEGATED = {
    "run": ("microgpt.proxy.supervisor", "supervise a training run (proxy, restarts, phases, dashboard)"),
    "prep": ("microgpt.data.prep", "prepare the megachat corpus: tokenizer and token shards"),
    "pull-hermes3": ("microgpt.data.pull", "pull and validate the Hermes-3 dataset"),
    "chat": ("microgpt.chat", "chat with a checkpoint (ChatML), one user turn per line of stdin"),
    "export": ("microgpt.export", "write a checkpoint as a Hugging Face transformers folder"),
    "eval": ("microgpt.evaluate", "loss, perplexity, bits per byte or HellaSwag accuracy of a checkpoint"),
}


def train_parser() -> ArgParser:
    p = ArgParser(prog="microgpt train", description="Train a model from an experiment file.")
    config.add_experiment_flags(p)  # the flags `microgpt run` takes too
    p.add_argument("--resume", help="checkpoint to continue from (bit-exact); 'latest': the newest in --out, if any")
    return p


def cmd_train(argv: list[str]) -> int:
    args = train_parser().parse_args(argv)
    from microgpt import data, distributed  # numpy-heavy imports only once the flags parse

    exp = data.validate(config.from_flags(args), args.experiment)  # and the sections the data layer owns
    out = Path(args.out or Path("runs") / exp.name)
    if distributed.rank() != 0:  # rank 0 alone writes the folder and holds its lock (runlock)
        return train_in(out, exp, args, argv)
    launcher = (args.procs or 1) > 1 and not distributed.launched()  # its rank 0 beats, on the same stdout
    with runlock.acquire(out) as lock, Heartbeat(on=not launcher):
        for temp in checkpoint.remove_temp_files(out / "ckpt"):
            print(f"removed {temp}: the temp file of a checkpoint write that did not finish", file=sys.stderr)
        return train_in(out, exp, args, argv, lock)


def train_in(out: Path, exp: config.Experiment, args: argparse.Namespace, argv: list[str],
             lock: runlock.RunLock | None = None) -> int:  # fmt: skip
    """`microgpt train` in run folder out, locked by this process (or by the rank-0 process of its job)."""
    from microgpt import data, distributed, trainer

    trainer.check_out_dir(out)
    existing = checkpoint.list_checkpoints(out / "ckpt")
    if args.resume == "latest":  # the newest valid checkpoint under --out, or a fresh start in an empty one
        skipped: list[str] = []
        found = checkpoint.latest_valid_checkpoint(out / "ckpt", memory.n_params(exp.model),
                                                   on_skip=lambda path, why: skipped.append(why))  # fmt: skip
        if existing and found is None:
            return fail(f"--resume latest: {out / 'ckpt'} holds checkpoints but none is valid for this model "
                        f"(newest: {skipped[0]}); choose another --out")  # fmt: skip
        args.resume = str(found) if found else None
    if existing and not args.resume:
        return fail(f"--out {out}: already holds checkpoints (newest {existing[0].name}); "
                    "pass --resume or choose another --out")  # fmt: skip
    if args.resume and not Path(args.resume).is_file():  # before the model and the data are built
        raise checkpoint.CheckpointError(f"--resume {args.resume}: no such checkpoint file")
    if args.resume and (checkpoint.read_step(args.resume) or 0) >= exp.train.steps:
        return finished(args, exp)
    if (args.procs or 1) > 1 and not distributed.launched():  # the launcher: N copies of this command
        distributed.check_job(exp, args.procs)  # before any rank starts: one error line, not one per rank
        cmd = [sys.executable, "-m", "microgpt.cli", "train", *argv]
        return distributed.launch(cmd, args.procs, lock.child_env() if lock else {}, (lock.fd,) if lock else ())
    dp = distributed.from_env(exp.train.backend, args.procs)  # None: one process, and no torch import
    tr = None
    try:
        if dp is not None and exp.data.source == "builtin":
            dp.rank0_first(lambda: data.ensure_builtin(exp, data.shard_dir(exp)))  # built once, not N times at once
        tr = trainer.Trainer(exp, out, dp=dp)
        if args.resume:
            tr.load(args.resume)
        # rank 0 copies tokenizer.json into the run folder (and writes every checkpoint's sidecar)
        tr.tokenizer_info = data.tokenizer_info(exp, out if tr.rank == 0 else None)
        if tr.rank == 0:
            print(memory.format_plan(tr.S.plan, exp.train), file=sys.stderr)
        return tr.run()
    finally:
        if dp is not None:
            if tr is not None:
                tr.step_fn.release()  # its CUDA graph holds NCCL work: destroying the communicator first hangs
            dp.close()


def finished(args: argparse.Namespace, exp: config.Experiment) -> int:
    """--resume from a checkpoint at or past train.steps: nothing to train. At it, the run is complete (exit 0,
    its final checkpoint left as it is); past it, --steps (or train.steps) is wrong: one `error:` line."""
    ck, _ = checkpoint.load(args.resume, memory.n_params(exp.model))  # a step read from a valid checkpoint only
    steps = f"--steps {args.steps}" if args.steps is not None else f"{args.experiment}: train.steps {exp.train.steps}"
    if ck.step > exp.train.steps:
        return fail(f"{steps}: the checkpoint {args.resume} is at step {ck.step}, beyond it; "
                    "pass a larger --steps to train on, or resume an earlier checkpoint")  # fmt: skip
    print(f"already complete: {args.resume} is at step {ck.step}, the run's last ({steps}); nothing to train",
          file=sys.stderr)  # fmt: skip
    return 0


def cmd_sample(argv: list[str]) -> int:
    p = ArgParser(prog="microgpt sample", description="Generate text from a checkpoint.")
    p.add_argument("checkpoint", help="a step-*.bin checkpoint, or a run folder (its newest valid checkpoint)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample among the K likeliest tokens")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of plain text")
    p.add_argument("--chat", action="store_true", help="the prompt is one ChatML user turn; print the reply")
    args = p.parse_args(argv)
    from microgpt import chat, sample

    return chat.sample_chat(args) if args.chat else sample.main(args)


COMMANDS = {"train": (cmd_train, "train a model"), "sample": (cmd_sample, "generate text from a checkpoint")}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand; every bad input (errors.InputError) becomes one `error:` line and exit 2, here."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        print(f"microgpt {microgpt.__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: microgpt <command> [args]   (microgpt --version; microgpt <command> --help)\n\ncommands:")
        for name, (_, text) in {**COMMANDS, **DELEGATED}.items():
            print(f"  {name:<14}{text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in COMMANDS:
        return exit_on_input_error(COMMANDS[name][0], rest)
    if name in DELEGATED:
        return exit_on_input_error(importlib.import_module(DELEGATED[name][0]).main, rest)
    return fail(f"unknown command {name!r} (try: microgpt --help)")


if __name__ == "__main__":
    sys.exit(main())
