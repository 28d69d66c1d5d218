"""Many writers on one ledger: producers in four processes, and a follower that must
never miss an event, on SQLite and PostgreSQL."""

import json
import threading
import time
import traceback
import uuid
from pathlib import Path

import pytest
import sqlalchemy
import torch
from _gloo import forkserver_context
from _threads import errors_of_threads

from dataflow import Event, Kind, Ledger, OperationalError, Producer
from dataflow.recorder._ledger import NewEvent
from dataflow.recorder._schema import SCHEMA_VERSION
from dataflow.testing._postgres import create_database, drop_database
from stores import LocalFeatureStore

pytestmark = pytest.mark.slow

PROCESSES = 4
SAMPLES = 60
RACED = "raced"


def features(sample_id: str) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor(list(sample_id.encode()), dtype=torch.uint8)}


class RendezvousStore(LocalFeatureStore):
    """A process's own store that holds the put of one id until every process put it.

    So every process has passed the producer's "already committed?" check for
    that id before any of them commits it: a race each time, not by chance.
    """

    def __init__(self, barrier, sample_id: str) -> None:
        super().__init__()
        self._barrier = barrier
        self._sample_id = sample_id

    def _put(self, sample_id, tensors, metadata):
        ref = super()._put(sample_id, tensors, metadata)
        if sample_id == self._sample_id:
            self._barrier.wait(timeout=120)
        return ref


def produce(url: str, index: int, plans: dict[str, list[str]], barrier, out: str) -> None:
    """One producer process: per run, emit its ids with a store of its own.

    Writes to ``out``, per run, what it committed, whether those features read
    back, how many objects its store holds, and the error if one was raised.
    """
    reports = {}
    with Ledger.open(url) as ledger:
        for run_id, sample_ids in plans.items():
            report: dict = {"committed": [], "error": None}
            try:
                with RendezvousStore(barrier, RACED) as store:
                    producer = Producer(ledger, store, run_id=run_id, producer_id=f"p{index}")
                    barrier.wait(timeout=120)
                    refs = [producer.emit(sid, features(sid)) for sid in sample_ids]
                    producer.close()
                    mine = [ref for ref in refs if ref is not None]
                    report["committed"] = [ref.sample_id for ref in mine]
                    report["readable"] = all(
                        store.get(ref)["x"].numpy().tobytes() == ref.sample_id.encode()
                        for ref in mine
                    )
                    report["objects"] = store.stats().objects
            except Exception:
                report["error"] = traceback.format_exc()
                barrier.abort()  # do not leave the others waiting for this one
            reports[run_id] = report
    Path(out).write_text(json.dumps(reports))


class Follower(threading.Thread):
    """Follows a run from its start until an event by ``until_actor`` shows up."""

    def __init__(self, url: str, run_id: str, until_actor: str = "sentinel") -> None:
        super().__init__(daemon=True)
        self.url, self.run_id, self.until_actor = url, run_id, until_actor
        self.seen: list[Event] = []

    def run(self) -> None:
        with Ledger.open(self.url) as ledger:
            for event in ledger.follow(self.run_id, timeout=120):
                self.seen.append(event)
                if event.actor == self.until_actor:
                    return

    def stop_and_join(self, ledger: Ledger) -> None:
        with ledger.write(self.run_id, "sentinel") as tx:
            tx.append([NewEvent(Kind.CLOSE, self.until_actor)])
        self.join(timeout=150)
        assert not self.is_alive()


