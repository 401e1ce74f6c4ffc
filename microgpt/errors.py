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

EXIT_INPUT = 2  # bad input, as argparse's own usage errors


class InputError(ValueError):
    """Bad input from the user. str(err) is the one-line message, naming the file, field or flag."""


class ArgParser(argparse.ArgumentParser):
    """argparse, but usage errors are one line `error: <prog>: ...` and exit 2 (argparse's own code)."""

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
