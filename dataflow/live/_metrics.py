"""Prometheus metrics of a run, and the HTTP endpoint that serves them.

:class:`RunMetrics` is a collector: at each scrape it folds the events
appended since the last one (never the whole log again) and reports event
counters, the run's backlog and in-flight work, the store's size, and the
latency of this process's append transactions, and how long this process's
producers of the run were blocked. :func:`serve_metrics` serves collectors over
HTTP, on the loopback interface unless told otherwise, with a cap on connections,
a deadline on silent ones, and the collectors run at most once per interval.

``prometheus_client`` is imported inside the functions that need it, so
``import dataflow`` stays fast.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dataflow.interfaces._store import FeatureStore
from dataflow.live._backpressure import Backlog, producer_blockings
from dataflow.live._restarts import RestartTracker, restart_families
from dataflow.live._scrape import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MIN_INTERVAL_S,
    _bind_address,
    _Exposition,
    _ScrapeServer,
)
from dataflow.model._checks import check_seconds
from dataflow.model._errors import ArgumentTypeError, DataflowError, InvalidArgumentError
from dataflow.model._events import Kind
from dataflow.recorder import _observers as append_observers

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from dataflow.recorder._ledger import Ledger

#: Where ``dataflow_append_seconds`` puts append transactions (seconds): a
#: SQLite commit with fsync takes a few milliseconds, a lock wait up to the busy timeout.
APPEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
DEFAULT_HOST = "127.0.0.1"

# Copy-on-write, so that observe_append reads it without a lock from any thread.
_append_subscribers: tuple[weakref.ref[RunMetrics], ...] = ()
_subscribe_lock = threading.Lock()


def observe_append(ledger_url: str, run_id: str, what: str, seconds: float) -> None:
    """The recorder's append observer while a RunMetrics of this process times appends."""
    for ref in _append_subscribers:
        metrics = ref()
        if metrics is not None and metrics.run_id == run_id and metrics.ledger.url == ledger_url:
            metrics._append.labels(run_id, what).observe(seconds)


def _subscribe(metrics: RunMetrics | None, *, drop: RunMetrics | None = None) -> None:
    global _append_subscribers
    with _subscribe_lock:
        kept = [r for r in _append_subscribers if r() is not None and r() is not drop]
        if metrics is not None:
            kept.append(weakref.ref(metrics))
        _append_subscribers = tuple(kept)
        # Observed only while a RunMetrics listens: appends pay nothing otherwise.
        if kept:
            append_observers.subscribe(observe_append)
        else:
            append_observers.unsubscribe(observe_append)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:  # a dependency; missing only in a broken install
        raise ImportError(
            "dataflow metrics need prometheus_client: pip install prometheus_client"
        ) from exc
    return prometheus_client


