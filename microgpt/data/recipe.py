"""Data recipes: an experiment names the data it trains on and the one `microgpt prep` command that makes them.

An experiment of data.source "shards" gives data.path (the folder) and data.prep, the prep arguments that make it
("--builtin": the built-in corpus at the model's own tokenizer size; "--builtin-chats 2000 --loss-mask --tokenizer
RUN/tokenizer.json": a chat set in a pretrained run's tokenizer). Then

    microgpt prep --experiment EXPERIMENT.json      is      microgpt prep <data.prep> --experiment EXPERIMENT.json
                                                              --out <data.path>

and prep takes the vocabulary size, val fraction, stdlib bytes and window from the experiment, as it always does
with --experiment. Before anything is built or written, `train` and `run` check that the data exist and fit the
model (check_data in microgpt/data/experiment.py); their one error line ends with the command from prep_command.
An experiment without data.prep (or a run given `--data DIR`) gets `--source YOUR_TEXT` in that command: its data
are the user's own.
"""

from __future__ import annotations

import shlex

from microgpt.config import ConfigError, Experiment, load
from microgpt.errors import InputError

RECIPE_ALONE = ("--experiment", "--quiet")  # prep flags that may stand beside --experiment and still mean the recipe


def recipe_args(exp: Experiment, experiment: str) -> list[str]:
    """data.prep as arguments; ConfigError naming the field when it does not parse or names --out / --experiment
    itself (those come from the experiment)."""
    try:
        args = shlex.split(exp.data.prep)
    except ValueError as e:
        raise ConfigError(f"{experiment}: data.prep {exp.data.prep!r} does not parse as arguments ({e})") from None
    taken = [a for a in args if a.split("=")[0] in ("--out", "--experiment")]
    if taken:
        raise ConfigError(f"{experiment}: data.prep must not give {taken[0]} (prep takes it from the experiment)")
    return args


def prep_command(exp: Experiment, experiment: str) -> str:
    """The one command that makes the data exp trains on: the experiment file's recipe where exp's data are the
    file's own (not `--data DIR`, not a phase's other folder), else the user's own text into exp's data.path."""
    try:
        own = load(experiment).data
    except InputError:
        own = None
    if exp.data.prep and own is not None and (own.path, own.prep) == (exp.data.path, exp.data.prep):
        return shlex.join(["microgpt", "prep", "--experiment", experiment])
    return shlex.join(["microgpt", "prep", "--source", "YOUR_TEXT", "--experiment", experiment, "--out", exp.data.path])


def expand(argv: list[str]) -> list[str]:
    """`prep --experiment FILE` with no source and no --out: FILE's recipe (data.prep, --out data.path); any other
    command line as it is. ConfigError when FILE has no recipe to run."""
    flags = [a for a in argv if a.startswith("--")]
    if "--experiment" not in argv or not set(flags) <= set(RECIPE_ALONE) or argv.index("--experiment") + 1 >= len(argv):
        return argv
    experiment = argv[argv.index("--experiment") + 1]
    exp = load(experiment)
    if exp.data.source != "shards" or not exp.data.prep:
        raise ConfigError(
            f"{experiment}: no data.prep to run (data.source {exp.data.source!r}); give prep a "
            "source: --builtin, --source PATH or --builtin-chats N, and --out DIR"
        )
    return [*recipe_args(exp, experiment), *argv, "--out", exp.data.path]
