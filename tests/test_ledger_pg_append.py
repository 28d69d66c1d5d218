"""PostgreSQL's append functions (recorder/_pg_append.py): what a commit sends the server,
and a ledger made before them.

The statements are counted from libpq's own trace of the connection (every message
the client sends), so a change that adds a round trip to a producer's commit fails
here, not only in a benchmark.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy
from psycopg import pq
from sqlalchemy import event

from dataflow import Consumer, Kind, Ledger, Producer, ProducerFencedError, replay
from dataflow.model import SampleRef
from stores import LocalFeatureStore

pytestmark = pytest.mark.postgres


@pytest.fixture
def traced(postgres_url: str) -> Iterator[tuple[Ledger, Callable[[Callable[[], object]], list]]]:
    """A ledger whose connections libpq traces, and a function that runs a call and returns
    the messages the client sent meanwhile, as (message type, its text)."""
    ledger = Ledger.open(postgres_url)
    trace = tempfile.NamedTemporaryFile("w+", delete=False)  # noqa: SIM115 (closed below)

    @event.listens_for(ledger._engine, "connect")
    def on_connect(dbapi_conn: object, record: object) -> None:
        dbapi_conn.pgconn.trace(trace.fileno())  # type: ignore[attr-defined]
        dbapi_conn.pgconn.set_trace_flags(  # type: ignore[attr-defined]
            pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE
        )

    ledger._engine.dispose()

    def sent(call: Callable[[], object]) -> list[tuple[str, str]]:
        trace.flush()
        start = os.path.getsize(trace.name)
        call()
        trace.flush()
        with open(trace.name) as f:
            f.seek(start)
            lines = [line.split("\t") for line in f.read().splitlines()]
        # "F", the message's length, its type, its text
        return [(fields[2], "\t".join(fields[3:])) for fields in lines if fields[0] == "F"]

    try:
        yield ledger, sent
    finally:
        ledger.close()
        trace.close()
        os.unlink(trace.name)


def _refs(store: LocalFeatureStore, prefix: str, n: int) -> list[SampleRef]:
    return [SampleRef(f"{prefix}{i}", store.open_uri, 1) for i in range(n)]


def _round_trips(messages: list[tuple[str, str]]) -> int:
    """Messages the client waits on: a simple query, or a Sync ending an extended one."""
    return sum(kind in ("Query", "Sync") for kind, _ in messages)


def test_a_producers_commit_is_one_statement_between_begin_and_commit(traced) -> None:
    ledger, sent = traced
    with LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id="r", producer_id="p")
        producer.commit(_refs(store, "warm", 4))  # the pool's connection, made and traced
        messages = sent(lambda: producer.commit(_refs(store, "s", 64)))
    parsed = [text for kind, text in messages if kind == "Parse"]
    queries = [text for kind, text in messages if kind == "Query"]
    assert len(parsed) == 1 and "dataflow_commit_v1" in parsed[0], parsed
    assert [q.strip(' "') for q in queries if "BEGIN" in q or "COMMIT" in q] == [
        "BEGIN",
        "COMMIT",
    ]
    # The pool's ping, BEGIN, the call, COMMIT (it was 7: the lock, the producer's epoch,
    # the insert and the check for seqs above it, each a round trip of its own).
    assert _round_trips(messages) <= 4
    assert sorted(ledger.commits("r", [f"s{i}" for i in range(64)])) == sorted(
        f"s{i}" for i in range(64)
    )


def test_a_consumer_write_takes_its_lock_in_one_statement(traced) -> None:
    ledger, sent = traced
    with LocalFeatureStore() as store:
        Producer(ledger, store, run_id="r", producer_id="p").commit(_refs(store, "s", 8))
        consumer = Consumer(ledger, store, run_id="r", consumer_id="c")
        consumer.resume()
        messages = sent(lambda: consumer.lease(8))
    locks = [text for kind, text in messages if kind == "Parse" and "advisory" in text]
    calls = [text for kind, text in messages if kind == "Parse" and "dataflow_lock_run_v1" in text]
    assert locks == [] and len(calls) == 1, messages


def _drop_functions(url: str) -> None:
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP FUNCTION dataflow_commit_v1")
            conn.exec_driver_sql("DROP FUNCTION dataflow_lock_run_v1")
    finally:
        engine.dispose()


def test_a_ledger_without_the_functions_opened_without_create_is_written_by_statements(
    postgres_url: str,
) -> None:
    """A ledger that an older dataflow made, opened with create=False (which changes no
    schema): producers, fencing and consumers work as before, a statement at a time."""
    Ledger.open(postgres_url).close()
    _drop_functions(postgres_url)
    with Ledger.open(postgres_url, create=False) as ledger, LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id="r", producer_id="p")
        assert all(producer.commit(_refs(store, "s", 16)))
        assert producer.commit(_refs(store, "s", 2)) == [None, None]  # dedup
        consumer = Consumer(ledger, store, run_id="r", consumer_id="c")
        consumer.resume()
        refs = consumer.lease(16)
        consumer.ack(refs, step=1)
        Producer(ledger, store, run_id="r", producer_id="p")  # claims epoch 2
        with pytest.raises(ProducerFencedError):
            producer.commit(_refs(store, "late", 1))
        state = replay(ledger, "r")
        assert state.verify() == [] and len(state.trained) == 16
    with Ledger.open(postgres_url) as ledger:  # a writer that may create makes them
        with ledger.write("r", "close", shared=True) as tx:
            tx.append_first_commits("p2", {"new": json.dumps({"sample_id": "new"})})
        assert "new" in ledger.commits("r", ["new"])


def test_a_fenced_producers_commit_writes_nothing_and_says_which_epoch_holds_the_id(
    postgres_url: str,
) -> None:
    with Ledger.open(postgres_url) as ledger, LocalFeatureStore() as store:
        old = Producer(ledger, store, run_id="r", producer_id="p")
        Producer(ledger, store, run_id="r", producer_id="p")
        with pytest.raises(ProducerFencedError, match="held by epoch 2"):
            old.commit(_refs(store, "s", 4))
        assert ledger.commits("r", [f"s{i}" for i in range(4)]) == {}
        kinds = collections.Counter(e.kind for e in ledger.events("r"))
        assert kinds == {Kind.CLAIM: 2}


def test_a_run_whose_row_was_deleted_keeps_its_epoch_on_the_next_commit(
    postgres_url: str,
) -> None:
    with Ledger.open(postgres_url) as ledger, LocalFeatureStore() as store:
        consumer = Consumer(ledger, store, run_id="r", consumer_id="c")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "no events yet"
            consumer.resume()
            consumer.resume()  # epoch 2
        engine = sqlalchemy.create_engine(postgres_url)
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql("DELETE FROM dataflow_runs")
        finally:
            engine.dispose()
        Producer(ledger, store, run_id="r", producer_id="p").commit(_refs(store, "s", 2))
        assert ledger.runs() == ["r"] and ledger.unlisted_runs() == []
        assert len(consumer.lease(2)) == 2  # epoch 2 still: the consumer is not fenced off


def test_commits_keep_their_ids_payloads_and_order_through_the_function(
    postgres_url: str,
) -> None:
    """The call sends ids and payloads as binary arrays: any text comes back as it went,
    each seq in the given order, and an id given again is skipped as before."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ids = st.text("AZaz09._:/-", min_size=1, max_size=12).filter(
        lambda s: ".." not in s and not s.startswith("/")
    )
    texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))

    with Ledger.open(postgres_url) as ledger:

        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
        @given(payloads=st.dictionaries(ids, texts, min_size=1, max_size=20), data=st.data())
        def run_one(payloads: dict[str, str], data: st.DataObject) -> None:
            run = f"r-{os.urandom(4).hex()}"
            held = data.draw(st.lists(st.sampled_from(sorted(payloads)), unique=True))
            with ledger.write(run, "commit", shared=True) as tx:
                tx.append_first_commits("p", {sid: payloads[sid] for sid in held})
            with ledger.write(run, "commit", shared=True) as tx:
                known = tx.append_first_commits("p", payloads)
            assert known == {sid: (0, payloads[sid]) for sid in held}
            fresh = [sid for sid in payloads if sid not in held]
            events = [e for e in ledger.rows(run)]
            assert [row[2] for row in events] == held + fresh  # seqs in the given order
            assert ledger.commits(run, list(payloads)) == {
                sid: (0, text) for sid, text in payloads.items()
            }

        run_one()


def test_a_fenced_producer_is_told_even_when_its_emit_has_nothing_new_to_commit(
    postgres_url: str,
) -> None:
    """Its producer check waits for the lock's statement: a commit with nothing to
    append still makes it (an emit of samples the ledger holds commits no row)."""
    with Ledger.open(postgres_url) as ledger, LocalFeatureStore() as store:
        old = Producer(ledger, store, run_id="r", producer_id="p")
        refs = _refs(store, "s", 2)
        assert old.commit(refs) == refs
        Producer(ledger, store, run_id="r", producer_id="p")  # claims epoch 2
        with pytest.raises(ProducerFencedError, match="held by epoch 2"):
            old.commit([])
        with ledger.write("r", "commit", shared=True) as tx:
            tx.check_producer("p", 1)
            with pytest.raises(ProducerFencedError):
                tx.append([])
