"""`microgpt <command> ...`: train and sample here; run (the proxy), prep, pull-hermes3, chat, export, eval and serve
in the modules DELEGATED names.

Bad input (experiment, data, checkpoint, flags) ends with one line `error: ...` naming the file, field or
flag, and exit code 2; nothing already written is touched before the input has been checked.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import shlex
import sys
from pathlib import Path
from typing import Any

import microgpt
from microgpt import checkpoint, config, runlock
from microgpt.engine import backend, memory, params
from microgpt.errors import ArgParser, exit_on_input_error, fail
from microgpt.events import Heartbeat
from microgpt.runlog import LOG_NAME, RunLog

# Commands whose code lives in other modules: name -> (module with main(argv) -> int, help).
DELEGATED = {
    "run": ("microgpt.proxy.supervisor", "supervise a training run (proxy, restarts, phases, dashboard)"),
    "prep": ("microgpt.data.prep", "tokenizer and token shards: the built-in corpus, your text, chats, a recipe"),
    "pull-hermes3": ("microgpt.data.pull", "pull and validate the Hermes-3 dataset"),
    "chat": ("microgpt.use.chat", "chat with a checkpoint (ChatML), one user turn per line of stdin"),
    "export": ("microgpt.use.export", "a checkpoint as a transformers (GPT-2) folder or a GGUF file (llama.cpp)"),
    "eval": ("microgpt.use.evaluate", "loss, perplexity, bits per byte or HellaSwag accuracy of a checkpoint"),
    "serve": ("microgpt.use.serve", "serve a checkpoint over an OpenAI-compatible HTTP API (chat, completions)"),
}


def train_parser() -> ArgParser:
    p = ArgParser(prog="microgpt train", description="Train a model from an experiment file.")
    config.add_experiment_flags(p)  # the flags `microgpt run` takes too
    p.add_argument(
        "--resume",
        metavar="CKPT|latest",
        help="checkpoint to continue from (bit-exact); 'latest': the newest in --out, if any",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help=f"also print every record as a JSON line on stdout (the run folder's {LOG_NAME} has them all; "
        "the proxy asks for them)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the flags, the experiment and the job (--procs: this machine's ranks and memory), "
        "then exit without writing anything (microgpt run asks for it before it starts)",
    )
    return p


def recipe(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """How the run was asked for: the command, the experiment file (and its sha256) and what overrides it."""
    try:
        sha = hashlib.sha256(Path(args.experiment).read_bytes()).hexdigest()
    except OSError:
        sha = None
    overrides = [f"--set {a}" for a in args.set] + ([f"--data {args.data}"] if args.data else [])
    overrides += [f"--{name} {value}" for name, value in config.train_flags(args).items() if value is not None]
    overrides += [f"--init {args.init}"] if args.init else []
    return {
        "command": shlex.join(["microgpt", "train", *argv]),
        "experiment": args.experiment,
        "experiment_sha256": sha,
        "overrides": overrides,
    }


def cmd_train(argv: list[str]) -> int:
    args = train_parser().parse_args(argv)
    from microgpt import data
    from microgpt.data import hellaswag_file as hellaswag
    from microgpt.run import job, trackers  # numpy-heavy imports only once the flags parse

    exp = data.validate(config.from_flags(args), args.experiment)  # and the sections the data layer owns
    hellaswag.check(exp, args.experiment)  # every line of train.hellaswag, before anything is written
    data.check_data(exp, args.experiment)  # the data exist and fit the model, or the prep command that makes them
    if args.check:
        if (args.procs or 1) > 1 and not job.launched():
            job.check_job(exp, args.procs)
        return 0
    out = Path(args.out or Path("runs") / exp.name)
    if job.rank() != 0:  # rank 0 alone writes the folder and holds its lock (runlock)
        return train_in(out, exp, args, argv)
    trackers.check(args.track, out)  # --track's folder and account (its package: config.check_flags)
    if args.resume not in (None, "latest"):  # before the run folder is made or locked, like every flag
        checkpoint.check_flag_path(args.resume, "--resume")
    if args.init and Path(args.init).exists():  # a missing one may go unused (a checkpoint to resume): train_in's
        checkpoint.check_flag_path(args.init, "--init", folder=True)
    launcher = (args.procs or 1) > 1 and not job.launched()  # its rank 0 beats, on the same stdout
    made = not out.exists()
    try:
        with runlock.acquire(out) as lock, Heartbeat(on=args.json and not launcher):  # JSON lines only where asked
            for temp in checkpoint.remove_temp_files(out / "ckpt"):
                print(f"removed {temp}: the temp file of a checkpoint write that did not finish", file=sys.stderr)
            return train_in(out, exp, args, argv, lock)
    finally:
        if made:
            remove_if_empty(out)


def remove_if_empty(out: Path) -> None:
    """A run folder this start made and left with nothing in it (a start that failed before its first record: no
    torch for a triton run, data that do not fit the model) goes again, with its lock file where it has one."""
    try:
        if {p.name for p in out.iterdir()} <= {runlock.NAME}:
            (out / runlock.NAME).unlink(missing_ok=True)
            out.rmdir()
    except OSError:
        pass  # a folder another process wrote into meanwhile, or one that cannot be listed: left as it is


def train_in(
    out: Path, exp: config.Experiment, args: argparse.Namespace, argv: list[str], lock: runlock.RunLock | None = None
) -> int:
    """`microgpt train` in run folder out, locked by this process (or by the rank-0 process of its job)."""
    from microgpt import data
    from microgpt.run import checkpoints, job, report, trainer
    from microgpt.run import trackers as tracking

    checkpoints.check_out_dir(out)
    existing = checkpoint.list_checkpoints(out / "ckpt")
    if args.resume == "latest":  # the newest valid checkpoint under --out, or a fresh start in an empty one
        skipped: list[str] = []
        found = checkpoint.latest_valid_checkpoint(
            out / "ckpt", params.n_params(exp.model), on_skip=lambda path, why: skipped.append(why)
        )
        if existing and found is None:
            return fail(
                f"--resume latest: {out / 'ckpt'} holds checkpoints but none is valid for this model "
                f"(newest: {skipped[0]}); choose another --out"
            )
        args.resume = str(found) if found else None
    if existing and not args.resume:
        return fail(
            f"--out {out}: already holds checkpoints (newest {existing[0].name}); pass --resume or choose another --out"
        )
    if args.resume:  # a regular file, before the model and the data are built
        checkpoint.check_flag_path(args.resume, "--resume")
    if args.resume and (checkpoint.read_step(args.resume) or 0) >= exp.train.steps:
        return finished(args, exp)
    init = None
    if args.init and not args.resume:  # read once, and checked against the model before anything is built or written
        checkpoint.check_flag_path(args.init, "--init", folder=True)
        init = checkpoints.read_init(args.init, exp.model)
    if (args.procs or 1) > 1 and not job.launched():  # the launcher: N copies of this command
        init = None  # checked (one error line, not one per rank); each rank reads its own
        job.check_job(exp, args.procs)  # before any rank starts: one error line, not one per rank
        cmd = [sys.executable, "-m", "microgpt.cli", "train", *argv]
        return job.launch(cmd, args.procs, lock.child_env() if lock else {}, (lock.fd,) if lock else ())
    dp = job.from_env(exp.train.backend, args.procs)  # None: one process, and no torch import
    tr = None
    try:
        if dp is not None and exp.data.source == "builtin":
            dp.rank0_first(lambda: data.ensure_builtin(exp, data.shard_dir(exp)))  # built once, not N times at once
        rank0 = job.rank() == 0
        trackers = tracking.make(args.track, out, exp.name, exp.to_dict()) if rank0 else []
        log = RunLog(out / LOG_NAME if rank0 else None, json_stdout=args.json, trackers=trackers, lock=lock)
        tr = trainer.Trainer(exp, out, dp=dp, log=log)
        if args.resume:
            tr.load(args.resume)
            if rank0:
                print(f"resuming from {args.resume} (step {tr.step})", file=sys.stderr)
        elif init is not None:
            tr.init_from(init)
            check_init_tokenizer(args.init, tr.init["tokenizer"], data.tokenizer_info(exp))
            if rank0:
                i = tr.init
                print(
                    f"init: the weights of {i['path']} ({i['run']}, step {i['step']}); Adam moments zero, step 0, "
                    "this experiment's own schedule",
                    file=sys.stderr,
                )
        # rank 0 copies tokenizer.json into the run folder (and writes every checkpoint's sidecar)
        tr.tokenizer_info = data.tokenizer_info(exp, out if rank0 else None, log.anchor)
        tr.recipe = recipe(args, argv)
        log.open()
        if rank0:
            print(memory.format_plan(tr.S.plan, tr.K.precision), file=sys.stderr)
        rc = tr.run()
        if rank0 and tr.outcome in ("done", "stopped"):
            path = report.write(tr, tr.last_checkpoint)
            log.emit({"event": "report", "step": tr.step, "path": str(path)})
            log.say(f"report card: {path}")
        return rc
    finally:
        if tr is not None:
            tr.log.close()
        if dp is not None:
            if tr is not None:
                tr.step_fn.release()  # its CUDA graph holds NCCL work: destroying the communicator first hangs
            dp.close()


def finished(args: argparse.Namespace, exp: config.Experiment) -> int:
    """--resume from a checkpoint at or past train.steps: nothing to train, the run is complete (exit 0, its
    checkpoints left as they are). Past it, the run was trained on further (`run --steps N`, `train --steps N`)."""
    ck, _ = checkpoint.load(args.resume, params.n_params(exp.model))  # a step read from a valid checkpoint only
    steps = f"--steps {args.steps}" if args.steps is not None else f"{args.experiment}: train.steps {exp.train.steps}"
    if ck.step > exp.train.steps:
        print(
            f"already complete: {args.resume} is at step {ck.step}, past this run's last ({steps}): it was "
            f"trained on further; nothing to train (--steps above {ck.step} trains on, at the schedule's final "
            "lr)",
            file=sys.stderr,
        )
        return 0
    print(
        f"already complete: {args.resume} is at step {ck.step}, the run's last ({steps}); nothing to train",
        file=sys.stderr,
    )
    return 0


def check_init_tokenizer(where: str, saved: dict[str, Any], info: dict[str, Any]) -> None:
    """--init: the new run's data must be tokenized as the weights were trained (the same token ids)."""
    new = {k: info[k] for k in ("kind", "sha256") if k in info}
    if saved and info.get("kind") != "unknown" and saved != new:
        raise checkpoint.CheckpointError(
            f"--init {where}: its tokenizer ({saved.get('kind')} {saved.get('sha256', '')[:12]}) is not the data's "
            f"({new.get('kind')} {new.get('sha256', '')[:12]}); prepare the data with `microgpt prep --tokenizer "
            f"{Path(where) / 'tokenizer.json' if Path(where).is_dir() else 'RUN/tokenizer.json'}`"
        )


def cmd_sample(argv: list[str]) -> int:
    p = ArgParser(prog="microgpt sample", description="Generate text from a checkpoint.")
    p.add_argument("checkpoint", help="a step-*.bin checkpoint, or a run folder (its newest valid checkpoint)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample among the K likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="then among the likeliest tokens of probability P (1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (sample i: seed + i)")
    p.add_argument("--num-samples", type=int, default=1, help="sequences decoded together, in one batch")
    p.add_argument("--json", action="store_true", help="print one JSON object (a line per sample) instead of text")
    backend.add_flags(p)
    p.add_argument("--chat", action="store_true", help="the prompt is one ChatML user turn; print the reply")
    args = p.parse_args(argv)
    from microgpt.use import chat, sample

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
