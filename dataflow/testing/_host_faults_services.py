"""Network faults on the paths to the services: the Mooncake master, and latency everywhere.

The scenarios of :mod:`dataflow.testing._host_faults_net` that need a service of the
cluster (a Mooncake master on its host, PostgreSQL on its host), with the same
:class:`~dataflow.testing._host_faults_net.NetFaultOutcome`:

* :func:`mooncake_partition`: a producer host cut off from the Mooncake master's host
  mid-run, then healed.
* :func:`latency_run`: a whole run with 100 ms (+/- jitter) on every TCP link a relay
  can carry (producer -> PostgreSQL, each rank -> PostgreSQL, producer -> each rank's
  stream), with stalls and resets of those links at seeded random moments. Gloo
  between the ranks goes direct: gloo opens a connection per pair on a port each rank
  picks and advertises its interface's address, so a relay cannot stand between them.
"""

from __future__ import annotations

import random
import threading
import time
import urllib.parse
import uuid
from typing import TYPE_CHECKING, Any

from dataflow.recorder._ledger import Ledger
from dataflow.testing._host_faults_net import (
    HEARTBEATS,
    PRODUCER_MODULE,
    RANK_MODULE,
    NetFaultOutcome,
    Trial,
    curve_keys,
)

if TYPE_CHECKING:
    import subprocess

    from dataflow.testing._cluster import Cluster
    from dataflow.testing._relay import Relay


def mooncake_partition(
    cluster: Cluster,
    *,
    silent: bool = True,
    cut_s: float = 6.0,
    samples: int = 30,
    producer: str = "producer0",
    trainer: str = "trainer0",
    master_host: str = "master",
    client_ttl_s: int = 10,
    timeout_s: float = 45.0,
) -> NetFaultOutcome:
    """``producer`` cut off from the Mooncake master on ``master_host`` for ``cut_s``
    seconds once a third of its samples are in, then healed.

    The producer mounts a segment of its own and puts into it; a rank on ``trainer``
    (mounting none) leases from the SQLite ledger and reads from the producer's
    memory. A put that cannot reach the master raises ``StoreUnavailableError`` after
    the store's ``connect_timeout`` (5 s) and the producer emits the same id again.
    Keep ``cut_s`` below the master's ``client_ttl`` (10 s by default): a producer
    silent for longer is dropped with everything its memory held.
    """
    master = cluster.start_mooncake_master(master_host, extra_args=(f"-client_ttl={client_ttl_s}",))
    trial = Trial(cluster, "mooncake-partition")
    try:
        return _mooncake_partition(
            trial, master, silent, cut_s, samples, producer, trainer, master_host, timeout_s
        )
    finally:
        trial.stop()
        master.stop()


