"""Network faults between simulated hosts: streams, gloo and Mooncake, each a scenario.

Each scenario takes a started :class:`~dataflow.testing.Cluster`, starts what it needs
on its hosts (ranks and producers as real processes, ``python -m
dataflow.testing._net_rank`` / ``_net_producer``), injects its fault, lets the run
finish, checks it against the ledger and collects the store's garbage, and returns a
:class:`NetFaultOutcome`. Everything it started is stopped before it returns; each is
bounded in time (a few tens of seconds at most) by small timeouts of the library
under test. The ledger is a SQLite file on the directory every host sees, unless a
scenario is about the network path to PostgreSQL (:func:`latency_run`).

* :func:`stream_partition`: the ZeroMQ (CURVE) link of a producer host and a trainer
  host cut, silently or loudly, shorter or longer than the stream's timeouts, or until
  the producer has closed.
* :func:`gloo_partition`: two trainer hosts cut from each other mid-run; both ranks
  stop within the collective timeout, are restarted and resume from the ledger.
* :func:`mooncake_partition` and :func:`latency_run` (``_host_faults_services``): a
  producer cut off from the Mooncake master; latency, stalls and resets on every link.
"""

from __future__ import annotations

import json
import random
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dataflow.live._producer import Producer
from dataflow.live._replay import replay
from dataflow.recorder._ledger import Ledger
from dataflow.tools._lineage_acks import final_lineage_acks

if TYPE_CHECKING:
    import subprocess

    from dataflow.testing._cluster import Cluster, Host

#: Stream heartbeats of both ends: a producer silent for a second is lost.
HEARTBEATS = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0}
RANK_MODULE = "dataflow.testing._net_rank"
PRODUCER_MODULE = "dataflow.testing._net_producer"
_POLL_S = 0.05
#: The port a rank's receiver binds on its host (each host is a namespace of its own).
STREAM_PORT = 5601


@dataclass(frozen=True)
class NetFaultOutcome:
    """What one fault trial came to."""

    kind: str
    """The fault: ``stream-partition``, ``gloo-partition``, ``mooncake-partition``, ``latency``."""
    lost: int
    """Committed samples never trained in the run's final lineage."""
    duplicated: int
    """Samples trained more than once in the final lineage, or trained and never committed."""
    orphans: int
    """Store objects no run keeps alive, left after a garbage collection (``dataflow gc``)."""
    recovery_s: float | None
    """From the end of the fault (the heal, or the restart) to the next sample trained;
    None when nothing was left to train by then (the run got around the fault)."""
    detail: str
    """What happened, in words: the errors raised, the stream's losses, the durations."""
    committed: int = 0
    violations: tuple[str, ...] = ()
    """``verify()`` of the run's ledger: empty when clean."""
    errors: tuple[str, ...] = field(default=())
    """The errors that stopped a component, or that it retried past (``Type: message``)."""
    facts: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """Counters of the trial by name (e.g. ``producer_lost``, ``stopped_s``), for tests."""

    @property
    def clean(self) -> bool:
        """Nothing lost, duplicated or orphaned, and the ledger verifies."""
        return not (self.lost or self.duplicated or self.orphans or self.violations)


