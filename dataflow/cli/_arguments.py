"""The ``dataflow`` command's arguments: the parser, the types of option values, the errors.

A value the parser refuses exits 2 with one line (argparse's ``ArgumentTypeError``);
:class:`Usage` and :class:`Failure` are what a command raises after parsing (exit 2 and 1).
"""

from __future__ import annotations

import argparse
import math
import os
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from dataflow.model._text import printable
from dataflow.tools._times import parse_time

MAX_SEQ = 2**63 - 1
#: The environment variable that names the ledger when ``--ledger`` is not given.
LEDGER_ENV = "DATAFLOW_LEDGER"
LEDGER_HELP = (
    f"URL of an existing ledger (default: ${LEDGER_ENV}, else sqlite:///./dataflow.db); "
    "nothing is created"
)


class Failure(Exception):
    """A failure the CLI reports in one line (exit status 1)."""


class Usage(Exception):
    """A value the run cannot take, found after parsing (exit status 2)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, with where to look (argparse's default also prints the usage)."""
        self.exit(2, printable(f"{self.prog}: error: {message} (see `{self.prog} --help`)") + "\n")


def int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int ({what}), got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high} ({what}), got {value}")
        return value

    return parse


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    if value > threading.TIMEOUT_MAX:  # what a sleep or a wait can take
        raise argparse.ArgumentTypeError(
            f"expected at most {threading.TIMEOUT_MAX:.0f} seconds, got {text!r}"
        )
    return value


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def run_id(text: str) -> str:
    from dataflow.recorder._ledger import check_id

    try:
        return check_id("run id", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def sample_id(text: str) -> str:
    from dataflow.model._refs import validate_sample_id

    try:
        return validate_sample_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def time_value(text: str) -> float:
    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def checkpoint(text: str) -> int | str:
    """A step, ``latest`` or ``none`` (from scratch), as ``Consumer.resume`` takes them."""
    if text in ("latest", "none"):
        return text
    try:
        return int_in(0, MAX_SEQ, "a checkpoint step")(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a checkpoint step (an int >= 0), `latest` or `none`, got {text!r}"
        ) from None


def ledger_url(text: str) -> str:
    from dataflow.recorder._backends import backend_for

    try:
        backend_for(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def output_path(example: str, suffixes: tuple[str, ...] = ()) -> Callable[[str], str]:
    """A file to write: not a directory, in a directory that exists, with one of ``suffixes``."""

    def parse(text: str) -> str:
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a directory; name the file to write, e.g. "
                f"{os.path.join(text, example)}"
            )
        parent = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(
                f"the directory {parent} of {text!r} does not exist; create it first"
            )
        if suffixes and not text.lower().endswith(suffixes):
            raise argparse.ArgumentTypeError(
                f"{text!r} must end with {' or '.join(suffixes)} (the format follows the name)"
            )
        return text

    return parse


#: A seq of the ledger, as an option value.
SEQ = int_in(0, MAX_SEQ, "a seq")


def add_command(
    sub: Any, name: str, func: Callable[[argparse.Namespace], int], **kw: Any
) -> argparse.ArgumentParser:
    """The subcommand ``name``: ``main`` runs ``func(args)``, ``args.parser`` is its parser."""
    p = sub.add_parser(name, **kw)
    p.set_defaults(func=func, parser=p)
    return p


def add_ledger_and_run(p: argparse.ArgumentParser) -> None:
    """``--ledger`` and ``--run``, which every inspecting command takes."""
    p.add_argument("--ledger", type=ledger_url, default=None, help=LEDGER_HELP)
    p.add_argument("--run", type=run_id, required=True, help="run id")
