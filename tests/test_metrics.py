"""Prometheus metrics of a run: real runs on real ledgers, scraped over real HTTP (urllib)."""

from __future__ import annotations

import collections
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest
import torch
from _gloo import forkserver_context
from _paths import ckpt, in_tmp_path  # noqa: F401 - in_tmp_path is an autouse fixture
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dataflow import (
    ArgumentTypeError,
    Consumer,
    InvalidArgumentError,
    Kind,
    Ledger,
    Producer,
    RunMetrics,
    replay,
    serve_metrics,
)
from stores import LocalFeatureStore, SharedDirFeatureStore, open_store

RUN = "run"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def ledger_kinds(led: Ledger) -> collections.Counter[str]:
    """Events by kind, a batch row once for each sample it names (as the metric counts)."""
    return collections.Counter(e.kind for e in led.events(RUN) for _ in e.sample_ids or [e])


def features(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.zeros(i + 1, dtype=torch.float32), "y": torch.zeros(2, dtype=torch.int64)}


def test_a_scrape_reports_the_ledger_s_counts_and_the_fold_s_gauges(ledger, store) -> None:
    prod = Producer(ledger, store, run_id=RUN)
    for i in range(12):
        prod.emit(f"s{i:02d}", features(i))
    cons = Consumer(ledger, store, run_id=RUN, consumer_id="trainer", max_attempts=1)
    cons.resume()
    metrics = RunMetrics(ledger, RUN, store=store)
    with serve_metrics(0, metrics) as server:
        first = scrape(server.url)
        cons.ack(cons.lease(3), step=1)
        cons.checkpoint(step=1, path=ckpt(1))  # releases the 3
        refs = cons.lease(5)
        cons.nack(refs[:1])  # max_attempts=1: dead
        cons.nack(refs[1:2], retryable=False)  # dead
        cons.lost(refs[2:3], reason="file deleted")
        held = refs[3:]  # leased, not acked: in flight
        samples = scrape(server.url)

    state = replay(ledger, RUN)
    kinds = ledger_kinds(ledger)
    assert kinds[Kind.NACK] == 2 and kinds[Kind.LOST] == 1 and kinds[Kind.RELEASE] == 3
    for kind in Kind.ALL:
        assert value(samples, "dataflow_events_total", run=RUN, kind=kind) == kinds[kind], kind
    assert value(first, "dataflow_events_total", run=RUN, kind="commit") == 12
    assert value(first, "dataflow_events_total", run=RUN, kind="ack") == 0
    assert value(samples, "dataflow_dead_samples_total", run=RUN) == len(state.dead) == 2
    assert value(samples, "dataflow_inflight_refs", run=RUN) == len(state.leased) == 2
    assert value(samples, "dataflow_inflight_bytes", run=RUN) == sum(r.nbytes for r in held)
    assert value(samples, "dataflow_pending_refs", run=RUN) == len(state.pending) == 4
    backlog = [s for s in state.committed if s in state.leased or state.is_pending(s)]
    assert value(samples, "dataflow_backlog_refs", run=RUN) == len(backlog) == 6
    assert value(samples, "dataflow_backlog_bytes", run=RUN) == sum(
        state.ref(s).nbytes for s in backlog
    )
    assert value(samples, "dataflow_lag_refs", run=RUN) == 12 - 3 - 2 == 7  # the lost one too
    stats = store.stats()
    assert value(samples, "dataflow_store_bytes", store=store.uri) == stats.bytes
    # 12 put, less 3 released at the checkpoint and 1 lost (what was left of it is deleted)
    assert value(samples, "dataflow_store_objects", store=store.uri) == stats.objects == 8


def test_the_append_histogram_counts_this_process_s_transactions(sqlite_url) -> None:
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    prod = Producer(led, store, run_id=RUN, metrics_port=0)
    try:
        prod.emit("a", features(0))
        before = scrape(prod.metrics.url)
        assert value(before, "dataflow_append_seconds_count", run=RUN, op="commit") == 1
        prod.emit_many([("b", features(1)), ("c", features(2))])  # one transaction
        prod.emit("d", features(3))
        after = scrape(prod.metrics.url)
        assert value(after, "dataflow_append_seconds_count", run=RUN, op="commit") == 3
        assert value(after, "dataflow_append_seconds_sum", run=RUN, op="commit") > 0
        assert value(after, "dataflow_append_seconds_bucket", run=RUN, op="commit", le="+Inf") == 3
        assert value(after, "dataflow_events_total", run=RUN, kind="commit") == 4
    finally:
        prod.close()