def _mooncake_partition(
    trial: Trial,
    master: Any,
    silent: bool,
    cut_s: float,
    samples: int,
    producer: str,
    trainer: str,
    master_host: str,
    timeout_s: float,
) -> NetFaultOutcome:
    cluster = trial.cluster
    uri = master.store_uri(namespace=f"nf-{uuid.uuid4().hex[:8]}")
    hold = trial.dir / "release"
    sender = trial.start(
        producer,
        PRODUCER_MODULE,
        trial.config(
            "p0",
            producer_id="p0",
            samples=samples,
            interval_s=0.05,
            retry_s=30.0,
            store_uri=f"{uri}&segment_size=32M",
            hold=str(hold),
            hold_s=timeout_s,
            **trial.gate(samples // 3),
        ),
    )
    # Started with the producer (torch imported meanwhile), the rank joins once the
    # producer's first samples are committed: a run with no producer yet is drained.
    rank = trial.start(
        trainer,
        RANK_MODULE,
        trial.config(
            "rank0",
            rank=0,
            consumer_id="rank0",
            batch=4,
            store_uri=f"{uri}&segment_size=0",
            after=[str(trial.dir / "p0.progress")],
        ),
    )
    trial.wait_for("the producer's first samples", lambda: trial.emitted("p0") >= 1, 60)
    trial.wait_for("a third of the samples", lambda: trial.emitted("p0") >= samples // 3, 40)
    trial.phase("up, a third emitted")
    cluster.cut(producer, master_host, silent=silent)
    cut_at = time.monotonic()
    emitted_at_cut = trial.emitted("p0")
    trial.open_gate()  # the producer, waiting at a third, goes on into the cut
    time.sleep(cut_s)
    emitted_in_cut = trial.emitted("p0") - emitted_at_cut
    cluster.heal(producer, master_host)
    healed_at = time.monotonic()
    trial.wait_for("every sample emitted", lambda: trial.emitted("p0") >= samples, timeout_s)
    back = _first_emit_after(trial, "p0", healed_at)
    hung = trial.wait([rank], timeout_s)
    hold.touch()  # the rank read everything: the producer's memory may go
    hung += trial.wait([sender], 15)
    rank_result, producer_result = trial.result("rank0"), trial.result("p0")
    failures = producer_result.get("failures", {})
    messages = producer_result.get("messages", {})
    errors = [f"{kind}: {message}" for kind, message in messages.items()]
    errors += [e for e in (rank_result.get("error"), producer_result.get("error")) if e]
    how = "silently" if silent else "loudly"
    detail = (
        f"producer {producer} cut {how} from the Mooncake master for "
        f"{healed_at - cut_at:.1f} s with {emitted_at_cut} of {samples} emitted; "
        f"{emitted_in_cut} emitted during the cut; failed emits retried: {failures or 'none'}; "
        f"rank exit {rank.returncode}, producer exit {sender.returncode}"
        + "".join(f"; {h}" for h in hung)
    )
    return trial.outcome(
        recovery_s=None if back is None else back - healed_at,
        detail=detail,
        errors=errors,
        store_uri=f"{uri}&segment_size=0",
        facts={
            "failures": failures,
            "messages": messages,
            "emitted_in_cut": emitted_in_cut,
            "exits": [rank.returncode, sender.returncode],
            "errors": [rank_result.get("error"), producer_result.get("error")],
            "hung": hung,
        },
    )


def _first_emit_after(trial: Trial, name: str, since: float) -> float | None:
    path = trial.dir / f"{name}.progress"
    times = [float(line.split()[1]) for line in path.read_text().splitlines() if line.strip()]
    later = [t for t in times if t > since]
    return min(later) if later else None


def latency_run(
    cluster: Cluster,
    *,
    delay_s: float = 0.1,
    jitter_s: float = 0.02,
    faults: int = 6,
    samples: int = 16,
    seed: int = 0,
    producer: str = "producer0",
    ranks: tuple[str, str] = ("trainer0", "trainer1"),
    pg_host: str = "pg",
    master_host: str | None = None,
    timeout_s: float = 55.0,
) -> NetFaultOutcome:
    """A whole run with ``delay_s`` (+/- ``jitter_s``) one way on every relayed link, and
    ``faults`` stalls (0.2-1 s) and resets of a random relay at seeded random moments.

    One producer on ``producer`` streams with CURVE to two gloo ranks on ``ranks``
    (their gloo links direct); each of the three reaches PostgreSQL on ``pg_host``
    through a relay of its own (``busy_timeout`` 4 s), and the producer each rank
    through another. With ``master_host``, the store is Mooncake, its master on that
    host, reached through relays of its RPC and metadata ports (the producer mounts
    the memory; the ranks read from it directly); else a shared directory. Every
    component retries a ledger call that fails with an
    ``OperationalError`` (a reset) and an emit, same id; the ledger settles whether a
    call whose reply was lost landed.
    """
    began = time.monotonic()
    server = cluster.start_postgres(pg_host)
    relays: list[Relay] = []
    try:
        database = f"nf{uuid.uuid4().hex[:8]}"
        _create_database(cluster, server, database)

        def ledger_via_relay() -> str:
            relay = cluster.relay(pg_host, server.port, delay_s=delay_s, jitter_s=jitter_s,
                                  seed=seed + len(relays))  # fmt: skip
            relays.append(relay)
            return f"postgresql+psycopg://postgres@{relay.address}/{database}"

        trial = Trial(cluster, "latency", ledger_url=_direct(cluster, server, database))
        trial.phases["postgres"] = round(time.monotonic() - began, 2)
        master = direct_store = None
        if master_host is not None:
            master = cluster.start_mooncake_master(master_host)
            relayed = [
                cluster.relay(
                    master_host, port, delay_s=delay_s, jitter_s=jitter_s, seed=seed + 200 + i
                )
                for i, port in enumerate((master.rpc_port, master.http_port))
            ]
            relays += relayed
            namespace = f"nf-{uuid.uuid4().hex[:8]}"
            trial.store_uri = _relayed_store_uri(master, *relayed, namespace)
            # The checks afterwards open the same store at the master's own address.
            direct_store = f"{master.store_uri(namespace=namespace)}&segment_size=0"
            trial.phase("mooncake master")
        try:
            return _latency_run(
                trial, ledger_via_relay, relays, delay_s, jitter_s, faults, samples, seed,
                producer, ranks, timeout_s, direct_store,
            )  # fmt: skip
        finally:
            trial.stop()
            if master is not None:
                master.stop()
    finally:
        for relay in relays:
            relay.close()
        server.close()


def _relayed_store_uri(master: Any, rpc: Relay, metadata: Relay, namespace: str) -> str:
    """The master's store URI with its RPC and metadata ports behind ``rpc`` and
    ``metadata`` (its HTTP listing, for ``gc``, direct)."""
    query = urllib.parse.urlencode(
        {
            "metadata": f"http://{metadata.address}/metadata",
            "protocol": "tcp",
            "namespace": namespace,
            "admin": master.admin_address,
        },
        quote_via=urllib.parse.quote,
        safe="",
    )
    return f"mooncake://{rpc.address}?{query}"


def _direct(cluster: Cluster, server: Any, database: str) -> str:
    return cluster.postgres_url(server, database)


def _create_database(cluster: Cluster, server: Any, database: str) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(cluster.postgres_url(server), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text(f'CREATE DATABASE "{database}"'))
    finally:
        engine.dispose()


def _latency_run(
    trial: Trial,
    ledger_via_relay: Any,
    relays: list[Relay],
    delay_s: float,
    jitter_s: float,
    faults: int,
    samples: int,
    seed: int,
    producer: str,
    ranks: tuple[str, str],
    timeout_s: float,
    direct_store: str | None,
) -> NetFaultOutcome:
    cluster = trial.cluster
    mooncake = direct_store is not None
    # On Mooncake the producer lends the memory the samples are put into; the ranks none.
    producer_store = f"{trial.store_uri}&segment_size=32M" if mooncake else trial.store_uri
    rank_store = f"{trial.store_uri}&segment_size=0" if mooncake else trial.store_uri
    hold = trial.dir / "release"
    Ledger.open(trial.ledger_url).close()  # its tables made once, before three clients race
    server_curve, client_curve = curve_keys(trial.dir)
    common = {"busy_timeout": 4.0, "retry_s": 30.0}
    port = random.Random(seed).randrange(30000, 40000)
    # Each rank's receiver binds a port known beforehand (its host's own namespace has it
    # free), so the relays to it exist before it starts, and the producer starts with the
    # ranks (it imports torch meanwhile) and connects once their receivers are up.
    stream_port = port + 1
    names = ["rank0", "rank1"]
    endpoints = []
    for host in ranks:
        relay = cluster.relay(host, stream_port, delay_s=delay_s, jitter_s=jitter_s,
                              seed=seed + 100 + len(relays))  # fmt: skip
        relays.append(relay)
        endpoints.append(f"tcp://{relay.address}")
    processes: list[subprocess.Popen[Any]] = []
    for r, host in enumerate(ranks):
        processes.append(
            trial.start(
                host,
                RANK_MODULE,
                trial.config(
                    names[r],
                    **common,
                    ledger_url=ledger_via_relay(),
                    rank=r,
                    world_size=2,
                    consumer_id=names[r],
                    batch=4,
                    store_uri=rank_store,
                    gloo={
                        "address": cluster[ranks[0]].address,
                        "port": port,
                        "interface": cluster[host].interface,
                        "timeout_s": 30.0,
                    },
                    stream={
                        "endpoint": f"tcp://{cluster[host].address}:{stream_port}",
                        "endpoint_file": str(trial.dir / f"{names[r]}.endpoint"),
                        "curve": server_curve,
                        **HEARTBEATS,
                    },
                ),
            )
        )
    processes.append(
        trial.start(
            producer,
            PRODUCER_MODULE,
            trial.config(
                "p0",
                **common,
                ledger_url=ledger_via_relay(),
                producer_id="p0",
                samples=samples,
                batch=4,
                interval_s=0.0,
                after=[str(trial.dir / f"{name}.endpoint") for name in names],
                store_uri=producer_store,
                hold=str(hold),
                hold_s=timeout_s,
                stream={
                    "endpoints": endpoints,
                    "curve": client_curve,
                    "send_timeout": 1.0,
                    "close_timeout": 2.0,
                    **HEARTBEATS,
                },
            ),
        )
    )
    for name in names:
        trial.wait_for(f"{name}'s receiver", (trial.dir / f"{name}.endpoint").exists, 60)
    trial.phase("ranks up")
    # The faults come once the run is under way (every component joined, one commit in).
    trial.wait_for("the first commit", lambda: trial.emitted("p0") >= 1, 60)
    trial.phase("producer up")
    started = time.monotonic()
    injected: list[str] = []
    stop = threading.Event()
    chaos = threading.Thread(
        target=_stalls_and_resets, args=(relays, faults, seed, stop, injected), daemon=True
    )
    chaos.start()
    hung = trial.wait(processes[:2], timeout_s)
    trial.phase("training")
    hold.touch()  # the ranks read everything: the producer's memory may go
    hung += trial.wait(processes[2:], 15)
    trial.phase("producer exit")
    stop.set()
    chaos.join(5)
    for relay in relays:
        relay.resume()
    wall_s = time.monotonic() - started
    results = {name: trial.result(name) for name in [*names, "p0"]}
    failures = dict(results["p0"].get("failures", {}))
    for result in results.values():
        for kind, count in result.get("retried", {}).items():
            failures[kind] = failures.get(kind, 0) + count
    errors = [f"{kind}: {m}" for kind, m in results["p0"].get("messages", {}).items()]
    errors += [r["error"] for r in results.values() if r.get("error")]
    detail = (
        f"{delay_s * 1000:.0f} ms +/- {jitter_s * 1000:.0f} ms one way on {len(relays)} relays "
        f"(3 to PostgreSQL, 2 streams{', 2 to the Mooncake master' if mooncake else ''}; "
        f"gloo direct); faults: {', '.join(injected) or 'none'}; "
        f"ledger calls and emits retried: {failures or 'none'}; run took {wall_s:.1f} s; "
        f"exits {[p.returncode for p in processes]}" + "".join(f"; {h}" for h in hung)
    )
    return trial.outcome(
        recovery_s=None,
        detail=detail,
        errors=errors,
        # The checks open the store here, past the relays (their run is over): a Mooncake
        # client holds the interpreter's lock in its calls, and would stop a relay of this
        # process that it talked through.
        store_uri=direct_store or rank_store,
        facts={
            "exits": [p.returncode for p in processes],
            "injected": injected,
            "failures": failures,
            "wall_s": wall_s,
            "hung": hung,
        },
    )


def _stalls_and_resets(
    relays: list[Relay], faults: int, seed: int, stop: threading.Event, injected: list[str]
) -> None:
    """``faults`` stalls or resets of random relays, 0.3-1.5 s apart (seeded)."""
    rng = random.Random(seed)
    for _ in range(faults):
        if stop.wait(rng.uniform(0.3, 1.5)):
            return
        index = rng.randrange(len(relays))
        relay = relays[index]
        if rng.random() < 0.5:
            stall_s = rng.uniform(0.2, 1.0)
            relay.stall()
            stopped = stop.wait(stall_s)
            relay.resume()
            injected.append(f"stall of relay {index} for {stall_s:.1f} s")
            if stopped:
                return
        else:
            relay.reset()
            injected.append(f"reset of relay {index}")
