"""The root of every bad-input error, and the one place that turns it into what the user sees.

Bad input (an experiment field, a flag, a checkpoint, a shard, a tokenizer, a data source, a run file) raises a
subclass of `InputError` whose str() is the whole message: one line naming the file, field or flag. Every
subcommand's entry point runs under `exit_on_input_error`, which prints `error: <message>` on stderr and returns
exit code 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

EXIT_INPUT = 2  # bad input, as argparse's own usage errors


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
