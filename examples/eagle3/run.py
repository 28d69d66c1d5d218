"""Train an EAGLE-3 draft head on a ``transformers`` model's hidden states, through dataflow.

    python examples/eagle3/run.py [--quick] [--workdir DIR] [--seed N] [--model PATH]

Two producer processes run the target over a prompt set and commit each sample's features
(token ids, three layers' hidden states, the final hidden state, a loss mask: bfloat16
where the CPU computes in it); two gloo ranks train the draft under DDP. Once both ranks
are past the second checkpoint, the job SIGKILLs them and starts them again from the
*first* checkpoint: the samples trained after it had their features released, and rank 0
regenerates them with the producers' code. A reference run, the same job never
interrupted, must end with the same weights (``torch.equal``). The job writes
``DIR/report.json``; docs/eagle3.md explains every piece.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

try:
    import torch
    from target import FULL, QUICK, build_target, make_prompts, save_prompts
except ModuleNotFoundError as exc:  # the examples extra
    if exc.name != "transformers":
        raise
    sys.exit("examples/eagle3 needs transformers: pip install 'dataflow[examples]'")

from dataflow import FeatureSpec, Kind, Ledger, replay

PRODUCERS, RANKS = 2, 2
TTT_STEPS = 3  # draft steps unrolled in training (training-time test)
BATCH_SIZE, GRAD_ACCUM = 4, 2  # per rank: 16 samples an optimizer step on two ranks
PREFETCH = 2  # batches the loader leases and reads ahead, in a thread
LR = 1e-2
CHECKPOINT_EVERY = EVAL_EVERY = 2
HOLD_AT = 5  # the step both ranks are killed at: checkpoints at 2 and 4 are recorded
RESUME_FROM = 2  # the older checkpoint: what was trained in steps 3-4 was released since
TIMEOUT_S = 600.0  # for any phase, on a machine much slower than expected


class JobError(Exception):
    """A process of the job failed, or a phase took too long."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: minutes on 2 cores")
    parser.add_argument("--workdir", default="eagle3-run", help="where everything goes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="a local transformers checkpoint instead of a random one")
    args = parser.parse_args(argv)
    started = time.monotonic()
    workdir = Path(args.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if args.quick else FULL
    # The prompt set is the one thing the conductor computes: with every core for the full
    # job's (minutes), with one for --quick's (seconds, beside a test suite's other work).
    torch.set_num_threads(1 if args.quick else os.cpu_count() or 1)

    say(f"building the target and its prompt set ({sizes.samples} + {sizes.eval_samples})")
    target = build_target(sizes, args.seed, args.model)
    for split in ("train", "eval"):
        save_prompts(
            workdir / f"prompts-{split}.npz", make_prompts(target, sizes, args.seed, split)
        )
    del target
    ledger = Ledger.open(f"sqlite:///{workdir}/ledger.db")
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    run_id = f"eagle3-{stamp}"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["processes"])
    job = Job(context, workdir, run_id, args, asdict(sizes), hold_at=HOLD_AT)
    reference = Job(
        context, workdir, f"eagle3-{stamp}-reference", args, asdict(sizes), hold_at=None
    )
    try:
        say(
            f"run {run_id}: {PRODUCERS} producers, {RANKS} ranks, SIGKILLed at step {HOLD_AT}; "
            f"beside it, {reference.run_id}: the same job, never interrupted"
        )
        for run in (job, reference):
            run.start_producers()
            run.start_ranks(attempt=1, resume="latest")
        job.wait_holding()
        job.kill_ranks()
        say(f"both ranks SIGKILLed at step {HOLD_AT}; resuming from step {RESUME_FROM}")
        job.start_ranks(attempt=2, resume=RESUME_FROM)
        job.wait_all()
        say("the resumed run finished")
        reference.wait_all()
        say("the reference run finished")
    finally:
        job.end()
        reference.end()
    report = build_report(ledger, job, reference, wall_s=time.monotonic() - started)
    (workdir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    ledger.close()
    print(json.dumps(report, indent=2), flush=True)
    ok = report["lost"] == 0 and report["duplicated"] == 0 and report["equal_to_uninterrupted"]
    return 0 if ok and report["verify"] == "clean" else 1


class Job:
    """One run of the job: its processes, its directories, its settings file."""

    def __init__(
        self,
        context: Any,
        workdir: Path,
        run_id: str,
        args: Any,
        sizes: dict,
        *,
        hold_at: int | None,
    ) -> None:
        self.context, self.run_id = context, run_id
        self.out = workdir / "runs" / run_id
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.settings = self.out / "job.json"
        self.children: list[tuple[str, Any]] = []
        self.ranks: list[Any] = []
        self.killed: list[int] = []  # the pids this job SIGKILLed
        self.settings.write_text(
            json.dumps(
                {
                    "run_id": run_id,
                    "ledger_url": f"sqlite:///{workdir}/ledger.db",
                    "store_uri": f"dir://{workdir}/features/{run_id}",
                    "checkpoint_root": str(workdir / "checkpoints"),
                    "prompts": str(workdir / "prompts-train.npz"),
                    "eval_prompts": str(workdir / "prompts-eval.npz"),
                    "out_dir": str(self.out),
                    "sizes": sizes,
                    "seed": args.seed,
                    "model": args.model,
                    "producers": PRODUCERS,
                    "ttt_steps": TTT_STEPS,
                    "batch_size": BATCH_SIZE,
                    "grad_accum": GRAD_ACCUM,
                    "prefetch": PREFETCH,
                    "lr": LR,
                    "checkpoint_every": CHECKPOINT_EVERY,
                    "eval_every": EVAL_EVERY,
                    "hold_at": hold_at,
                }
            )
        )
        self.started = time.time()

    def start(self, name: str, role: str, *args: object) -> Any:
        log = str(self.out / "logs" / f"{name}.log")
        process = self.context.Process(
            target=_child, args=(log, role, str(self.settings), *args), name=name
        )
        process.start()
        self.children.append((name, process))
        return process

    def start_producers(self) -> None:
        for index in range(PRODUCERS):
            self.start(f"producer-{index}", "producer", index)

    def start_ranks(self, *, attempt: int, resume: str | int) -> None:
        settings = json.loads(self.settings.read_text())
        settings["resume"] = resume
        self.settings.write_text(json.dumps(settings))
        port = _free_port()
        self.ranks = [
            self.start(f"rank{r}-attempt{attempt}", "rank", r, attempt, port) for r in range(RANKS)
        ]

    def wait_holding(self) -> None:
        """Until both ranks are at the step they are killed at."""
        markers = [self.out / f"rank{r}.holding" for r in range(RANKS)]
        self._wait(lambda: all(m.exists() for m in markers), "the ranks to reach the kill step")

    def kill_ranks(self) -> None:
        for process in self.ranks:
            os.kill(process.pid, signal.SIGKILL)
        for process in self.ranks:
            process.join()
        self.killed = [p.pid for p in self.ranks]

    def wait_all(self) -> None:
        """Until every process that was not killed exited 0."""
        live = [p for _, p in self.children if p.pid not in self.killed]
        self._wait(lambda: all(p.exitcode == 0 for p in live), "the processes to finish")

    def _wait(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not done():
            for name, process in self.children:
                code = process.exitcode
                if code not in (None, 0) and process.pid not in self.killed:
                    log = self.out / "logs" / f"{name}.log"
                    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                    raise JobError(
                        f"{name} exited with {code} (its log {log}):\n" + "\n".join(tail)
                    )
            if time.monotonic() > deadline:
                raise JobError(f"waited {TIMEOUT_S:.0f} s for {what}; logs in {self.out / 'logs'}")
            time.sleep(0.05)

    def end(self) -> None:
        """Stop whatever still runs (after an error)."""
        for _, process in self.children:
            if process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                process.join()


def build_report(ledger: Ledger, job: Job, reference: Job, *, wall_s: float) -> dict[str, Any]:
    """report.json, from the ledger's fold and events and the two runs' final weights."""
    state = replay(ledger, job.run_id)
    committed, trained = set(state.committed), set(state.trained)
    acks, first_lease, last_ack, spec_bytes = lineage_acks(ledger, job.run_id)
    weights = torch.load(job.out / "weights.pt", weights_only=True)
    expected = torch.load(reference.out / "weights.pt", weights_only=True)
    evals = [json.loads(line) for line in (job.out / "evals.jsonl").read_text().splitlines()]
    resumed = state.plans[max(state.plans)]
    memory = [json.loads(p.read_text()) for p in sorted(job.out.glob("rank*-attempt*.json"))]
    return {
        "run_id": job.run_id,
        "ledger_url": ledger.url,
        "committed": len(committed),
        "trained": len(trained),
        "lost": len(committed - trained),
        "duplicated": sum(1 for n in acks.values() if n > 1),
        "acked": len(acks),  # samples acked in the final lineage, read from the ack rows
        "resumes": len(state.plans) - 1,
        "resumed_from_step": resumed.checkpoint_step,
        "regenerated": len(resumed.regenerate),
        "acceptance_before": evals[0]["metrics"]["eval/simulated_acc_len"],
        "acceptance_after": evals[-1]["metrics"]["eval/simulated_acc_len"],
        "acceptance_by_step": [(e["step"], e["metrics"]["eval/simulated_acc_len"]) for e in evals],
        "equal_to_uninterrupted": weights.keys() == expected.keys()
        and all(torch.equal(weights[k], expected[k]) for k in expected),
        "verify": "clean" if not state.verify() else state.verify(),
        "samples_per_s": round(len(trained) / max(last_ack - first_lease, 1e-9), 1),
        "feature_bytes_per_sample": round(spec_bytes / max(len(committed), 1)),
        "largest_batch_bytes": max(m["largest_batch_bytes"] for m in memory),
        "rank_max_rss_mib": round(max(m["max_rss_bytes"] for m in memory) / 2**20, 1),
        "loader": f"batch {BATCH_SIZE}, prefetch {PREFETCH}",
        "wall_s": round(wall_s, 1),
    }


def lineage_acks(ledger: Ledger, run_id: str) -> tuple[Counter[str], float, float, int]:
    """Each sample's acks in the final lineage (from the events, not the fold), the first
    lease's and last ack's times, and the feature bytes of the first commit of each sample."""
    checkpoint_at: dict[int, tuple[int, int]] = {}
    parent: dict[int, tuple[int, int] | None] = {}
    acks: dict[int, list[tuple[int, str]]] = {}
    first_lease, last_ack, final, spec_bytes, seen = None, 0.0, 0, 0, set()
    for event in ledger.events(run_id):
        if event.kind == Kind.CHECKPOINT:
            checkpoint_at[event.seq] = (event.epoch, event.step or 0)
        elif event.kind == Kind.RESUME:
            seq = event.payload.get("checkpoint_seq")
            parent[event.epoch] = checkpoint_at.get(seq) if seq is not None else None
            final = event.epoch
        elif event.kind == Kind.ACK and event.sample_ids:
            # An ack row names a batch, each sample at its own step.
            steps = event.sample_steps
            acks.setdefault(event.epoch, []).extend(
                (step or 0, sid) for sid, step in zip(event.sample_ids, steps, strict=True)
            )
            last_ack = event.ts
        elif event.kind == Kind.LEASE and first_lease is None:
            first_lease = event.ts
        elif event.kind == Kind.COMMIT and event.sample_id not in seen:
            seen.add(event.sample_id)
            specs = event.payload["specs"].values()
            spec_bytes += sum(FeatureSpec.from_dict(s).nbytes for s in specs)
    counts: Counter[str] = Counter()
    epoch, cut = final, None
    while epoch:
        counts.update(sid for step, sid in acks.get(epoch, ()) if cut is None or step <= cut)
        epoch, cut = parent.get(epoch) or (0, None)
    return counts, first_lease or 0.0, last_ack, spec_bytes


def _child(log: str, role: str, *args: object) -> None:
    import processes  # preloaded by the fork server

    processes.child(log, role, *args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STARTED = time.monotonic()


def say(line: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f}s] {line}", flush=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except JobError as exc:
        sys.exit(f"eagle3: {exc}")