def run_plans() -> dict[str, list[list[str]]]:
    """Per run, per process, the ids it emits in its order: disjoint, or all the same ids
    in rotated orders, after one id that all of them race for."""
    shared = [f"s{j:03d}" for j in range(SAMPLES)]
    return {
        "disjoint": [
            [f"p{i}-{j:03d}" for j in range(SAMPLES // PROCESSES)] for i in range(PROCESSES)
        ],
        "overlapping": [[RACED, *shared[i * 7 :], *shared[: i * 7]] for i in range(PROCESSES)],
    }


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def producer_runs(request, tmp_path_factory):
    """Four producer processes write both runs of ``run_plans`` into one ledger,
    while a follower thread per run tails it. Yields (ledger, reports, followers, exit codes)."""
    tmp = tmp_path_factory.mktemp("producers")
    if request.param == "sqlite":
        url, drop = f"sqlite:///{tmp}/ledger.db", None
    else:
        server = request.getfixturevalue("postgres_server")
        name = f"dataflow_test_{uuid.uuid4().hex[:16]}"
        url, drop = create_database(server, name), lambda: drop_database(server, name)
    ledger = Ledger.open(url)
    plans = run_plans()
    followers = {run_id: Follower(url, run_id) for run_id in plans}
    for follower in followers.values():
        follower.start()
    context = forkserver_context(__name__)
    barrier = context.Barrier(PROCESSES)
    outs = [tmp / f"producer-{i}.json" for i in range(PROCESSES)]
    processes = [
        context.Process(
            target=produce,
            args=(url, i, {run_id: ids[i] for run_id, ids in plans.items()}, barrier, str(out)),
        )
        for i, out in enumerate(outs)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    for process in processes:
        if process.is_alive():
            process.kill()
    for follower in followers.values():
        follower.stop_and_join(ledger)
    exit_codes = [p.exitcode for p in processes]
    reports = [json.loads(out.read_text()) for out in outs if out.exists()]
    yield ledger, reports, followers, exit_codes
    ledger.close()
    if drop is not None:
        drop()


def check_each_id_committed_once(producer_runs, run_id: str) -> None:
    ledger, reports, _followers, exit_codes = producer_runs
    assert exit_codes == [0] * PROCESSES
    assert [r[run_id]["error"] for r in reports] == [None] * PROCESSES
    expected = sorted({sid for ids in run_plans()[run_id] for sid in ids})
    committed_by = [sid for r in reports for sid in r[run_id]["committed"]]
    assert sorted(committed_by) == expected  # each id committed by exactly one process
    commits = [e.sample_id for e in ledger.events(run_id) if e.kind == Kind.COMMIT]
    assert sorted(commits) == expected
    # each process holds the features of what it committed, and nothing else
    assert [r[run_id]["readable"] for r in reports] == [True] * PROCESSES
    assert [r[run_id]["objects"] for r in reports] == [len(r[run_id]["committed"]) for r in reports]


def test_producer_processes_with_disjoint_ids_commit_everything_once(producer_runs):
    check_each_id_committed_once(producer_runs, "disjoint")


def test_producer_processes_racing_for_the_same_ids_commit_each_once(producer_runs):
    check_each_id_committed_once(producer_runs, "overlapping")


@pytest.mark.parametrize("run_id", ["disjoint", "overlapping"])
def test_a_follower_sees_every_event_once_and_in_order(producer_runs, run_id):
    ledger, _reports, followers, _exit_codes = producer_runs
    everything = list(ledger.events(run_id))
    seen = followers[run_id].seen
    assert [e.seq for e in seen] == [e.seq for e in everything]
    assert seen == everything
    assert [e.actor for e in everything].count("sentinel") == 1


def hold(ledger, run_id, actor, inserted, order) -> None:
    """Append an event, then keep the transaction open a while before committing."""
    with ledger.write(run_id, "hold") as tx:
        tx.append([NewEvent(Kind.CLOSE, actor)])
        inserted.set()
        time.sleep(0.3)  # widen the window in which another writer could commit first
        order.append("holder")


def write_after(ledger, run_id, actor, inserted, order) -> None:
    """Append an event once ``hold`` has inserted its own."""
    assert inserted.wait(timeout=60)
    with ledger.write(run_id, "write") as tx:
        tx.append([NewEvent(Kind.CLOSE, actor)])
        order.append("writer")


def test_a_follower_never_skips_an_event_held_back_by_an_open_transaction(ledger_url):
    """Seq values are taken at insert time: a writer that inserts after another one but
    commits first must not let a follower move past the earlier, still open, event."""
    run_id = "held"
    ledger = Ledger.open(ledger_url)
    follower = Follower(ledger_url, run_id)
    follower.start()
    order: list[str] = []

    for round_ in range(3):
        inserted = threading.Event()
        threads = [
            threading.Thread(
                target=hold, args=(ledger, run_id, f"holder-{round_}", inserted, order)
            ),
            threading.Thread(
                target=write_after, args=(ledger, run_id, f"writer-{round_}", inserted, order)
            ),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    follower.stop_and_join(ledger)

    everything = list(ledger.events(run_id))
    assert [e.seq for e in follower.seen] == [e.seq for e in everything]
    assert order == ["holder", "writer"] * 3  # the second writer waited for the first
    assert [e.actor for e in everything][:-1] == [
        f"{who}-{r}" for r in range(3) for who in ("holder", "writer")
    ]
    ledger.close()


def test_a_writer_gives_up_after_the_busy_timeout(ledger_url, request):
    """Ledger.open documents that busy_timeout bounds the wait for a run's write lock."""
    holder, waiter = Ledger.open(ledger_url), Ledger.open(ledger_url, busy_timeout=0.5)
    inserted, done = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.write("locked", "hold") as tx:
            tx.append([NewEvent(Kind.CLOSE, "holder")])
            inserted.set()
            done.wait(timeout=3)  # hold the lock until the waiter gave up, or for 3 s

    thread = threading.Thread(target=hold)
    thread.start()
    assert inserted.wait(timeout=60)
    try:
        with (
            pytest.raises(OperationalError, match=r"held the ledger's write lock.*busy_timeout"),
            waiter.write("locked", "wait") as tx,
        ):
            tx.append([NewEvent(Kind.CLOSE, "waiter")])
    finally:
        done.set()
        thread.join(timeout=60)
    assert [e.actor for e in waiter.events("locked")] == ["holder"]
    holder.close()
    waiter.close()


def test_concurrent_first_opens_create_the_schema_once(ledger_url):
    assert errors_of_threads(lambda: Ledger.open(ledger_url).close(), 6) == []
    engine = sqlalchemy.create_engine(ledger_url)
    with engine.connect() as conn:
        rows = conn.execute(sqlalchemy.text("SELECT version FROM dataflow_schema")).all()
    engine.dispose()
    assert rows == [(SCHEMA_VERSION,)]
