"""`microgpt <command> ...`: train, sample, run (the proxy), prep, pull-hermes3.

Bad input (experiment, data, checkpoint, flags) ends with one line `error: ...` naming the file, field or
flag, and exit code 2; nothing already written is touched before the input has been checked.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from microgpt import checkpoint, config, errors, memory

# Commands whose code lives in other modules: name -> "module:function(argv) -> int".
DELEGATED = {
    "run": ("microgpt.training_proxy", "supervise a training run (proxy, restarts, phases, dashboard)"),
    "prep": ("microgpt.data.prep", "prepare the megachat corpus: tokenizer and token shards"),
    "pull-hermes3": ("microgpt.data.pull", "pull and validate the Hermes-3 dataset"),
}


class ArgParser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit 2 (argparse's own code)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message}\n")


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def load_experiment(args: argparse.Namespace) -> config.Experiment:
    exp = config.load(args.experiment)
    for assignment in args.set or []:
        exp = config.override(exp, assignment)
    for flag, section, name in (("steps", "train", "steps"), ("seed", "train", "seed"),
                                ("backend", "train", "backend"), ("precision", "train", "precision")):  # fmt: skip
        value = getattr(args, flag)
        if value is not None:
            exp = config.override(exp, f"{section}.{name}={json.dumps(value)}", f"--{flag}")
    return exp


def cmd_train(argv: list[str]) -> int:
    p = ArgParser(prog="microgpt train", description="Train a model from an experiment file.")
    p.add_argument("experiment", help="experiments/ANDREA-*-TRAIN.json")
    p.add_argument("--steps", type=int, help="total optimizer steps of the run (the lr schedule's length)")
    p.add_argument("--out", help="run folder for checkpoints (default runs/<name>)")
    p.add_argument("--resume", help="checkpoint to continue from (bit-exact); 'latest': the newest in --out, if any")
    p.add_argument("--backend", choices=config.BACKENDS)
    p.add_argument("--precision", choices=config.PRECISIONS)
    p.add_argument("--seed", type=int)
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="override any config field")
    p.add_argument("--procs", "--gpus", dest="procs", type=int, metavar="N",
                   help="data parallel over N processes: one GPU each (triton, NCCL) or CPU processes (numpy, gloo); "
                   "torchrun-style RANK/WORLD_SIZE in the environment join a job instead")  # fmt: skip
    args = p.parse_args(argv)
    from microgpt import data, distributed, engine  # numpy-heavy imports only once the flags parse

    if args.procs is not None and args.procs < 1:
        return fail(f"--procs {args.procs}: must be >= 1")

    try:
        exp = data.validate(load_experiment(args), args.experiment)  # the sections the data layer owns
        out = Path(args.out or Path("runs") / exp.name)
        existing = checkpoint.list_checkpoints(out / "ckpt")
        if args.resume == "latest":  # the newest valid checkpoint under --out, or a fresh start in an empty one
            found = checkpoint.latest_valid_checkpoint(out / "ckpt", memory.n_params(exp.model))
            if existing and found is None:
                return fail(f"--resume latest: {out / 'ckpt'} holds checkpoints but none is valid for this model "
                            f"(newest {existing[0].name}); choose another --out")  # fmt: skip
            args.resume = str(found) if found else None
        if existing and not args.resume:
            return fail(f"--out {out}: already holds checkpoints (newest {existing[0].name}); "
                        "pass --resume or choose another --out")  # fmt: skip
        if (args.procs or 1) > 1 and not distributed.launched():  # the launcher: N copies of this command
            return distributed.launch([sys.executable, "-m", "microgpt.cli", "train", *argv], args.procs)
        dp = distributed.from_env(exp.train.backend, args.procs)  # None: one process, and no torch import
        if dp is not None and exp.data.source == "builtin":
            dp.rank0_first(lambda: data.ensure_builtin(exp, data.shard_dir(exp)))  # built once, not N times at once
        trainer = engine.Trainer(exp, out, dp=dp)
        if args.resume:
            trainer.load(args.resume)
        engine.check_out_dir(out)
        # rank 0 copies tokenizer.json into the run folder (and writes every checkpoint's sidecar)
        trainer.tokenizer_info = data.tokenizer_info(exp, out if trainer.rank == 0 else None)
    except errors.InputError as e:
        return fail(str(e))
    if trainer.rank == 0:
        extras = trainer.K.plan_extras(trainer.m, trainer.t) if hasattr(trainer.K, "plan_extras") else None
        print(memory.format_plan(trainer.bufs, exp.train.precision, extras), file=sys.stderr)
    try:
        return trainer.run()
    finally:
        if dp is not None:
            dp.close()


def cmd_sample(argv: list[str]) -> int:
    p = ArgParser(prog="microgpt sample", description="Generate text from a checkpoint.")
    p.add_argument("checkpoint", help="a step-*.bin checkpoint, or a run folder (its newest valid checkpoint)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of plain text")
    args = p.parse_args(argv)
    from microgpt import sample

    try:
        return sample.main(args)
    except errors.InputError as e:
        return fail(str(e))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"train": (cmd_train, "train a model"), "sample": (cmd_sample, "generate text from a checkpoint")}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: microgpt <command> [args]\n\ncommands:")
        for name, (_, text) in commands.items():
            print(f"  {name:<14}{text}")
        for name, (_, text) in DELEGATED.items():
            print(f"  {name:<14}{text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in commands:
        return commands[name][0](rest)
    if name in DELEGATED:
        return errors.exit_on_input_error(importlib.import_module(DELEGATED[name][0]).main, rest)
    return fail(f"unknown command {name!r} (try: microgpt --help)")


if __name__ == "__main__":
    sys.exit(main())
