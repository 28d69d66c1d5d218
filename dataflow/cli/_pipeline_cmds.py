"""The commands that run the pipeline: ``demo``, ``chaos`` and ``mooncake-keeper``.

The demo, chaos and the stores are imported by the command that runs them: the other
commands never load them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from dataflow.cli._arguments import Usage, add_command, int_in, ledger_url, output_path


def add_pipeline_commands(sub: Any) -> None:
    """The ``demo``, ``chaos`` and ``mooncake-keeper`` subcommands."""
    p = add_command(
        sub,
        "demo",
        cmd_demo,
        help="the main job: producers, a two-rank gloo trainer, a SIGKILL and a resume, verified",
        description="Two producer processes stream features over ZeroMQ to a two-rank gloo "
        "trainer, which is SIGKILLed partway through and resumes through the ledger; ends "
        "with the replay report and writes report.json and timeline.png to the work directory.",
    )
    p.add_argument(
        "--workdir",
        "--dir",
        default="dataflow-demo",
        metavar="DIR",
        help="where the ledger, features, checkpoints, logs and report go (default: "
        "./dataflow-demo; created if missing)",
    )
    p.add_argument("--quick", action="store_true", help="a small run: under a minute on 2 cores")
    p.add_argument("--no-crash", action="store_true", help="do not kill the trainer ranks")
    p.add_argument(
        "--seed",
        type=int_in(0, 2**32 - 1, "a seed"),
        default=0,
        metavar="N",
        help="seeds the data, the models and the moment of the kill",
    )
    p.add_argument(
        "--samples",
        type=int_in(64, 1_000_000, "samples"),
        default=None,
        metavar="N",
        help="samples to produce and train (default: 384 with --quick, else 3072)",
    )
    p.add_argument(
        "--ledger",
        type=ledger_url,
        default=None,
        metavar="URL",
        help="ledger URL, e.g. postgresql+psycopg://... (default: sqlite:///WORKDIR/ledger.db)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="URI",
        help="feature store URI, e.g. mooncake://HOST:PORT?... (default: a shared directory "
        "under WORKDIR/features)",
    )
    p.add_argument(
        "--start-mooncake-master",
        action="store_true",
        help="start a local mooncake_master for --store mooncake:// and stop it at the end",
    )

    p = add_command(
        sub,
        "chaos",
        cmd_chaos,
        help="the demo pipeline SIGKILLed at random, trial after trial, and checked",
        description="Run the demo pipeline (2 producers, 2 gloo ranks, ZeroMQ) again and "
        "again; each trial SIGKILLs a producer, one rank or both ranks (or a mooncake_master "
        "or PostgreSQL server it started) at a random moment, "
        "restarts them, and checks verify, lost/duplicated samples, the weights against an "
        "uninterrupted run (offline trials) and orphans after gc. Exit 1 if any check fails.",
    )
    p.add_argument(
        "--trials",
        type=int_in(1, 100_000, "trials"),
        default=20,
        metavar="N",
        help="how many trials (default: 20)",
    )
    p.add_argument(
        "--seed",
        type=int_in(0, 2**32 - 1, "a seed"),
        default=0,
        metavar="S",
        help="trial i draws its kill from S+i; the data and models come from S (default: 0)",
    )
    p.add_argument(
        "--ledger",
        type=ledger_url,
        default=None,
        metavar="URL",
        help="one ledger for every trial (default: a SQLite file per trial under WORKDIR); "
        "chaos never kills a server it did not start (see --start-postgres)",
    )
    p.add_argument(
        "--start-postgres",
        action="store_true",
        help="start a throw-away PostgreSQL server (fsync, synchronous_commit and "
        "full_page_writes on) under WORKDIR for the ledger, stop it at the end, and add it "
        "to the targets: its postmaster SIGKILLed, then started again (crash recovery)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="URI",
        help="dir:///PATH: each trial's features under PATH/trial-NNN (default: under "
        "WORKDIR); mooncake://: a local mooncake_master per trial, killed as a target too",
    )
    p.add_argument(
        "--json",
        type=output_path("chaos.json", (".json",)),
        default=None,
        metavar="FILE",
        help="write the totals and every trial's result to FILE as JSON",
    )
    p.add_argument(
        "--workdir",
        default="dataflow-chaos",
        metavar="DIR",
        help="where the trials' ledgers, features, checkpoints and logs go "
        "(default: ./dataflow-chaos)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller trials (128 samples, not 256; with --hosts 384, not 768)",
    )
    p.add_argument(
        "--mode",
        choices=("alternate", "streaming", "offline"),
        default="alternate",
        help="alternate (default: every other trial offline, in the seeded order, its weights "
        "compared with an uninterrupted run), or every trial streaming, or every one offline",
    )
    p.add_argument(
        "--targets",
        nargs="+",
        default=None,
        metavar="NAME",
        help="kill only these, taken in turn in this order: producer, rank, ranks, "
        "mooncake_master (with --store mooncake://), postgres (with --start-postgres) "
        "(default: all of them that the other options allow)",
    )

    p.add_argument(
        "--hosts",
        action="store_true",
        help="run each trial on a simulated cluster (a network namespace per host: "
        "PostgreSQL, the Mooncake master, 2 producers, 2 trainers; needs root) and inject "
        "network faults instead of SIGKILLs (see --faults); exit 2 where namespaces cannot "
        "be made. The trials spread over the fault kinds: with fewer trials than kinds, "
        "each injects several",
    )
    p.add_argument(
        "--faults",
        type=fault_kinds,
        default=None,
        metavar="KIND,...",
        help="with --hosts: only these fault kinds (default: all; mooncake-cut only with "
        "Mooncake installed): " + "; ".join(f"{k}: {v}" for k, v in _faults().items()),
    )

    p = add_command(
        sub,
        "mooncake-keeper",
        cmd_mooncake_keeper,
        help="lend a Mooncake cluster memory until SIGTERM or Ctrl-C (the process nobody kills)",
        description="Open the Mooncake store at URI with its segment_size of memory (default "
        "512M) lent to the cluster, and hold it until SIGTERM or SIGINT. Mooncake keeps "
        "every object in memory some client lends; producers and ranks open their stores "
        "with segment_size=0, so that a crash of theirs loses no features.",
    )
    p.add_argument(
        "--store",
        required=True,
        metavar="URI",
        help="mooncake://HOST:PORT?metadata=...&namespace=...&segment_size=4G&admin=HOST:PORT",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from dataflow.demo import DemoOptions, run_demo

    options = DemoOptions(
        workdir=args.workdir,
        quick=args.quick,
        crash=not args.no_crash,
        seed=args.seed,
        samples=args.samples,
        ledger=args.ledger,
        store=args.store,
        start_mooncake_master=args.start_mooncake_master,
    )
    report = run_demo(options)
    clean = not (report["verify"] or report["lost"] or report["duplicated"])
    return 0 if clean else 1


def _faults() -> dict[str, str]:
    from dataflow.demo._chaos_hosts_plan import FAULTS

    return FAULTS


def fault_kinds(text: str) -> tuple[str, ...]:
    from dataflow.demo._chaos_hosts_plan import parse_faults

    try:
        return parse_faults(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--faults ")) from None


def cmd_chaos_hosts(args: argparse.Namespace) -> int:
    from dataflow.demo._chaos_hosts import HostsUnavailable, clean_hosts, run_hosts_chaos
    from dataflow.demo._chaos_hosts_plan import HostsChaosOptions

    for name in ("ledger", "start_postgres", "targets"):
        if getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise Usage(f"{flag} does not go with --hosts: the cluster runs its own PostgreSQL")
    if args.mode != "alternate":
        raise Usage("--mode does not go with --hosts: even trials stream, odd ones are offline")
    if args.store not in (None, "mooncake://", "dir://"):
        raise Usage(
            f"--store {args.store!r}: with --hosts, pass mooncake:// (the master on host "
            "'master') or dir:// (a shared directory under --workdir); the hosts set the rest"
        )
    options = HostsChaosOptions(
        trials=args.trials,
        seed=args.seed,
        faults=args.faults,
        workdir=args.workdir,
        json_path=args.json,
        mooncake=None if args.store is None else args.store == "mooncake://",
        quick=args.quick,
    )
    try:
        summary = run_hosts_chaos(options)
    except HostsUnavailable as exc:
        raise Usage(str(exc)) from None
    return 0 if clean_hosts(summary) else 1


def cmd_chaos(args: argparse.Namespace) -> int:
    from dataflow.demo._chaos import ChaosOptions, clean, run_chaos

    if args.hosts:
        return cmd_chaos_hosts(args)
    if args.faults is not None:
        raise Usage("--faults names network faults, injected with --hosts only: add --hosts")

    options = ChaosOptions(
        trials=args.trials,
        seed=args.seed,
        ledger=args.ledger,
        store=args.store,
        workdir=args.workdir,
        quick=args.quick,
        mode=args.mode,
        json_path=args.json,
        start_postgres=args.start_postgres,
        targets=None if args.targets is None else tuple(args.targets),
    )
    return 0 if clean(run_chaos(options)) else 1


def cmd_mooncake_keeper(args: argparse.Namespace) -> int:
    from stores import lend_memory

    def ready(store: Any) -> None:
        size = store.segment_size
        print(
            f"lending {size / 2**20:,.0f} MiB to {store.uri} (pid {os.getpid()}); "
            "stop with SIGTERM or Ctrl-C",
            flush=True,
        )

    if not args.store.startswith("mooncake://"):
        raise Usage(f"--store {args.store!r} is not a mooncake:// URI")
    lend_memory(args.store, ready=ready)
    print("stopped: the memory is no longer lent, what it held is gone", flush=True)
    return 0