def test_the_endpoint_binds_to_loopback_unless_told_otherwise(sqlite_url) -> None:
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    prod = Producer(led, store, run_id=RUN, metrics_port=0)
    cons = Consumer(led, store, run_id=RUN, consumer_id="trainer", metrics_port=0)
    wide = Consumer(
        led, store, run_id=RUN, consumer_id="t2", metrics_port=0, metrics_host="0.0.0.0"
    )
    try:
        for server in (prod.metrics, cons.metrics):
            assert server._httpd.socket.getsockname()[0] == server.host == "127.0.0.1"
            assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        assert wide.metrics._httpd.socket.getsockname()[0] == "0.0.0.0"
        # Three servers in one process, each with its own registry: no clash of names.
        ports = {prod.metrics.port, cons.metrics.port, wide.metrics.port}
        assert len(ports) == 3
        for port in ports:
            url = f"http://127.0.0.1:{port}/metrics"
            assert value(scrape(url), "dataflow_events_total", run=RUN, kind="commit") == 0
    finally:
        prod.close()
        cons.metrics.close()
        wide.metrics.close()
    assert Consumer(led, store, run_id=RUN, consumer_id="t3").metrics is None


def test_close_stops_serving_and_frees_the_port(sqlite_url) -> None:
    led = Ledger.open(sqlite_url)
    server = serve_metrics(0, RunMetrics(led, RUN))
    url, port = server.url, server.port
    scrape(url)
    server.close()
    server.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)
    with socket.socket() as s:  # nobody listens on the port (TIME_WAIT aside)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("port", "error", "says"),
    [
        (-1, ValueError, "must be from 0 to 65535 (0: any free port), got -1"),
        (65536, ValueError, "got 65536"),
        ("9100", TypeError, "must be an int (0 to 65535), got str '9100'"),
        (9100.0, TypeError, "got float 9100.0"),
        (True, TypeError, "got bool True"),
    ],
)
def test_bad_ports_are_refused_naming_the_value(sqlite_url, port, error, says) -> None:
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    with pytest.raises(error) as info:
        serve_metrics(port, RunMetrics(led, RUN))
    assert says in str(info.value) and str(info.value).startswith("port ")
    with pytest.raises(error) as info:
        Producer(led, store, run_id=RUN, metrics_port=port)
    assert says in str(info.value) and str(info.value).startswith("metrics_port ")


def test_a_port_in_use_and_bad_hosts_are_refused_clearly(sqlite_url) -> None:
    led, store = Ledger.open(sqlite_url), LocalFeatureStore()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}.*free port"):
            Consumer(led, store, run_id=RUN, consumer_id="t", metrics_port=port)
    for host in ("", " 127.0.0.1", None, 127):
        with pytest.raises(ValueError, match="host must be an address or host name"):
            serve_metrics(0, host=host)
    with pytest.raises(
        ValueError, match=r"metrics_host='0\.0\.0\.0' was given without metrics_port"
    ):
        Producer(led, store, run_id=RUN, metrics_host="0.0.0.0")


def test_one_run_per_registry_and_a_user_registry_is_served(sqlite_url) -> None:
    led = Ledger.open(sqlite_url)
    registry = CollectorRegistry()
    RunMetrics(led, RUN, registry=registry)
    with pytest.raises(InvalidArgumentError, match=r"Duplicated.*one run per registry"):
        RunMetrics(led, "other", registry=registry)
    with serve_metrics(0, registry=registry) as server:
        assert ("dataflow_lag_refs", (("run", RUN),)) in scrape(server.url)


def produce(url: str, store_dir: str, count: int) -> None:
    """A producer process: commit ``count`` samples and close."""
    with Ledger.open(url) as led:
        prod = Producer(led, SharedDirFeatureStore(store_dir), run_id=RUN)
        for i in range(count):
            prod.emit(f"p{i:02d}", features(i))
        prod.close()