class Trial:
    """One scenario's directory (on the path every host sees), ledger, store and children."""

    def __init__(self, cluster: Cluster, kind: str, *, ledger_url: str | None = None) -> None:
        self.cluster, self.kind = cluster, kind
        self.dir = Path(cluster.workdir) / f"{kind}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir(parents=True)
        self.run_id = f"{kind}-run"
        self.ledger_url = ledger_url or f"sqlite:///{self.dir}/ledger.db"
        self.store_uri = f"dir://{self.dir}/features"
        (self.dir / "ckpt").mkdir()
        self.children: list[tuple[Host, subprocess.Popen[Any], str]] = []
        self.phases: dict[str, float] = {}
        self._since = time.monotonic()

    def phase(self, name: str) -> None:
        """End the trial's phase ``name`` (its seconds since the last one ended): where a
        trial's time goes, in ``facts["phases"]``."""
        now = time.monotonic()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - self._since, 2)
        self._since = now

    def gate(self, at: int) -> dict[str, Any]:
        """A producer's config entries to wait, once ``at`` samples are emitted, until
        :meth:`open_gate` (see ``_net_producer``): the fault then lands mid-run."""
        return {"gate": str(self.dir / "gate"), "gate_at": at}

    def open_gate(self) -> None:
        (self.dir / "gate").touch()

    def config(self, name: str, **more: Any) -> dict[str, Any]:
        """A child's config: the trial's ledger, store and run, and files of its own."""
        return {
            "run_id": self.run_id,
            "ledger_url": self.ledger_url,
            "store_uri": self.store_uri,
            "checkpoint_dir": str(self.dir / "ckpt"),
            "progress": str(self.dir / f"{name}.progress"),
            "result": str(self.dir / f"{name}.json"),
            **more,
        }

    def start(self, host: str, module: str, config: dict[str, Any]) -> subprocess.Popen[Any]:
        """``python -m module CONFIG`` on ``host``, its output in the trial's directory."""
        name = Path(config["result"]).stem
        log = (self.dir / f"{name}.log").open("ab")
        process = self.cluster[host].popen(
            [sys.executable, "-m", module, json.dumps(config)], stdout=log, stderr=log
        )
        log.close()
        self.children.append((self.cluster[host], process, name))
        return process

    def wait(self, processes: Iterable[subprocess.Popen[Any]], timeout_s: float) -> list[str]:
        """Wait for ``processes`` to exit within ``timeout_s``; kill those that did not, and
        say which."""
        deadline = time.monotonic() + timeout_s
        hung = []
        for process in processes:
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            if process.poll() is None:
                host, _, name = next(c for c in self.children if c[1] is process)
                host.kill(process)
                hung.append(f"{name} did not finish within {timeout_s:g} s and was killed")
        return hung

    def stop(self) -> None:
        """Kill whatever of this trial still runs."""
        for host, process, _ in self.children:
            if process.poll() is None:
                host.kill(process)

    def result(self, name: str) -> dict[str, Any]:
        """A child's result file ({} if it wrote none: it was killed)."""
        try:
            return json.loads((self.dir / f"{name}.json").read_text())
        except FileNotFoundError:
            return {}

    def log_tail(self, name: str, lines: int = 5) -> str:
        try:
            text = (self.dir / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def acks_after(self, names: Sequence[str], since: float) -> float | None:
        """The monotonic time of the first ack after ``since`` in these ranks' progress."""
        times = []
        for name in names:
            path = self.dir / f"{name}.progress"
            if path.exists():
                times += [
                    json.loads(line)["t"] for line in path.read_text().splitlines() if line.strip()
                ]
        later = [t for t in times if t > since]
        return min(later) if later else None

    def acked(self, names: Sequence[str]) -> int:
        """How many samples these ranks acked so far (their progress files)."""
        count = 0
        for name in names:
            path = self.dir / f"{name}.progress"
            if path.exists():
                count += sum(
                    len(json.loads(line)["ids"])
                    for line in path.read_text().splitlines()
                    if line.strip()
                )
        return count

    def emitted(self, name: str) -> int:
        path = self.dir / f"{name}.progress"
        if not path.exists():
            return 0
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return int(lines[-1].split()[0]) if lines else 0

    def wait_for(self, what: str, ready: Any, timeout_s: float) -> None:
        """Poll ``ready()`` until true; RuntimeError naming ``what`` (and the logs) if not."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() >= deadline:
                logs = "; ".join(f"{n}: {self.log_tail(n)}" for _, _, n in self.children)
                raise RuntimeError(f"{self.kind}: {what} not within {timeout_s:g} s ({logs})")
            time.sleep(_POLL_S)

    def outcome(
        self,
        *,
        recovery_s: float | None,
        detail: str,
        errors: Sequence[str] = (),
        store_uri: str | None = None,
        facts: dict[str, Any] | None = None,
        gc_host: str | None = None,
    ) -> NetFaultOutcome:
        """Settle the trial from its ledger: lost, duplicated, verify, then gc's orphans
        (``dataflow gc`` run on ``gc_host`` when given: a store reached through this
        process's relays cannot be opened here, see :func:`collect_orphans_on`)."""
        uri = store_uri or self.store_uri
        self.phase("run")
        with Ledger.open(self.ledger_url) as ledger:
            state = replay(ledger, self.run_id)
            committed = set(state.committed)
            trained = final_lineage_acks(ledger.events(self.run_id))
            if gc_host is None:
                orphans = collect_orphans(ledger, uri, self.run_id)
        if gc_host is not None:
            orphans = collect_orphans_on(self.cluster[gc_host], self.ledger_url, uri, self.run_id)
        self.phase("checks and gc")
        return NetFaultOutcome(
            kind=self.kind,
            lost=len(committed - set(trained)),
            duplicated=sum(1 for n in trained.values() if n > 1) + len(set(trained) - committed),
            orphans=orphans,
            recovery_s=recovery_s,
            detail=detail,
            committed=len(committed),
            violations=tuple(state.verify()),
            errors=tuple(errors),
            facts={**(facts or {}), "phases": dict(self.phases)},
        )


def collect_orphans(ledger: Ledger, store_uri: str, run_id: str) -> int:
    """``dataflow gc --grace 0``, then what the store still holds that the run's fold keeps
    no reason for (the newest committed revision, neither released nor lost)."""
    from dataflow.tools._gc import collect_garbage
    from stores import open_store

    store = open_store(store_uri)
    try:
        collect_garbage(ledger, store, grace=0)
        state = replay(ledger, run_id)
        stored = [s for s in state.committed if s not in state.released and s not in state.lost]
        live = {(sid, ref.generation) for sid, ref in state.refs(stored).items()}
        return sum(1 for obj in store.scan() if (obj.sample_id, obj.generation) not in live)
    finally:
        store.close()


def collect_orphans_on(host: Host, ledger_url: str, store_uri: str, run_id: str) -> int:
    """``dataflow gc --grace 0`` on ``host``, then what a dry run would still remove.

    For a store whose URI names one of this process's relays: a Mooncake client holds
    the interpreter's lock in its calls, so one in this process would stop the relay
    it talks through.
    """
    base = [sys.executable, "-m", "dataflow", "gc", "--ledger", ledger_url, "--run", run_id,
            "--store", store_uri, "--grace", "0", "--json"]  # fmt: skip
    host.run(base, capture_output=True, timeout=120)
    dry = host.run([*base, "--dry-run"], capture_output=True, text=True, timeout=120)
    return int(json.loads(dry.stdout.strip().splitlines()[-1])["removed"])


def curve_keys(directory: Path) -> tuple[dict[str, str], dict[str, str]]:
    """CURVE certificates for one receiver and one producer: the receiver's config (its
    secret, the producers' public keys) and the producer's (its secret, the server's key)."""
    import zmq.auth

    server_public, server_secret = zmq.auth.create_certificates(directory, "receiver")
    allowed = directory / "producers"
    allowed.mkdir()
    _, producer_secret = zmq.auth.create_certificates(allowed, "producer")
    secret = directory / "producer.key_secret"
    Path(producer_secret).replace(secret)  # only public keys stay among the allowed
    return (
        {"secret_key_file": str(server_secret), "authorized_keys_dir": str(allowed)},
        {"secret_key_file": str(secret), "server_public_key_file": str(server_public)},
    )


def commit_samples(trial: Trial, count: int, producer_id: str = "p0") -> None:
    """Commit ``count`` samples (the producer child's features) and close the producer,
    from this process: a run whose data is all in the ledger before the ranks start."""
    from dataflow.testing._net_producer import features
    from stores import open_store

    with Ledger.open(trial.ledger_url) as ledger:
        store = open_store(trial.store_uri)
        producer = Producer(ledger, store, run_id=trial.run_id, producer_id=producer_id)
        producer.emit_many((f"s{i:05d}", features(i)) for i in range(count))
        producer.close()
        store.close()


# -- the scenarios ----------------------------------------------------------------------


def stream_partition(
    cluster: Cluster,
    *,
    silent: bool = True,
    cut_s: float | None = 3.0,
    samples: int = 40,
    producer: str = "producer0",
    trainer: str = "trainer0",
    timeout_s: float = 45.0,
) -> NetFaultOutcome:
    """The stream link of ``producer`` and ``trainer`` cut for ``cut_s`` seconds once a
    third of the samples went out, then healed; ``cut_s=None`` keeps it cut until the
    producer has emitted everything and closed (its end of stream lost on the way).

    The rank's receiver binds ``trainer``'s address with CURVE; the producer connects
    to it. Heartbeats every 0.1 s, lost after 1 s; the producer's sends wait 0.25 s for
    credit, then keep the ref to send again (it stays committed in the ledger).
    """
    trial = Trial(cluster, "stream-partition")
    try:
        return _stream_partition(trial, silent, cut_s, samples, producer, trainer, timeout_s)
    finally:
        trial.stop()


def _stream_partition(
    trial: Trial,
    silent: bool,
    cut_s: float | None,
    samples: int,
    producer: str,
    trainer: str,
    timeout_s: float,
) -> NetFaultOutcome:
    cluster = trial.cluster
    server_curve, client_curve = curve_keys(trial.dir)
    endpoint_file = trial.dir / "endpoint"
    # A port known beforehand (the trainer host's own namespace has it free): the
    # producer starts with the rank (torch imported meanwhile) and connects once the
    # rank's receiver is up.
    endpoint = f"tcp://{cluster[trainer].address}:{STREAM_PORT}"
    rank = trial.start(
        trainer,
        RANK_MODULE,
        trial.config(
            "rank0",
            rank=0,
            consumer_id="rank0",
            batch=4,
            stream={
                "endpoint": endpoint,
                "endpoint_file": str(endpoint_file),
                "curve": server_curve,
                **HEARTBEATS,
            },
        ),
    )
    sender = trial.start(
        producer,
        PRODUCER_MODULE,
        trial.config(
            "p0",
            producer_id="p0",
            samples=samples,
            interval_s=0.03,
            after=[str(endpoint_file)],
            **trial.gate(samples // 3),
            stream={
                "endpoints": [endpoint],
                "curve": client_curve,
                "send_timeout": 0.25,
                "close_timeout": 1.0,
                **HEARTBEATS,
            },
        ),
    )
    trial.wait_for("the rank's receiver", endpoint_file.exists, 60)
    trial.wait_for("a third of the samples", lambda: trial.emitted("p0") >= samples // 3, 30)
    trial.phase("up, a third emitted")
    cluster.cut(producer, trainer, silent=silent)
    cut_at = time.monotonic()
    trial.open_gate()  # the producer, waiting at a third, goes on into the cut
    if cut_s is None:
        hung = trial.wait([sender], timeout_s)
    else:
        time.sleep(cut_s)
        hung = []
    cluster.heal(producer, trainer)
    healed_at = time.monotonic()
    held_s = healed_at - cut_at
    acked_at_heal = trial.acked(["rank0"])
    hung += trial.wait([sender, rank], timeout_s)
    first = trial.acks_after(["rank0"], healed_at)
    rank_result, producer_result = trial.result("rank0"), trial.result("p0")
    receiver = rank_result.get("receiver") or {}
    errors = [e for e in (rank_result.get("error"), producer_result.get("error")) if e]
    how = "silently" if silent else "loudly"
    detail = (
        f"stream link {producer}<->{trainer} cut {how} for {held_s:.1f} s "
        + ("(until the producer closed)" if cut_s is None else f"(asked {cut_s:g} s)")
        + f"; {acked_at_heal} of {samples} trained at the heal; producer lost "
        f"{rank_result.get('producer_lost', '?')} times at the rank; receiver: received "
        f"{receiver.get('received', '?')}, dropped {receiver.get('dropped_refs', '?')}; "
        f"rank exit {rank.returncode}, producer exit {sender.returncode}"
        + "".join(f"; {h}" for h in hung)
    )
    return trial.outcome(
        recovery_s=None if first is None else first - healed_at,
        detail=detail,
        errors=errors,
        facts={
            "held_s": held_s,
            "producer_lost": rank_result.get("producer_lost"),
            "received": receiver.get("received"),
            "dropped": receiver.get("dropped_refs"),
            "exits": [rank.returncode, sender.returncode],
            "hung": hung,
        },
    )


def gloo_partition(
    cluster: Cluster,
    *,
    silent: bool = True,
    collective_timeout_s: float = 3.0,
    samples: int = 48,
    ranks: tuple[str, str] = ("trainer0", "trainer1"),
    timeout_s: float = 45.0,
    seed: int = 0,
) -> NetFaultOutcome:
    """Two ranks, each on its host, in a gloo group over the hosts' addresses
    (``GLOO_SOCKET_IFNAME`` the hosts' interface), reducing once per step; their link is
    cut once a third of the samples are trained. Both must stop within the collective
    timeout with :class:`~dataflow.PeerFailedError`; the link is healed, both are
    restarted and resume from the ledger's latest checkpoint, and the run finishes.
    """
    trial = Trial(cluster, "gloo-partition")
    try:
        return _gloo_partition(trial, silent, collective_timeout_s, samples, ranks, timeout_s, seed)
    finally:
        trial.stop()


def _gloo_partition(
    trial: Trial,
    silent: bool,
    collective_timeout_s: float,
    samples: int,
    ranks: tuple[str, str],
    timeout_s: float,
    seed: int,
) -> NetFaultOutcome:
    cluster = trial.cluster
    commit_samples(trial, samples)
    trial.phase("commit")
    port = random.Random(seed).randrange(20000, 30000)

    go = trial.dir / "restart"

    def start_ranks(attempt: int) -> list[subprocess.Popen[Any]]:
        return [
            trial.start(
                host,
                RANK_MODULE,
                trial.config(
                    f"rank{r}-attempt{attempt}",
                    # The second attempt starts with the first and waits (torch imported)
                    # for the restart: it joins, resumes and trains only after the heal.
                    after=[str(go)] if attempt > 1 else [],
                    after_s=2 * timeout_s + collective_timeout_s * 3 + 60,
                    rank=r,
                    world_size=2,
                    consumer_id=f"rank{r}",
                    batch=2,
                    checkpoint_every=3,
                    step_s=0.2,  # 12 steps of 0.2 s: a loaded poll still sees the third
                    gloo={
                        "address": cluster[ranks[0]].address,
                        "port": port + attempt,  # not the old group's (TIME_WAIT)
                        "interface": cluster[host].interface,
                        "timeout_s": collective_timeout_s,
                    },
                ),
            )
            for r, host in enumerate(ranks)
        ]

    first_names = ["rank0-attempt1", "rank1-attempt1"]
    first = start_ranks(1)
    second = start_ranks(2)
    trial.wait_for(
        "a third of the samples trained", lambda: trial.acked(first_names) >= samples // 3, 40
    )
    trial.phase("ranks up, a third trained")
    cluster.cut(*ranks, silent=silent)
    cut_at = time.monotonic()
    hung = trial.wait(first, collective_timeout_s * 3 + 15)
    trial.phase("cut until both stopped")
    stopped_s = time.monotonic() - cut_at
    errors = [trial.result(n).get("error") for n in first_names]
    cluster.heal(*ranks)
    restarted_at = time.monotonic()
    go.touch()
    hung += trial.wait(second, timeout_s)
    trial.phase("restarted ranks finish")
    second_names = ["rank0-attempt2", "rank1-attempt2"]
    again = [trial.result(n).get("error") for n in second_names]
    back = trial.acks_after(second_names, restarted_at)
    how = "silently" if silent else "loudly"
    detail = (
        f"gloo link {ranks[0]}<->{ranks[1]} cut {how} with "
        f"{trial.acked(first_names)} of {samples} acked; both ranks stopped "
        f"{stopped_s:.1f} s after the cut (collective timeout {collective_timeout_s:g} s), "
        f"exit {[p.returncode for p in first]}; restarted after the heal: exit "
        f"{[p.returncode for p in second]}"
        + "".join(f"; {e}" for e in again if e)
        + "".join(f"; {h}" for h in hung)
    )
    return trial.outcome(
        recovery_s=None if back is None else back - restarted_at,
        detail=detail,
        errors=[e for e in errors if e],
        facts={
            "stopped_s": stopped_s,
            "first_errors": errors,
            "first_exits": [p.returncode for p in first],
            "second_exits": [p.returncode for p in second],
            "hung": hung,
        },
    )
