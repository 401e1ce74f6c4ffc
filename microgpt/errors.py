"""The root of every bad-input error, and the one place that turns it into what the user sees.

Bad input (an experiment field, a flag, a checkpoint, a shard, a tokenizer, a data source, a run file) raises a
subclass of `InputError` whose str() is the whole message: one line naming the file, field or flag. An output the
disk refuses (full, read-only) raises `WriteError`. Every subcommand's entry point runs under
`exit_on_input_error`, which prints `error: <message>` on stderr and returns exit code 2 (bad input) or 4 (the
write). An OS error on a named path that no reader or writer turned into one of these (a --data folder that cannot
be listed, a cache or run folder that cannot be written) is the user's file system, not a bug: `os_error` makes it
the same one line, naming the path, in that one place. Anything else is a bug and keeps its traceback.

Two checks live here because every reader needs them the same way:
- `check_number` is the one check of a number from a flag, a file or a URL (`parse_number` for one written as
  text): its type, finite, and its range, with one message shape, `<name> must be <what>, got <value>`;
- `output_error` is the one mapping of an OS error on an output path: the disk or the filesystem refusing (full,
  read-only, no permission) is a WriteError, exit 4; anything else (a parent that is a file, a name too long, a
  link loop) is the path's fault, an InputError, exit 2.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
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
    """argparse, but usage errors are one line `error: <prog>: ...` and exit 2 (argparse's own code), an empty value
    is refused, and --help shows every option's default: the one parser every subcommand uses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_INPUT, f"error: {self.prog}: {message}\n")

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        """Every value given on the command line passes here (flags of groups too), before its type: an empty or
        blank one is refused unless the flag's default is itself "" (a prompt). `--data ''` would otherwise read as
        no --data (the built-in corpus), `--init ''` as no --init, `--host ''` as every interface, `--out ''`
        (type Path) as the current folder."""
        if not arg_string.strip() and action.default != "":
            raise argparse.ArgumentError(action, "an empty value is not allowed")
        return super()._get_value(action, arg_string)


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


def _what(integer: bool, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    """What check_number wants, for its message: 'an integer in [0, 10]', 'a finite number > 0'."""

    def num(x: float) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    if lo is not None and hi is not None:
        span = f" in {'(' if lo_open else '['}{num(lo)}, {num(hi)}{')' if hi_open else ']'}"
    elif lo is not None:
        span = f" {'>' if lo_open else '>='} {num(lo)}"
    else:
        span = f" {'<' if hi_open else '<='} {num(hi)}" if hi is not None else ""
    return ("an integer" if integer else "a finite number") + span


def check_number(
    value: Any,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    integer: bool = False,
    lo_open: bool = False,
    hi_open: bool = False,
    error: type[InputError] = InputError,
) -> Any:
    """value, checked to be an int (integer=True) or a finite real number (an int or a float; never a bool or a
    string that looks like one) within lo..hi (inclusive unless lo_open / hi_open); `error` naming `name` (the
    flag, the file and field, or the query parameter) otherwise: `<name> must be <what>, got <value>`. The one
    range check of numbers from flags, files and URLs, so none of them reaches arithmetic as NaN, inf, a bool or
    an integer of 5,000 digits."""
    what = _what(integer, lo, hi, lo_open, hi_open)
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise error(f"{name} must be {what}, got {type(value).__name__} {brief(value)}")
    if not integer:
        check_finite(value, name, error)
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and (value >= hi if hi_open else value > hi)
    if below or above:
        raise error(f"{name} must be {what}, got {brief(value)}")
    return value


def parse_number(
    text: str,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    integer: bool = False,
    error: type[InputError] = InputError,
) -> Any:
    """A number written as text (a query parameter), then check_number. An integer may be written as a float
    with no fraction ("100.0", as a page's script may format it); "inf", "nan" and "1e999" are never numbers."""
    value: Any = None
    try:
        value = int(text) if integer and text.strip().lstrip("+-").isdigit() else float(text)
    except ValueError:  # not a number, or an integer of more than 4,300 digits
        pass
    if isinstance(value, float) and not math.isfinite(value):
        value = None
    if value is None:
        raise error(f"{name} must be {_what(integer, lo, hi, False, False)}, got {brief(text)}")
    if integer and isinstance(value, float) and value.is_integer():
        value = int(value)
    return check_number(value, name, lo, hi, integer=integer, error=error)


# errnos of an output path that say the disk or filesystem refuses the write, not that the path is wrong
REFUSED_WRITES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EIO}


def output_error(e: OSError, what: str) -> InputError | WriteError:
    """The error to raise for OSError e on an output path: WriteError (exit 4) when the disk or the filesystem
    refuses (full, read-only, no permission), else InputError (exit 2: a parent that is a file, a name too long,
    a symbolic link loop). `what` says what could not be written and where; the message adds the OS's reason."""
    reason = e.strerror or str(e)
    return WriteError(f"{what} ({reason})") if e.errno in REFUSED_WRITES else InputError(f"{what} ({reason})")


def os_error(e: OSError) -> InputError | WriteError:
    """The one line for OSError e on the path it names (e.filename): `<path>: cannot read (<reason>)`, exit 2, where
    the path is there and cannot be read (permission); `<path>: cannot write (<reason>)`, exit 4, where the disk or
    the file system refuses (full, read-only, no permission to write: REFUSED_WRITES); else `<path>: <reason>`,
    exit 2 (a path that vanished, a file where a folder must be)."""
    path = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes, os.PathLike)) else str(e.filename)
    reason = e.strerror or type(e).__name__
    if e.errno in (errno.EACCES, errno.EPERM) and os.path.lexists(path) and not os.access(path, os.R_OK):
        return InputError(f"{path}: cannot read ({reason})")
    if e.errno in REFUSED_WRITES:
        return WriteError(f"{path}: cannot write ({reason})")
    return InputError(f"{path}: {reason}")


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
    """main(argv), with any InputError turned into one `error:` line and exit code 2, a WriteError (an output the
    disk refused) into one `error:` line and exit code 4, and any other OS error on a named path into the one line
    os_error makes of it."""
    err: InputError | WriteError
    try:
        return main(argv)
    except (InputError, WriteError) as e:
        err = e
    except OSError as e:
        if e.filename is None:  # not a path's (a socket, a pipe): a bug's traceback
            raise
        err = os_error(e)
    print(f"error: {err}", file=sys.stderr)
    return EXIT_WRITE if isinstance(err, WriteError) else EXIT_INPUT