def test_a_sidecar_counts_what_other_processes_wrote_folding_only_new_events(
    sqlite_url, tmp_path
) -> None:
    store_dir = str(tmp_path / "features")
    led = Ledger.open(sqlite_url)
    store = SharedDirFeatureStore(store_dir)
    metrics = RunMetrics(led, RUN, store=store)
    with serve_metrics(0, metrics) as server:
        assert value(scrape(server.url), "dataflow_lag_refs", run=RUN) == 0
        process = forkserver_context(__name__).Process(
            target=produce, args=(sqlite_url, store_dir, 10)
        )
        process.start()
        process.join(120)
        assert process.exitcode == 0
        samples = scrape(server.url)
        assert value(samples, "dataflow_events_total", run=RUN, kind="commit") == 10
        assert value(samples, "dataflow_events_total", run=RUN, kind="close") == 1
        assert value(samples, "dataflow_lag_refs", run=RUN) == 10
        assert value(samples, "dataflow_store_objects", store=store.uri) == 10
        # Appends of another process are not timed here.
        assert not any(name.startswith("dataflow_append_seconds_count") for name, _ in samples)
        cons = Consumer(led, store, run_id=RUN, consumer_id="trainer")
        cons.resume()
        cons.ack(cons.lease(4), step=1)
        seen = metrics._backlog.state.head_seq
        samples = scrape(server.url)
        assert value(samples, "dataflow_events_total", run=RUN, kind="ack") == 4
        assert value(samples, "dataflow_lag_refs", run=RUN) == 6
        assert metrics._backlog.state.head_seq == led.head_seq(RUN) > seen
    assert ledger_kinds(led) == collections.Counter(
        {Kind.CLAIM: 1, Kind.COMMIT: 10, Kind.CLOSE: 1, Kind.RESUME: 1, Kind.LEASE: 4, Kind.ACK: 4}
    )


def test_importing_dataflow_leaves_prometheus_client_out() -> None:
    code = "import sys, dataflow; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_event_counts_go_on_from_the_run_s_start_after_a_snapshot(sqlite_url) -> None:
    # A collector that starts from the run's snapshot folds only the tail: its counts by
    # kind must still be the run's totals, not those of the events after the snapshot.
    led = Ledger.open(sqlite_url)
    store = LocalFeatureStore()
    prod = Producer(led, store, run_id=RUN)
    for i in range(6):
        prod.emit(f"s{i}", features(i))
    cons = Consumer(led, store, run_id=RUN, consumer_id="trainer")
    cons.resume()
    cons.ack(cons.lease(4), step=1)
    cons.checkpoint(1, ckpt("step-1"))
    assert led.save_snapshot(RUN, replay(led, RUN))
    snapshot_seq = led.load_snapshot(RUN).head_seq
    cons.ack(cons.lease(2), step=2)  # the tail after the snapshot
    assert led.head_seq(RUN) > snapshot_seq
    registry = CollectorRegistry()
    metrics = RunMetrics(led, RUN, registry=registry)
    for kind, count in ledger_kinds(led).items():
        got = registry.get_sample_value("dataflow_events_total", {"run": RUN, "kind": kind})
        assert got == count, kind
    assert metrics._backlog.kinds == ledger_kinds(led)
    assert led.kind_counts(RUN, by_sample=True) == dict(ledger_kinds(led))
    assert led.kind_counts(RUN, upto_seq=snapshot_seq, by_sample=True)[Kind.ACK] == 4
    assert led.kind_counts(RUN, upto_seq=snapshot_seq)[Kind.ACK] == 1  # rows: one batch


