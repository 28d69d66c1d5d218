"""The demo's conductor: starts the processes, watches the ledger, kills and restarts the
trainer ranks, and writes the report. It imports no torch: the children do the tensor work."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from dataflow.demo._child import run_child, write_config
from dataflow.demo._options import DemoError, DemoOptions
from dataflow.demo._report import build_report, lineage_report, write_timeline
from dataflow.live._ports import loopback_port
from dataflow.model._fold import RunState
from dataflow.recorder._ledger import Ledger
from dataflow.tools._printing import fails_verification, print_run_report, progress_bar, say
from dataflow.tools._run_fold import RunFold
from dataflow.tools._run_report import run_report

PRODUCERS = 2
RANKS = 2
BATCH_SIZE = 4  # refs per micro-batch and rank
GRAD_ACCUM = 2  # micro-batches per optimizer step
WINDOW = 32  # refs in flight per rank on the stream
LR = 5e-3
#: (samples, checkpoint_every, eval_every), quick and full.
QUICK = (384, 4, 4)
FULL = (3072, 16, 8)
#: The kill lands once this share of the samples is trained (drawn from --seed).
KILL_BETWEEN = (0.3, 0.6)
#: How often the watch folds the ledger: a quick run trains 100 samples in 0.2 s.
TICK_S = 0.05
PRELOAD = ("_producer", "_trainer", "_keeper")
#: Without a new ledger event for this long, the demo gives up and names the logs.
STALL_S = 120.0


@dataclass
class _Child:
    name: str
    process: BaseProcess
    log: Path
    killed: bool = False
    service: bool = False  # runs until the demo ends it (the store keeper)
    doomed: bool = False  # expected to die (a killed rank's peer), not killed yet

    def failure(self) -> str | None:
        """A line saying how this child failed, None while it runs or when it exited 0."""
        code = self.process.exitcode
        if code is None or code == 0 or self.killed or self.doomed:
            return None
        status = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        with contextlib.suppress(OSError):
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line]
            if lines:
                last = lines[-1][:300]
                return f"{self.name} {status}: {last} (its log: {self.log})"
        return f"{self.name} {status} (its log: {self.log})"


@dataclass
class _Timeline:
    """What the monitor saw, in seconds since the demo started."""

    samples: list[tuple[float, int, int]] = field(default_factory=list)  # t, committed, trained
    started: float = 0.0  # every process started (the fork server had imported torch)
    kill: dict[str, Any] | None = None


class Demo:
    """One ``dataflow demo`` run; ``run()`` returns the report."""

    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        self.samples, self.checkpoint_every, self.eval_every = QUICK if options.quick else FULL
        if options.samples is not None:
            self.samples = options.samples
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_id = f"demo-{stamp}-{uuid.uuid4().hex[:4]}"
        self.workdir = Path(options.workdir).absolute()
        self.run_dir = self.workdir / "runs" / self.run_id
        self.children: list[_Child] = []
        self.ranks: list[_Child] = []
        self.attempt = 0
        self.timeline = _Timeline()
        self.tty = sys.stdout.isatty()
        rng = random.Random(options.seed)
        self.kill_at = max(1, int(self.samples * rng.uniform(*KILL_BETWEEN)))
        self.kill_delay = rng.uniform(0.0, 0.3)
        self._kill_due: float | None = None
        self._evals: list[dict[str, Any]] = []
        self._evals_offset = 0
        self._last_print = 0.0
        self._last_status = ""
        self._master: Any = None
        self.lender_store_uri: str | None = None
        # The children fork from a server that imported torch and the demo's modules once:
        # each starts in a fraction of a second instead of importing torch for seconds (on
        # a busy machine, tens of seconds for four at once), and a restarted rank is back
        # at once. Each is still a process of its own, and a SIGKILL a real crash.
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([f"dataflow.demo.{m}" for m in PRELOAD])

    # -- the run ----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run the demo. Ctrl-C or a SIGTERM stops it, and every process it started."""
        with sigterm_raises():
            return self._run()

    def _run(self) -> dict[str, Any]:
        self.started, self.started_wall = time.monotonic(), time.time()
        # A ledger URL of the user's is opened first: a bad one fails before anything is made.
        given = None if self.options.ledger is None else Ledger.open(self.options.ledger)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "logs").mkdir(exist_ok=True)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot make the demo's work directory {self.workdir}: {exc.strerror} "
                f"({exc.filename}); pass --workdir a directory you can write to",
            ) from exc
        self.ledger = given or Ledger.open(f"sqlite:///{self.workdir}/ledger.db")
        try:
            self.ledger_url = self.ledger.url
            self.store_uri = self._store_uri()
            self.endpoints = [f"tcp://127.0.0.1:{loopback_port()}" for _ in range(RANKS)]
            self.config = self._config()
            write_config(self.run_dir / "config.json", self.config)
            self._announce()
            self._say(
                f"[{time.monotonic() - self.started:6.1f}s] starting {PRODUCERS} producers and "
                f"{RANKS} trainer ranks (forked from a server that imports torch first)"
            )
            if self.lender_store_uri is not None:
                self._start_keeper()
            self._launch()
            self.timeline.started = time.monotonic() - self.started
            self._watch()
            return self._finish()
        finally:
            self._end_children()
            if self._master is not None:
                self._master.stop()
            self.ledger.close()

    def _launch(self) -> None:
        """Start the producers and the first attempt of the trainer ranks."""
        for index in range(PRODUCERS):
            self._start(f"producer-{index}", "producer", index)
        self._start_ranks()

    def _store_uri(self) -> str:
        """The URI the children open the store with: a shared directory by default."""
        options = self.options
        if options.store is None:
            return f"dir://{quote(str(self.workdir / 'features' / self.run_id))}"
        uri = self._start_master(options.store) if options.start_mooncake_master else options.store
        if not uri.startswith("mooncake://"):
            return uri
        # The ranks lend the store no memory (a SIGKILL would take their segments' features
        # with them): a keeper process does, see _keeper.py.
        lent = dict(parse_qsl(urlsplit(uri).query)).get("segment_size", "64M")
        self.lender_store_uri = _with_query(uri, segment_size=lent)
        return _with_query(uri, segment_size="0")

    def _start_master(self, store: str) -> str:
        """Start a local mooncake_master where ``store`` says; the URI of a store on it."""
        from stores.mooncake_master import MooncakeMaster

        parts = urlsplit(store)
        if parts.hostname not in (None, "127.0.0.1", "localhost"):
            raise ValueError(
                f"--start-mooncake-master starts a master on 127.0.0.1, but --store names "
                f"{parts.hostname}; pass --store mooncake:// (or mooncake://127.0.0.1:PORT)"
            )
        query = dict(parse_qsl(parts.query))
        namespace = query.pop("namespace", self.run_id)
        protocol = query.pop("protocol", "tcp")
        for own in ("metadata", "admin"):  # the started master's own servers
            query.pop(own, None)
        # A short read lease: released features leave the store soon after their last read.
        self._master = MooncakeMaster(rpc_port=parts.port, lease_ttl_ms=500).start()
        return _with_query(self._master.store_uri(namespace=namespace, protocol=protocol), **query)

    def _config(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "ledger_url": self.ledger_url,
            "store_uri": self.store_uri,
            "lender_store_uri": self.lender_store_uri,
            "endpoints": self.endpoints,
            "samples": self.samples,
            "producers": PRODUCERS,
            "seed": self.options.seed,
            "batch_size": BATCH_SIZE,
            "grad_accum": GRAD_ACCUM,
            "checkpoint_every": self.checkpoint_every,
            "eval_every": self.eval_every,
            "window": WINDOW,
            "lr": LR,
            "checkpoint_root": str(self.workdir / "checkpoints"),
            "run_dir": str(self.run_dir),
            "demo_pid": os.getpid(),
        }

    def _announce(self) -> None:
        per_step = BATCH_SIZE * GRAD_ACCUM * RANKS
        crash = (
            f"SIGKILL both ranks once {self.kill_at} samples are trained, then restart them"
            if self.options.crash
            else "no crash (--no-crash)"
        )
        self._say(
            f"dataflow demo: run {self.run_id} in {self.workdir}\n"
            f"  ledger   {self.ledger.safe_url}\n"
            f"  store    {self.store_uri}\n"
            f"  stream   ZeroMQ to {', '.join(self.endpoints)} (window {WINDOW} refs per rank)\n"
            f"  work     {PRODUCERS} producers x {self.samples // PRODUCERS} prompts -> "
            f"{RANKS} gloo ranks (DDP), {per_step} samples per optimizer step "
            f"(batch {BATCH_SIZE} x grad_accum {GRAD_ACCUM} x {RANKS} ranks), eval every "
            f"{self.eval_every} and checkpoint every {self.checkpoint_every} steps\n"
            f"  crash    {crash}\n"
            f"  logs     {self.run_dir / 'logs'}"
        )

    def _start(self, name: str, role: str, *args: Any) -> _Child:
        log = self.run_dir / "logs" / f"{name}.log"
        child = _Child(name, self._spawn(name, role, str(log), *args), log)
        self.children.append(child)
        return child

    def _spawn(self, name: str, role: str, log: str, *args: Any) -> BaseProcess:
        """Start child ``name`` (a fork of the fork server); ``chaos --hosts`` places it."""
        config = str(self.run_dir / "config.json")
        process = self._context.Process(
            target=run_child, args=(role, config, log, *args), name=name
        )
        process.start()
        return process

    def _start_keeper(self) -> None:
        """Start the process that lends the Mooncake store its memory; wait until it does."""
        ready = self.run_dir / "store-keeper.ready"
        keeper = self._start("store-keeper", "keeper", str(ready))
        keeper.service = True
        deadline = time.monotonic() + STALL_S
        while not ready.exists():
            failure = keeper.failure()
            if failure is not None:
                raise DemoError(failure)
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the store keeper did not open {self.store_uri} (see {keeper.log})"
                )
            time.sleep(TICK_S)

    def _start_ranks(self) -> None:
        self.attempt += 1
        port = loopback_port()  # the gloo rendezvous of this attempt
        self.ranks = [
            self._start(f"rank{rank}-attempt{self.attempt}", "trainer", rank, self.attempt, port)
            for rank in range(RANKS)
        ]

    def _watch(self) -> None:
        """Fold the ledger as it grows, print progress, kill and restart the ranks once."""
        state = RunState(self.run_id, ref_source=self.ledger)
        last_event = time.monotonic()
        epoch = 0
        while True:
            head = state.head_seq
            state.apply_rows(self.ledger.rows(self.run_id, after_seq=head))
            now = time.monotonic()
            if state.head_seq != head:
                last_event = now
            self._read_evals()
            trained = len(state.trained)
            self.timeline.samples.append((now - self.started, len(state.committed), trained))
            if state.epoch != epoch:
                epoch = state.epoch
                if epoch > 1:
                    self._say_resumed(state)
            self._progress(state)
            if self._tick_and_check(state, now):
                last_event = time.monotonic()
            if all(c.process.exitcode == 0 for c in self.children if not (c.killed or c.service)):
                return
            if now - last_event > STALL_S:
                raise DemoError(
                    f"no new event in the ledger for {STALL_S:.0f} s; the processes' logs are "
                    f"in {self.run_dir / 'logs'}"
                )
            time.sleep(TICK_S)

    def _tick_and_check(self, state: RunState, now: float) -> bool:
        """``_tick``, then DemoError for a child that failed; what ``_tick`` returned.

        Only children already dead when ``_tick`` looked can fail this round: one that
        dies just after (a planned self-kill, a casualty of a server's kill) is
        ``_tick``'s to notice on the next round, not a failure.
        """
        dead = {id(c) for c in self.children if c.process.exitcode is not None}
        restarted = self._tick(state, now)  # first: a child it killed is no failure
        for child in self.children:
            failure = child.failure() if id(child) in dead else None
            if failure is not None:
                raise DemoError(failure)
        return restarted

    def _tick(self, state: RunState, now: float) -> bool:
        """Called on every round of the watch: kill and restart the ranks once, when due;
        True when something was restarted."""
        if not self.options.crash or self.attempt != 1 or self._kill_missed:
            return False
        if self._kill_due is None and len(state.trained) >= self.kill_at:
            self._kill_due = now + self.kill_delay
        if self._kill_due is None or now < self._kill_due:
            return False
        return self._kill_and_restart(state)

    #: The ranks finished before the SIGKILL was due: this run had no crash.
    _kill_missed = False

    def _kill_and_restart(self, state: RunState) -> bool:
        """SIGKILL both ranks and start them again; False when they had finished first."""
        if any(rank.process.exitcode is not None for rank in self.ranks):
            self._kill_missed = True
            self._say(
                f"the ranks finished before the SIGKILL was due ({len(state.trained)} samples "
                "trained): no crash this run (a slower machine, or --samples, gives it time)"
            )
            return False
        for rank in self.ranks:
            os.kill(rank.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            rank.killed = True
        for rank in self.ranks:
            rank.process.join()
        state.apply_rows(self.ledger.rows(self.run_id, after_seq=state.head_seq))
        t = time.monotonic() - self.started
        steps = [state.last_ack_step(f"rank{r}-attempt{self.attempt}") for r in range(RANKS)]
        self.timeline.kill = {
            "t": round(t, 3),
            "step": max(steps),
            "trained": len(state.trained),
            "leased": len(state.leased),
            "last_checkpoint_step": max(state.last_checkpoint_step, 0),
            "pids": [rank.process.pid for rank in self.ranks],
            "exit_codes": [rank.process.exitcode for rank in self.ranks],
        }
        kill = self.timeline.kill
        self._say(
            f"[{t:6.1f}s] SIGKILL rank 0 (pid {kill['pids'][0]}) and rank 1 (pid "
            f"{kill['pids'][1]}) after step {kill['step']}: {kill['leased']} samples leased "
            f"and unacked, the last checkpoint at step {kill['last_checkpoint_step']}; "
            "restarting both ranks, they resume through the ledger"
        )
        self._start_ranks()
        return True

    def _say_resumed(self, state: RunState) -> None:
        plan = state.plans[state.epoch]
        since = time.monotonic() - self.started
        where = (
            f"the checkpoint at step {plan.checkpoint_step}"
            if plan.checkpoint_step is not None
            else "scratch (no checkpoint yet)"
        )
        self._say(
            f"[{since:6.1f}s] resumed from {where}: {len(plan.trained)} samples stay trained, "
            f"{len(plan.requeued)} committed ones are requeued (what the killed ranks leased, "
            "trained after the checkpoint, or had in flight on the stream)"
        )

    def _read_evals(self) -> None:
        path = self.run_dir / "evals.jsonl"
        try:
            with path.open("rb") as file:
                file.seek(self._evals_offset)
                data = file.read()
        except FileNotFoundError:
            return
        if b"\n" not in data:
            return
        complete = data[: data.rindex(b"\n") + 1]
        self._evals_offset += len(complete)
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):  # a line cut by a SIGKILL
                self._evals.append(json.loads(line))

    def _progress(self, state: RunState, *, final: bool = False) -> None:
        """The live line: redrawn in place on a terminal; elsewhere (a log, a pipe) printed
        when something changed, at most every few seconds."""
        now = time.monotonic()
        if not final and now - self._last_print < (0.5 if self.tty else 3.0):
            return
        acks = [state.last_ack_step(f"rank{r}-attempt{self.attempt}") for r in range(RANKS)]
        step = max(*acks, state.last_checkpoint_step)
        acc = self._evals[-1]["metrics"].get("eval/simulated_acc_len") if self._evals else None
        status = (
            f"committed {len(state.committed):>5}/{self.samples}  "
            f"trained {len(state.trained):>5}  leased {len(state.leased):>3}  "
            f"step {step:>4}  checkpoint {max(state.last_checkpoint_step, 0):>4}  "
            f"acceptance length {'-' if acc is None else f'{acc:.2f}'}  attempt {self.attempt}"
        )
        if not (self.tty or final) and status == self._last_status:
            return
        self._last_print, self._last_status = now, status
        line = f"[{now - self.started:6.1f}s] {status}"
        if self.tty:
            sys.stdout.write("\r\033[K" + line + ("\n" if final else ""))
            sys.stdout.flush()
        else:
            self._say(line)

    def _say(self, text: str) -> None:
        if self.tty and self._last_print:
            sys.stdout.write("\r\033[K")  # over the live progress line
        print(text, flush=True)

    def _end_children(self) -> None:
        """Stop the services; kill whatever else still runs (after a failure, an interrupt)."""
        for child in self.children:
            if child.process.exitcode is None:
                if child.service:
                    child.process.terminate()
                else:
                    child.process.kill()
        for child in self.children:
            child.process.join(10)
            if child.process.exitcode is None:  # a service stuck in its shutdown
                child.process.kill()
                child.process.join()

    # -- the end ------------------------------------------------------------------------
    def _finish(self) -> dict[str, Any]:
        state = RunState(self.run_id, ref_source=self.ledger)
        state.apply_rows(self.ledger.rows(self.run_id))
        self._read_evals()
        self._progress(state, final=True)
        # The report `dataflow replay` prints: the fold of the whole log, and its verification.
        print(
            f"\n$ dataflow replay --ledger {self.ledger.safe_url} --run {self.run_id}", flush=True
        )
        self._print_replay()
        sys.stdout.flush()
        final = self._final_eval()
        lineage = lineage_report(self.ledger.events(self.run_id))
        report = build_report(
            run_id=self.run_id,
            ledger_url=self.ledger.safe_url,
            store_uri=self.store_uri,
            state=state,
            lineage=lineage,
            final=final,
            wall_s=time.monotonic() - self.started,
            kill=self.timeline.kill,
        )
        timeline = {
            "started": self.timeline.started,
            "samples": self.timeline.samples,
            "kill": self.timeline.kill,
            "resumes": [t - self.started_wall for t in lineage.resume_ts],
            "checkpoints": [(t - self.started_wall, s) for t, s in lineage.checkpoints],
            "evals": [(e["t"] - self.started_wall, e["step"], e["metrics"]) for e in self._evals],
            "total": self.samples,
        }
        note = write_timeline(self.workdir / "timeline.png", timeline)
        report["timeline"] = None if note else str(self.workdir / "timeline.png")
        if note:
            report["timeline_note"] = note
        _write_json(self.workdir / "report.json", report)
        self._summary(report)
        return report

    def _print_replay(self) -> None:
        """Print what ``dataflow replay`` prints of the run (its report, then any violations)."""
        with progress_bar("replay", self.ledger.head_seq(self.run_id)) as progress:
            fold = RunFold(self.ledger, self.run_id)
            fold.update(progress)
        report = run_report(fold)
        print_run_report(report)
        if report["violations"]:
            say(fails_verification(self.run_id, len(report["violations"])), file=sys.stderr)

    def _final_eval(self) -> dict[str, Any]:
        path = self.run_dir / "final.json"
        try:
            final = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DemoError(f"rank 0 left no final eval at {path} ({exc})") from exc
        if not final.get("metrics") and self._evals:
            # Ranks restarted from the run's last checkpoint train nothing and evaluate
            # nothing: the run's final eval is the last one the killed ranks recorded.
            final["metrics"] = self._evals[-1]["metrics"]
        return final

    def _summary(self, report: dict[str, Any]) -> None:
        metrics = report["final_metrics"] or {}
        acc = metrics.get("eval/simulated_acc_len")
        positions = sum(1 for key in metrics if key.startswith("eval/acceptance_rate_"))
        lines = [
            "",
            f"committed {report['committed']}, trained {report['trained']} in the final lineage, "
            f"lost {report['lost']}, trained twice {report['duplicated']}; "
            + (f"resumed {report['resumes']} time(s); " if report["resumes"] else "")
            + "verify: "
            + ("clean" if not report["verify"] else f"{len(report['verify'])} violations"),
            f"draft heads after step {report['final_step']}: simulated acceptance length "
            + ("-" if acc is None else f"{acc:.3f}")
            + f" of {positions} draft tokens; {report['samples_per_s']:.1f} samples/s, "
            f"{report['wall_s']:.1f} s in all",
            f"report:   {self.workdir / 'report.json'}",
            f"timeline: {report['timeline'] or report.get('timeline_note')}",
        ]
        self._say("\n".join(lines))


class Terminated(DemoError):
    """A SIGTERM stopped the demo (or chaos): whatever it started is stopped too."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside, a SIGTERM raises ``Terminated`` (in the main thread; elsewhere nothing
    changes), so that ``finally`` blocks stop what was started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, frame: object) -> NoReturn:
    raise Terminated("stopped by SIGTERM; the processes it started are stopped too")


def _with_query(uri: str, **params: str) -> str:
    """``uri`` with ``params`` set in its query."""
    parts = urlsplit(uri)
    query = dict(parse_qsl(parts.query)) | params
    return urlunsplit(parts._replace(query=urlencode(query)))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole or not at all (a reader never sees half a report)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
