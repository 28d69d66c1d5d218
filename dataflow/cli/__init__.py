"""The ``dataflow`` command line: inspect and verify runs, export logs, run the demo.

Errors are one line on stderr, with a hint: exit status 2 for a usage error
(a bad option value, caught while parsing; a step or time the run does not
reach), 1 for a failure (no ledger at the URL, an unknown run, checkpoint or
sample, a file that cannot be written, a run that fails verification ...).
``dataflow --debug ...`` adds the traceback. The inspecting commands (``runs``,
``replay``, ``status``, ``diff``, ``events``, ``export``, ``gc``) open the ledger without
creating anything: a mistyped path is reported, never turned into a new, empty
ledger. Without ``--ledger`` they read ``$DATAFLOW_LEDGER``, else
``./dataflow.db``. What they compute and print lives in :mod:`dataflow.tools` (the read
side); heavy packages (pyarrow, matplotlib, tqdm) are imported by the commands that use
them.

One module per group of commands holds their parsers and handlers: ``_replay_cmd``,
``_status_cmd``, ``_diff_cmd``, ``_log_cmds`` (runs, events, export), ``_gc_cmd``,
``_exclude_cmds`` (exclude, include: the only commands that append to the ledger) and
``_pipeline_cmds`` (demo, chaos, mooncake-keeper); ``_arguments`` has the option types and
errors, ``_ledger`` opens the ledger a command reads. A new command is an ``add_...(sub)``
there, called from :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time  # noqa: F401  (``dataflow.cli.time``: tests stub its sleep between refreshes)
import traceback
from collections.abc import Sequence

from dataflow.cli._arguments import LEDGER_ENV, Failure, Parser, Usage
from dataflow.cli._diff_cmd import add_diff
from dataflow.cli._doctor_cmd import add_doctor
from dataflow.cli._exclude_cmds import add_exclusion_commands
from dataflow.cli._gc_cmd import add_gc
from dataflow.cli._log_cmds import add_log_commands
from dataflow.cli._pipeline_cmds import add_pipeline_commands
from dataflow.cli._replay_cmd import add_replay
from dataflow.cli._status_cmd import add_status
from dataflow.model._errors import ArgumentTypeError, DataflowError, InvalidArgumentError
from dataflow.tools._printing import say
from dataflow.tools._samples import NotInRunError

__all__ = ["LEDGER_ENV", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``dataflow`` command's parser; each subcommand sets the ``func`` that ``main`` runs."""
    parser = Parser(
        prog="dataflow",
        description="Inspect and verify dataflow runs (the ledger is the source of truth).",
        epilog=f"Without --ledger, the commands read the ledger ${LEDGER_ENV} names, else "
        "sqlite:///./dataflow.db. docs/cli.md has examples of every command.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of an error, not just its line"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_replay(sub)
    add_status(sub)
    add_diff(sub)
    add_log_commands(sub)
    add_gc(sub)
    add_exclusion_commands(sub)
    add_pipeline_commands(sub)
    add_doctor(sub)
    return parser


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    if args.debug:
        traceback.print_exc()
    say(f"dataflow: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dataflow`` command with ``argv`` (default: ``sys.argv[1:]``); its exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # e.g. `dataflow events ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("dataflow: interrupted", file=sys.stderr)
        return 130
    except (InvalidArgumentError, ArgumentTypeError) as exc:  # a value only the library checks
        return _fail(args, str(exc), 2)
    except (Failure, DataflowError, NotInRunError) as exc:
        return _fail(args, str(exc), 1)
    except Usage as exc:
        return _fail(args, str(exc), 2)
    except OSError as exc:  # a raw one names its file; ours say what to do
        hint = " (check the path and its permissions)" if exc.filename else ""
        return _fail(args, f"{exc}{hint}", 1)
    except (ValueError, TypeError) as exc:  # a value only the library could check
        return _fail(args, str(exc), 2)
    except Exception as exc:
        return _fail(
            args,
            f"unexpected {type(exc).__name__}: {exc} (`dataflow --debug ...` shows the traceback)",
            1,
        )