def test_what_is_no_registry_or_no_collector_is_refused_naming_it(sqlite_url) -> None:
    led = Ledger.open(sqlite_url)
    with pytest.raises(
        ArgumentTypeError, match=r"registry must be a prometheus_client.*got str 'x'"
    ):
        RunMetrics(led, RUN, registry="x")
    with pytest.raises(ArgumentTypeError, match=r"registry must be .* got int 5"):
        serve_metrics(0, registry=5)
    with pytest.raises(ArgumentTypeError, match=r"serves collectors .* got int 5"):
        serve_metrics(0, 5)
    # Nothing was left registered or served: the next server starts cleanly.
    with serve_metrics(0, RunMetrics(led, RUN)) as server:
        assert ("dataflow_lag_refs", (("run", RUN),)) in scrape(server.url)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def answers(clients: list[socket.socket], timeout: float) -> dict[socket.socket, bytes]:
    """What each client received until the server closed it (within ``timeout``)."""
    got: dict[socket.socket, bytes] = {c: b"" for c in clients}
    with selectors.DefaultSelector() as selector:
        for client in clients:
            client.setblocking(False)
            selector.register(client, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(0.1):
                try:
                    data = key.fileobj.recv(4096)
                except ConnectionResetError:
                    data = b""
                got[key.fileobj] += data
                if not data:
                    selector.unregister(key.fileobj)
        left = len(selector.get_map())
    assert left == 0, f"{left} idle clients still connected after {timeout} s"
    return got


def test_idle_clients_hold_no_more_than_the_cap_and_are_dropped_after_the_timeout(
    sqlite_url,
) -> None:
    # 554 idle connections used to cost 556 threads and 565 file descriptors: a thread
    # and a socket each, for as long as the client stayed silent.
    led = Ledger.open(sqlite_url)
    threads, fds = threading.active_count(), open_fds()
    server = serve_metrics(0, RunMetrics(led, RUN), idle_timeout=3.0)  # the default cap
    clients = []
    try:
        connecting = time.monotonic()
        for _ in range(200):
            clients.append(socket.create_connection((server.host, server.port), timeout=30))
        # Beyond the cap, each is answered 503 and closed at once.
        refused: list[socket.socket] = []

        def all_but_the_cap_refused() -> bool:
            for client in clients:
                if client in refused:
                    continue
                client.settimeout(0)
                try:
                    if client.recv(4096).startswith(b"HTTP/1.0 503 Service Unavailable"):
                        refused.append(client)
                except BlockingIOError:
                    pass
            return len(refused) >= 200 - 8

        wait_for(all_but_the_cap_refused, 30, "clients beyond the cap refused")
        # The server holds the cap's connections, a thread each, and nothing more.
        assert threading.active_count() <= threads + 1 + 8
        assert open_fds() <= fds + 200 + 1 + 8 + 2  # ours, its listener, its cap, slack
        held = [c for c in clients if c not in refused]
        assert len(held) == 8
        assert all(data == b"" for data in answers(held, 30).values())  # dropped, unanswered
        assert time.monotonic() - connecting >= 3.0 - 0.1  # not before the idle timeout
        # Its slots are free again once their threads end: a scrape goes through.
        wait_for(lambda: threading.active_count() <= threads + 1, 10, "the handlers ended")
        assert value(scrape(server.url), "dataflow_lag_refs", run=RUN) == 0
    finally:
        for client in clients:
            client.close()
        server.close()
    wait_for(lambda: threading.active_count() <= threads, 30, "the server's threads ended")
    assert open_fds() <= fds + 1


def test_a_client_sending_its_request_byte_by_byte_is_dropped_at_the_deadline(
    sqlite_url,
) -> None:
    led = Ledger.open(sqlite_url)
    with serve_metrics(0, RunMetrics(led, RUN), idle_timeout=1.0, max_connections=1) as server:
        threads = threading.active_count()
        slow = socket.create_connection((server.host, server.port), timeout=10)
        started = time.monotonic()
        slow.sendall(b"GET /metrics HTTP/1.0\r\n")  # the request line at once
        headers, dropped = b"X-Padding: " + b"a" * 100, False
        for byte in headers:  # one byte every 0.2 s: never silent for the idle timeout
            try:
                slow.sendall(bytes([byte]))
            except OSError:  # reset by the server
                dropped = True
                break
            time.sleep(0.2)
            slow.settimeout(0)
            try:
                if slow.recv(1) == b"":
                    dropped = True
                    break
            except BlockingIOError:
                pass
        assert dropped, "the slow client kept its connection for the whole request"
        assert time.monotonic() - started < 10  # the deadline, with slack for a loaded box
        slow.close()
        # Its handler's thread ends (the client may see the end of file a moment before):
        # the one slot is free again.
        wait_for(lambda: threading.active_count() <= threads, 10, "the handler thread ended")
        assert value(scrape(server.url), "dataflow_lag_refs", run=RUN) == 0


def test_close_drops_the_connections_it_holds(sqlite_url) -> None:
    led = Ledger.open(sqlite_url)
    threads = threading.active_count()
    server = serve_metrics(0, RunMetrics(led, RUN), idle_timeout=60.0)
    clients = [socket.create_connection((server.host, server.port), timeout=10) for _ in range(3)]
    try:
        wait_for(lambda: threading.active_count() >= threads + 4, 10, "the clients served")
        server.close()
        assert all(data == b"" for data in answers(clients, 10).values())  # not after 60 s
        wait_for(lambda: threading.active_count() <= threads, 10, "the server's threads ended")
    finally:
        for client in clients:
            client.close()
        server.close()


class CountingCollector:
    """A collector that counts its runs and the threads they ran on."""

    def __init__(self) -> None:
        self.calls = 0
        self.threads: set[str] = set()

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        self.calls += 1
        self.threads.add(threading.current_thread().name)
        yield GaugeMetricFamily("dataflow_test_collections", "runs of this collector", self.calls)


def test_collectors_run_at_most_once_per_interval_however_many_clients_scrape() -> None:
    # Four clients scraping in a loop cut a trainer's steps/s by a third to a half: each
    # scrape ran every collector. Now they run at most once per min_interval (0.5 s by
    # default), on the server's threads, and a scrape never gets values older than itself.
    counting = CountingCollector()
    results: list[float] = []
    with serve_metrics(0, counting) as server:
        started = time.monotonic()

        def scraper() -> None:
            for _ in range(5):
                asked = counting.calls
                got = value(scrape(server.url), "dataflow_test_collections")
                assert got > asked  # collected after the scrape came
                results.append(got)

        workers = [threading.Thread(target=scraper) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        elapsed = time.monotonic() - started
    assert len(results) == 20
    assert counting.calls <= elapsed / 0.5 + 1, (counting.calls, elapsed)
    assert counting.calls < 20  # scrapes shared collections
    assert threading.main_thread().name not in counting.threads


@pytest.mark.parametrize(
    ("option", "bad", "error", "says"),
    [
        ("max_connections", 0, InvalidArgumentError, "max_connections must be at least 1"),
        ("max_connections", 2.5, ArgumentTypeError, "got float 2.5"),
        ("max_connections", True, ArgumentTypeError, "got bool True"),
        ("idle_timeout", 0, InvalidArgumentError, "idle_timeout must be a finite number of"),
        ("idle_timeout", float("inf"), InvalidArgumentError, "above 0, got inf"),
        ("idle_timeout", "5", InvalidArgumentError, "got '5'"),
        ("min_interval", -1, InvalidArgumentError, "min_interval must be a finite number"),
        ("min_interval", float("nan"), InvalidArgumentError, "from 0, got nan"),
    ],
)
def test_bad_endpoint_limits_are_refused_naming_the_value(option, bad, error, says) -> None:
    with pytest.raises(error, match=re.escape(says)):
        serve_metrics(0, **{option: bad})


def produce_and_serve(url: str, store_uri: str, count: int, port, done) -> None:
    """A producer process: commit ``count`` samples, serve the run's metrics until ``done``."""
    store = open_store(store_uri)
    with Ledger.open(url) as led:
        prod = Producer(led, store, run_id=RUN, metrics_port=0)
        for i in range(count):
            prod.emit(f"p{i:02d}", features(i))
        port.put(prod.metrics.port)
        done.wait(120)
        prod.close()
    store.close()


def train_and_release(url: str, store_uri: str, count: int) -> None:
    """A trainer process: train ``count`` samples, releasing their features at the ack."""
    store = open_store(store_uri)
    with Ledger.open(url) as led:
        cons = Consumer(led, store, run_id=RUN, consumer_id="rank0", release_policy="on_ack")
        cons.resume()
        cons.ack(cons.lease(count), step=1)
    store.close()  # Mooncake: waits until its removals are done


@pytest.fixture(params=["shared_dir", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def store_uris(request, tmp_path) -> tuple[str, str]:
    """(URI for this process, URI for the producer and trainer processes) of a fresh store."""
    if request.param == "shared_dir":
        uri = f"dir://{tmp_path / 'features'}"
        return uri, uri
    master = request.getfixturevalue("mooncake_master")
    uri = master.store_uri(namespace=f"gauges{uuid.uuid4().hex[:12]}")
    # The other processes lend no memory: what they put lives in this process's segment.
    return uri, f"{uri}&segment_size=0"


def test_the_store_gauges_say_what_the_store_holds_in_every_process(sqlite_url, store_uris) -> None:
    # On Mooncake a producer reported its own puts (205, though the ranks had freed most)
    # and every rank reported 0: the gauges counted what this process's handle had put.
    here, there = store_uris
    store = open_store(here)  # on Mooncake, the memory the objects live in
    context = forkserver_context(__name__)
    port, done = context.Queue(), context.Event()
    producer = context.Process(target=produce_and_serve, args=(sqlite_url, there, 12, port, done))
    producer.start()
    try:
        producer_url = f"http://127.0.0.1:{port.get(timeout=120)}/metrics"
        trainer = context.Process(target=train_and_release, args=(sqlite_url, there, 5))
        trainer.start()
        trainer.join(120)
        assert trainer.exitcode == 0
        left = [f"p{i:02d}" for i in range(5, 12)]  # the first five were leased and released
        assert sorted(obj.sample_id for obj in store.scan()) == left
        nbytes = sum(4 * (i + 1) + 16 for i in range(5, 12))
        with serve_metrics(0, RunMetrics(Ledger.open(sqlite_url), RUN, store=store)) as own:
            for url in (producer_url, own.url):  # the producer's endpoint, a sidecar's
                samples = scrape(url)
                assert value(samples, "dataflow_store_objects", store=store.uri) == 12 - 5
                assert value(samples, "dataflow_store_bytes", store=store.uri) == nbytes
                assert value(samples, "dataflow_backlog_refs", run=RUN) == 12 - 5
        done.set()
        producer.join(120)
        assert producer.exitcode == 0
    finally:
        done.set()
        if producer.is_alive():
            producer.kill()
        store.close()
