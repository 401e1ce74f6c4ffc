"""The root of every bad-input error, and the one place that turns it into what the user sees.

Bad input (an experiment field, a flag, a checkpoint, a shard, a tokenizer, a data source, a run file) raises a
subclass of `InputError` whose str() is the whole message: one line naming the file, field or flag. Every
subcommand's entry point runs under `exit_on_input_error`, which prints `error: <message>` on stderr and returns
exit code 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

EXIT_INPUT = 2  # bad input, as argparse's own usage errors
EXIT_WRITE = 4  # a file could not be written (disk full, read-only folder): a restart will not fix it


class InputError(ValueError):
    """Bad input from the user. str(err) is the one-line message, naming the file, field or flag."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse.ArgumentDefaultsHelpFormatter, silent where there is nothing to show: no default, a False switch,
    an empty string or list, or help that already names it. (argparse shows no line for an option without help.)"""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        nothing = default is None or default is False or default is argparse.SUPPRESS or default in ("", [])
        if nothing or "%(default)" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class ArgParser(argparse.ArgumentParser):
    """argparse, but usage errors are one line `error: <prog>: ...` and exit 2 (argparse's own code), and --help
    shows every option's default: the one parser every subcommand uses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_INPUT, f"error: {self.prog}: {message}\n")


class WriteError(OSError):
    """A file the run must write could not be written (ENOSPC, EROFS, ...). str(err) is the one-line message;
    whatever was there before is intact (fileio's atomic writes)."""


def check_finite(value: Any, name: str, error: type[InputError] = InputError) -> float:
    """value as a finite float; `error` naming `name` (the file and field, or the flag) for NaN, inf or a
    non-number. The one check of finite floats: experiment fields, flags, source weights, sidecar values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} must be a number, got {type(value).__name__} {brief(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int too big for a float
        number = math.inf
    if not math.isfinite(number):
        raise error(f"{name} must be a finite number, got {brief(value)}")
    return number


def brief(value: Any, limit: int = 60) -> str:
    """repr(value) for an error line, cut to `limit` characters (a hostile value can be megabytes long)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fail(message: str) -> int:
    """Print `error: message` on stderr; the exit code for bad input."""
    print(f"error: {message}", file=sys.stderr)
    return EXIT_INPUT


def exit_on_input_error(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """main(argv), with any InputError turned into one `error:` line and exit code 2."""
    try:
        return main(argv)
    except InputError as e:
        return fail(str(e))
