"""``dataflow doctor``: check a deployment from this host before a run."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from dataflow.cli._arguments import LEDGER_ENV, add_command, ledger_url, positive_seconds, seconds
from dataflow.tools._printing import say


def _endpoint(text: str) -> str:
    from dataflow.tools._doctor import parse_endpoint

    try:
        parse_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _store_uri(text: str) -> str:
    if "://" not in text:
        raise argparse.ArgumentTypeError(
            f"a store URI looks like dir:///PATH or mooncake://HOST:PORT?..., got {text!r}"
        )
    return text


def _number(text: str, high: float, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= high:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _fraction(text: str) -> float:
    return _number(text, 100, "a percentage from 0 to 100") / 100


def _gib(text: str) -> int:
    return int(_number(text, 1 << 30, "a number of GiB >= 0") * (1 << 30))


def add_doctor(sub: Any) -> None:
    """The ``doctor`` subcommand."""
    p = add_command(
        sub,
        "doctor",
        cmd_doctor,
        help="check a deployment from this host: ledger, schema, clock, store, streams, disk",
        description="Check, from this host, what a run needs: the ledger reachable and its "
        "schema version, this host's clock against the database server's, each store "
        "writable (a probe object put, read back and removed), each stream endpoint "
        "accepting a connection, and the free disk where files go. Exit 0 when all is "
        "well, 1 with a line per problem saying what to do, 2 on bad arguments.",
    )
    p.add_argument(
        "--ledger",
        type=ledger_url,
        default=None,
        help=f"the ledger's URL (default: ${LEDGER_ENV}); nothing is created or written",
    )
    p.add_argument(
        "--store",
        type=_store_uri,
        action="append",
        default=[],
        help="a store URI to check (dir:///PATH, mooncake://...); repeat for several",
    )
    p.add_argument(
        "--stream",
        type=_endpoint,
        action="append",
        default=[],
        help="a rank's stream endpoint, as producers connect to it (tcp://HOST:PORT); "
        "repeat for several",
    )
    p.add_argument(
        "--max-clock-offset",
        type=seconds,
        default=1.0,
        metavar="S",
        help="a clock further than S seconds from the database server's is a problem (default 1)",
    )
    p.add_argument(
        "--min-free-gib",
        type=_gib,
        default=1 << 30,
        metavar="GIB",
        help="less free disk than GIB where files go is a problem (default 1; 0: no check)",
    )
    p.add_argument(
        "--min-free-percent",
        type=_fraction,
        default=0.05,
        metavar="PCT",
        help="less than PCT %% of the disk free where files go is a problem (default 5)",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=5.0,
        metavar="S",
        help="how long one check may wait (a connect, a round trip, a probe; default 5)",
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")


def cmd_doctor(args: argparse.Namespace) -> int:
    from dataflow.tools._doctor import DoctorLimits, doctor

    url = args.ledger or os.environ.get(LEDGER_ENV, "").strip()
    if not url:
        args.parser.error(f"name the ledger: --ledger URL or ${LEDGER_ENV}")
    if args.ledger is None:
        try:
            ledger_url(url)
        except argparse.ArgumentTypeError as exc:
            args.parser.error(f"{LEDGER_ENV}: {exc}")
    limits = DoctorLimits(
        max_clock_offset_s=args.max_clock_offset,
        min_free_bytes=args.min_free_gib,
        min_free_fraction=args.min_free_percent,
        timeout_s=args.timeout,
    )
    report = doctor(
        url, stores=args.store, streams=args.stream, open_store=_open_store, limits=limits
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for f in report.findings:
            fix = "" if f.ok else f". What to do: {f.fix}"
            say(f"{'ok' if f.ok else 'PROBLEM':<8}{f.check:<7}{f.target}: {f.detail}{fix}")
        problems = len(report.problems)
        say(f"{problems} problem{'s' * (problems != 1)}" if problems else "all well")
    return 0 if report.ok else 1


def _open_store(uri: str) -> Any:
    from stores import open_store

    return open_store(uri)
