"""The Grafana dashboard (docs/grafana/dataflow.json) names only metrics the library exports.

Every PromQL expression in it (panel targets, annotations, template variables) is parsed
down to the series it reads, and each one must be a series of a real run's /metrics
scrape: a counter family ``x`` exports ``x_total``, a histogram ``x_bucket``, ``x_sum``
and ``x_count``, a gauge ``x``.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dataflow import Consumer, Ledger, Producer, RunMetrics, serve_metrics
from stores import LocalFeatureStore

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "dataflow.json"
#: PromQL's functions, aggregations and keywords: names that are no metric.
_NOT_METRICS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    | {"and", "or", "unless", "le", "inf", "nan"}
)
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _expressions(node: Any) -> Iterator[str]:
    """Every PromQL expression of the dashboard: ``expr`` keys, and template queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str) and (
                key == "expr" or (key == "query" and "label_values" in value)
            ):
                yield value
            else:
                yield from _expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from _expressions(item)


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*[A-Za-z_]\w*\s*\)", r"\1", text)
    text = re.sub(r"\$\w+", "", text)  # Grafana's variables ($__rate_interval, $run)
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _NOT_METRICS:
            continue
        names.add(name)
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (run) (rate(dataflow_events_total{kind="ack"}[5m]))', {"dataflow_events_total"}),
        (
            "histogram_quantile(0.99, sum by (le, op) (rate(dataflow_append_seconds_bucket[5m])))",
            {"dataflow_append_seconds_bucket"},
        ),
        ("a_total / clamp_min(b_total offset 5m, 1) > bool 0", {"a_total", "b_total"}),
        ("label_values(dataflow_events_total, run)", {"dataflow_events_total"}),
        ('x{l=~"a(b)c"} + y[$__rate_interval]', {"x", "y"}),
    ],
)
def test_the_parser_finds_the_series(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.fixture
def exported(sqlite_url: str) -> set[str]:
    """The series names a real run's /metrics endpoint exports (its ``# TYPE`` lines)."""
    with Ledger.open(sqlite_url) as led, LocalFeatureStore() as store:
        producer = Producer(led, store, run_id="r1")
        for i in range(4):
            producer.emit(f"s{i}", {"x": torch.ones(4)})
        first = Consumer(led, store, run_id="r1", consumer_id="first")
        first.resume()
        first.ack(first.lease(2), step=1)
        Consumer(led, store, run_id="r1", consumer_id="second").resume()  # a restart
        with serve_metrics(0, RunMetrics(led, "r1", store=store)) as server:
            text = urllib.request.urlopen(server.url, timeout=30).read().decode()
        producer.close()
    assert 'dataflow_resumes_total{run="r1"} 1.0' in text
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE dataflow_"):
            _, _, family, kind = line.split()
            if kind == "counter":  # named with or without _total, by prometheus_client's version
                family = family.removesuffix("_total")
            names.update(family + suffix for suffix in _SUFFIXES[kind])
    return names


def test_every_expression_names_an_exported_metric(exported: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = list(_expressions(dashboard))
    assert len(expressions) >= 20
    used: set[str] = set()
    for expr in expressions:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{expr!r} names {sorted(unknown)}, which the library does not export"
        used |= names
    # What the operator asked for (issue 40): flow, in-flight work, lag, store, ledger
    # latency, restarts and their cost.
    assert used >= {
        "dataflow_events_total",
        "dataflow_dead_samples_total",
        "dataflow_inflight_refs",
        "dataflow_inflight_bytes",
        "dataflow_lag_refs",
        "dataflow_store_bytes",
        "dataflow_append_seconds_bucket",
        "dataflow_resumes_total",
        "dataflow_resume_requeued_samples_total",
        "dataflow_resume_redone_sample_steps_total",
        "dataflow_resume_seconds_total",
    }
    kinds = {kind for expr in expressions for kind in re.findall(r'kind="(\w+)"', expr)}
    assert kinds >= {"commit", "lease", "ack", "lost"}


def test_the_dashboard_is_one_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "dataflow"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "run"}