class RunMetrics:
    """A Prometheus collector of one run of a ledger (and, optionally, its store).

    At each scrape it folds only the events appended since the previous one.
    It reports, each with the label ``run``:

    * ``dataflow_events_total{kind}``: events in the ledger by kind (commit,
      lease, ack, nack, lost, release, ...), counted from the run's start, by
      sample (a batch row of 16 leases counts 16);
      ``rate(dataflow_events_total[1m])`` gives them per second;
    * ``dataflow_dead_samples_total``: samples that died (a nack that was not
      retryable, or at their last attempt);
    * ``dataflow_excluded_samples_total``: exclusions of samples (``Consumer.exclude``,
      ``dataflow exclude``), each counted once, those an include undid too, and the gauge
      ``dataflow_excluded_refs``: the samples excluded now;
    * gauges ``dataflow_pending_refs`` (waiting for a lease),
      ``dataflow_inflight_refs`` and ``dataflow_inflight_bytes`` (leased, not
      yet acked), ``dataflow_lag_refs`` (committed, not yet trained, not dead:
      the consumers' lag), ``dataflow_backlog_refs`` and
      ``dataflow_backlog_bytes`` (the un-trained features in the store, which
      producer backpressure watches);
    * with a ``store``: ``dataflow_store_bytes`` and ``dataflow_store_objects``
      (``FeatureStore.stats()``, label ``store``, orphans included);
    * ``dataflow_append_seconds{op}``: a histogram of this process's append
      transactions to the run, from their start (lock wait included) to their
      commit, by operation (commit, lease, ack, ...);
    * for the run's producers in this process, labels ``producer`` and ``cause``
      (``credit``: the stream's windows are full; ``high_mark``: the backlog is at
      the :class:`Watermarks`' high mark): ``dataflow_producer_blocked`` (1 while
      blocked) and ``dataflow_producer_blocked_seconds_total`` (seconds waited);
    * the run's restarts (resumes that fenced off an earlier epoch) and their cost
      (``live/_restarts.py``): counters ``dataflow_resumes_total``,
      ``dataflow_resume_requeued_samples_total``,
      ``dataflow_resume_regenerated_samples_total``,
      ``dataflow_resume_redone_sample_steps_total`` (work lost) and
      ``dataflow_resume_seconds_total`` (from the last event before each restart to the
      first lease after it); gauges of the newest restart:
      ``dataflow_last_resume_kept_samples``, ``dataflow_last_resume_checkpoint_step`` and
      ``dataflow_last_resume_seconds``.

    ``registry``: a ``prometheus_client.CollectorRegistry`` to register with
    (None: none; :func:`serve_metrics` registers it). One run per registry:
    a second RunMetrics in the same registry is refused (duplicate names).
    """

    def __init__(
        self,
        ledger: Ledger,
        run_id: str,
        *,
        store: FeatureStore | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        from dataflow.recorder._ledger import Ledger, check_id

        if not isinstance(ledger, Ledger):
            raise ArgumentTypeError(
                f"ledger must be a dataflow.Ledger, got {type(ledger).__name__}"
            )
        check_id("run_id", run_id)
        if store is not None and not isinstance(store, FeatureStore):
            raise ArgumentTypeError(
                f"store must be a FeatureStore or None, got {type(store).__name__}"
            )
        prometheus = _prometheus()
        self.ledger = ledger
        self.run_id = run_id
        self.store = store
        self._backlog = Backlog(ledger, run_id)
        self._restarts = RestartTracker()
        self._lock = threading.Lock()
        self._append = prometheus.Histogram(
            "dataflow_append_seconds",
            "Append transactions of this process to the run, start (lock wait included) to "
            "commit, by operation",
            ["run", "op"],
            buckets=APPEND_BUCKETS,
            registry=None,
        )
        if registry is not None:
            _check_registry(registry)
            try:
                registry.register(self)
            except ValueError as exc:  # prometheus_client: "Duplicated timeseries ..."
                raise InvalidArgumentError(
                    f"{exc}: the registry already serves a RunMetrics (one run per registry); "
                    "give each run a registry of its own"
                ) from None
        _subscribe(self)

    def close(self) -> None:
        """Stop timing this process's appends (the collector can still be scraped)."""
        _subscribe(None, drop=self)

    def describe(self) -> list[Any]:
        """The metric families, without values (a registry checks names with it)."""
        return list(self._families(read=False))

    def collect(self) -> list[Any]:
        """The metric families with their values, after folding the new events."""
        with self._lock:
            self._backlog.refresh()
            return list(self._families(read=True))

    def _families(self, *, read: bool) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        run, state, backlog = self.run_id, self._backlog.state, self._backlog
        events = CounterMetricFamily(
            "dataflow_events",
            "Events in the run's ledger by kind, a batch row once per sample it names; "
            "rate() gives them per second",
            labels=["run", "kind"],
        )
        if read:
            for kind in sorted(Kind.ALL | set(backlog.kinds)):
                events.add_metric([run, kind], backlog.kinds[kind])
        yield events
        dead = CounterMetricFamily(
            "dataflow_dead_samples",
            "Samples that died: nacked as not retryable, or at their last attempt",
            labels=["run"],
        )
        if read:
            dead.add_metric([run], len(state.dead))
        yield dead
        yield from _excluded_families(run, state if read else None)
        leased = list(state.leased) if read else []
        pending = backlog.refs - len(leased)
        gauges = (
            ("pending_refs", "Refs waiting for a lease", pending),
            ("inflight_refs", "Refs leased and not yet acked", len(leased)),
            (
                "inflight_bytes",
                "Tensor bytes of the refs leased and not yet acked",
                sum(map(backlog.nbytes, leased)),
            ),
            (
                "lag_refs",
                "Committed samples not yet trained and not dead (regenerations included)",
                backlog.refs + len(state.regenerate),
            ),
            ("backlog_refs", "Un-trained refs whose features are in the store", backlog.refs),
            (
                "backlog_bytes",
                "Tensor bytes of the un-trained features in the store",
                backlog.bytes,
            ),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"dataflow_{name}", doc, labels=["run"])
            if read:
                family.add_metric([run], value)
            yield family
        if self.store is not None:
            yield from self._store_families(read)
        yield from self._blocked_families(read)
        yield from self._restart_families(read)
        yield from self._append.collect() if read else self._append.describe()

    def _store_families(self, read: bool) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        stats = None
        if read:
            try:
                stats = self.store.stats()  # type: ignore[union-attr]
            except DataflowError:  # closed, or its server is down: no value rather than a lie
                stats = None
        for name, doc, attr in (
            ("store_bytes", "Tensor bytes the store holds (all runs', orphans too)", "bytes"),
            ("store_objects", "Sample generations the store holds", "objects"),
        ):
            family = GaugeMetricFamily(f"dataflow_{name}", doc, labels=["store"])
            if stats is not None:
                family.add_metric([self.store.uri], getattr(stats, attr))  # type: ignore[union-attr]
            yield family

    def _blocked_families(self, read: bool) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["run", "producer", "cause"]
        blocked = GaugeMetricFamily(
            "dataflow_producer_blocked",
            "1 while a producer of this process is blocked on the cause (credit: its "
            "stream's windows are full; high_mark: the run's backlog is at its high mark)",
            labels=labels,
        )
        seconds = CounterMetricFamily(
            "dataflow_producer_blocked_seconds",
            "Seconds a producer of this process spent waiting, by cause",
            labels=labels,
        )
        if read:
            # Two Producers of one id in a process (a closed one, its successor) are one.
            readings: dict[tuple[str, str, str], tuple[bool, float]] = {}
            for blocking in producer_blockings(self.run_id):
                key = (self.run_id, blocking.producer_id, blocking.cause)
                now_blocked, waited = blocking.reading()
                was_blocked, had_waited = readings.get(key, (False, 0.0))
                readings[key] = (now_blocked or was_blocked, waited + had_waited)
            for key, (now_blocked, waited) in sorted(readings.items()):
                blocked.add_metric(list(key), int(now_blocked))
                seconds.add_metric(list(key), waited)
        yield blocked
        yield seconds

    def _restart_families(self, read: bool) -> Iterator[Any]:
        """The run's restarts and their cost (``live/_restarts.py``)."""
        costs = None
        if read:
            state = self._backlog.state
            self._restarts.update(self.ledger, self.run_id, upto_seq=state.head_seq)
            costs = self._restarts.costs(state)
        return restart_families(self.run_id, costs)


def _excluded_families(run: str, state: Any) -> Iterator[Any]:
    """The exclusions of the run (``state``: the fold; None: the families without values)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    total = CounterMetricFamily(
        "dataflow_excluded_samples",
        "Exclusions of samples from the run (an include does not take one back)",
        labels=["run"],
    )
    now = GaugeMetricFamily(
        "dataflow_excluded_refs", "Samples excluded from the run now", labels=["run"]
    )
    if state is not None:
        total.add_metric([run], state.excluded_total)
        now.add_metric([run], len(state.excluded))
    yield total
    yield now


class MetricsServer:
    """A running metrics endpoint (``serve_metrics``): ``url``, ``host``, ``port``; ``close()``."""

    def __init__(
        self, httpd: Any, thread: threading.Thread, registry: Any, owned: list[RunMetrics]
    ) -> None:
        self._httpd = httpd
        self._thread = thread
        self.registry = registry
        self._owned = owned
        address = httpd.socket.getsockname()
        #: The address and port the endpoint is bound to (the port chosen, for port 0).
        self.host: str = address[0]
        self.port: int = address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, drop the connections in progress and free the port; idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()
        for metrics in self._owned:
            metrics.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url!r})"


def _check_port(name: str, port: object) -> int:
    if not isinstance(port, int) or isinstance(port, bool):
        raise ArgumentTypeError(
            f"{name} must be an int (0 to 65535), got {type(port).__name__} {port!r}"
        )
    if not 0 <= port <= 65535:
        raise InvalidArgumentError(
            f"{name} must be from 0 to 65535 (0: any free port), got {port}; Prometheus "
            "exporters commonly use 9100 to 9999"
        )
    return port


def _check_host(name: str, host: object) -> str:
    if not isinstance(host, str) or not host or host != host.strip():
        raise InvalidArgumentError(
            f"{name} must be an address or host name to bind, e.g. '127.0.0.1' (loopback, the "
            f"default) or '0.0.0.0' (every interface), got {host!r}"
        )
    return host


def _check_limits(max_connections: object, idle_timeout: object, min_interval: object) -> None:
    if not isinstance(max_connections, int) or isinstance(max_connections, bool):
        raise ArgumentTypeError(
            f"max_connections must be an int from 1, got {type(max_connections).__name__} "
            f"{max_connections!r}"
        )
    if max_connections < 1:
        raise InvalidArgumentError(
            f"max_connections must be at least 1 (connections served at once), got "
            f"{max_connections}; {MAX_CONNECTIONS} leaves room for two Prometheus servers"
        )
    _check_seconds("idle_timeout", idle_timeout, least="above 0")
    _check_seconds("min_interval", min_interval, least="from 0")


def _check_seconds(name: str, value: object, *, least: str) -> None:
    check_seconds(name, value, positive=least == "above 0")


def serve_metrics(
    port: int,
    *collectors: Any,
    host: str = DEFAULT_HOST,
    registry: CollectorRegistry | None = None,
    max_connections: int = MAX_CONNECTIONS,
    idle_timeout: float = IDLE_TIMEOUT_S,
    min_interval: float = MIN_INTERVAL_S,
) -> MetricsServer:
    """Serve ``collectors`` (e.g. a :class:`RunMetrics`) at ``http://HOST:PORT/metrics``.

    ``host`` defaults to the loopback interface, so nothing outside the
    machine sees the metrics; pass ``"0.0.0.0"`` (or an interface's address)
    for a Prometheus server elsewhere. ``port=0`` takes any free port
    (``server.port`` says which). ``registry``: serve this
    ``prometheus_client`` registry (the collectors are registered with it);
    None: a registry of the server's own, so two servers in one process do not
    clash. Returns the running :class:`MetricsServer`; ``close()`` stops it.

    What a scrape may cost the process is bounded: at most ``max_connections``
    clients are served at once (one more gets a 503 and is closed); a client
    that stays silent for ``idle_timeout`` seconds, or has not sent its request
    ``idle_timeout`` seconds after connecting, is dropped; and the collectors run
    on the server's threads at most once per ``min_interval`` seconds, however
    many clients scrape (a scrape that comes sooner waits for the next run, so
    it never gets values older than itself).
    """
    return _serve(
        port, host, registry, collectors, (max_connections, idle_timeout, min_interval), owned=[]
    )


def _serve(
    port: object,
    host: object,
    registry: Any,
    collectors: Any,
    limits: tuple[object, object, object],
    *,
    owned: list[RunMetrics],
) -> MetricsServer:
    port = _check_port("port", port)
    host = _check_host("host", host)
    _check_limits(*limits)
    max_connections, idle_timeout, min_interval = limits
    prometheus = _prometheus()
    if registry is None:
        registry = prometheus.CollectorRegistry()
    _check_registry(registry)
    for collector in collectors:
        if not callable(getattr(collector, "collect", None)):
            raise ArgumentTypeError(
                f"serve_metrics serves collectors (e.g. a RunMetrics), got "
                f"{type(collector).__name__} {collector!r:.100}"
            )
    registered = []
    try:
        for collector in collectors:
            registry.register(collector)
            registered.append(collector)
        try:
            family, address = _bind_address(host, port)
            httpd = _ScrapeServer(
                address,
                family,
                _Exposition(
                    lambda: prometheus.generate_latest(registry),
                    prometheus.CONTENT_TYPE_LATEST,
                    min_interval,
                ),  # type: ignore[arg-type]
                max_connections,  # type: ignore[arg-type]
                idle_timeout,  # type: ignore[arg-type]
            )
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; pick a free port "
                "(or 0 for any) and an address of this machine",
            ) from exc
    except BaseException:
        for collector in registered:
            registry.unregister(collector)
        raise
    thread = threading.Thread(target=httpd.serve_forever, name="dataflow-metrics", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread, registry, owned)


def _check_registry(registry: object) -> None:
    if not callable(getattr(registry, "register", None)):
        raise ArgumentTypeError(
            "registry must be a prometheus_client.CollectorRegistry or None, got "
            f"{type(registry).__name__} {registry!r:.100}"
        )


def serve_run_metrics(
    ledger: Ledger,
    run_id: str,
    store: FeatureStore,
    port: int | None,
    host: str | None,
) -> MetricsServer | None:
    """Serve a run's metrics for ``Producer``/``Consumer(metrics_port=, metrics_host=)``."""
    if port is None:
        if host is not None:
            raise InvalidArgumentError(
                f"metrics_host={host!r} was given without metrics_port: pass metrics_port to "
                "serve the run's metrics"
            )
        return None
    _check_port("metrics_port", port)
    host = _check_host("metrics_host", DEFAULT_HOST if host is None else host)
    metrics = RunMetrics(ledger, run_id, store=store)
    try:
        return _serve(
            port,
            host,
            None,
            [metrics],
            (MAX_CONNECTIONS, IDLE_TIMEOUT_S, MIN_INTERVAL_S),
            owned=[metrics],
        )
    except BaseException:
        metrics.close()
        raise
