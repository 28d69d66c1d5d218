"""``dataflow demo``: the main job, with the real parts, verified by replay.

Everything runs on one machine with embedded defaults, under one work directory
(``./dataflow-demo`` unless told otherwise): a SQLite ledger file, a shared-directory
feature store and ZeroMQ on loopback. The demo starts

- two **producer** processes (``dataflow.demo._producer``): synthetic prompts through a
  small frozen target network into hidden-state features, put into the store, committed
  to the ledger and pushed as refs to the ranks over ZeroMQ;
- two **trainer ranks** (``dataflow.demo._trainer``), a gloo group under DDP, training
  draft heads with ``training.Trainer`` (gradient accumulation, evals of the acceptance
  length through ``eval.Evaluator``, checkpoints through ``training.CheckpointManager``);

and, partway through, SIGKILLs both ranks at a random moment (seeded) and starts them
again; they resume from the ledger's latest checkpoint, as an operator would restart
them. At the end it prints the report of ``dataflow replay`` (the fold of the whole log
and its verification), and writes ``report.json`` and ``timeline.png`` into the work
directory. With a Mooncake store, a keeper process (``dataflow.demo._keeper``) lends the
store its memory, so that the killed ranks take no features with them.

The children fork from a server that imported torch once (``multiprocessing``'s
forkserver); each is a process of its own, its output in ``runs/RUN/logs/``. The demo
sits at the top of the dependency graph, beside the CLI: nothing in the core
(``dataflow``'s ledger, roles, streams) imports it, and its own process imports no torch.
"""

from __future__ import annotations

from typing import Any

from dataflow.demo._options import MAX_SAMPLES as MAX_SAMPLES
from dataflow.demo._options import MIN_SAMPLES, DemoError, DemoOptions
from dataflow.demo._options import check_store_uri as check_store_uri


def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run the demo (printing its progress to stdout); return the report it wrote."""
    from dataflow.demo._run import Demo

    return Demo(options).run()


__all__ = ["MIN_SAMPLES", "DemoError", "DemoOptions", "run_demo"]
