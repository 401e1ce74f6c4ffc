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

from microgpt import checkpoint, config, memory

# Commands whose code lives in other modules: name -> "module:function(argv) -> int".
DELEGATED = {
    "run": ("microgpt.training_proxy", "supervise a training run (proxy, restarts, phases, dashboard)"),
    "prep": ("microgpt.prep", "prepare the megachat corpus: tokenizer and token shards"),
    "pull-hermes3": ("microgpt.hermes", "pull and validate the Hermes-3 dataset"),
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
    args = p.parse_args(argv)
    from microgpt import data, engine  # numpy-heavy imports only once the flags parse

    try:
        exp = load_experiment(args)
        out = Path(args.out or Path("runs") / exp.name)
        existing = checkpoint.list_checkpoints(out / "ckpt")
        if args.resume == "latest":  # the newest valid checkpoint under --out, or a fresh start
            found = checkpoint.latest_valid_checkpoint(out / "ckpt", memory.n_params(exp.model))
            args.resume = str(found) if found else None
            existing = []
        if existing and not args.resume:
            return fail(f"--out {out}: already holds checkpoints (newest {existing[0].name}); "
                        "pass --resume or choose another --out")  # fmt: skip
        trainer = engine.Trainer(exp, out)
        if args.resume:
            trainer.load(args.resume)
        engine.check_out_dir(out)
        trainer.tokenizer_info = data.tokenizer_info(exp, out)  # copies tokenizer.json into the run folder
    except (config.ConfigError, checkpoint.CheckpointError) as e:
        return fail(str(e))
    print(memory.format_plan(trainer.bufs, exp.train.precision), file=sys.stderr)
    return trainer.run()


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
    except (config.ConfigError, checkpoint.CheckpointError) as e:
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
        return importlib.import_module(DELEGATED[name][0]).main(rest)
    return fail(f"unknown command {name!r} (try: microgpt --help)")


if __name__ == "__main__":
    sys.exit(main())
