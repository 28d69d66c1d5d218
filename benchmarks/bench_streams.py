"""Ref stream benchmark: our ZeroMQ stream against raw pyzmq PUSH/PULL, two processes.

Throughput. One producer process sends ``--refs`` refs to one consumer
process, which takes them in batches and finishes each batch (``credit``,
what ``Consumer.ack`` does) so that the credit window turns over. The same
ref payload goes through:

* ``ZmqRefSender`` -> ``ZmqRefReceiver``: our full path (the tensor-free
  check, JSON frames, credit, SampleRef validation on receipt);
* raw PUSH/PULL of the same frame bytes, encoded once and never decoded: the
  ceiling of pyzmq itself;
* raw PUSH/PULL with ``SampleRef.to_json`` per send and ``SampleRef.from_json``
  per receive: what any JSON ref transport pays, without our protocol.

The rate is refs over the wall time from a common start signal to the
consumer's last ref; runs of the contenders alternate, the best of
``--repeats`` is kept.

Latency. The producer offers ``--rate`` refs/s (paced against the clock), each
stamped with ``time.monotonic_ns()`` (one clock for all processes); the
consumer records the age of each ref on receipt.

Run: ``python -m benchmarks.bench_streams [--quick] [--refs N] [--rate R]
[--write-docs]``; ``--write-docs`` rewrites the Streams section of
docs/benchmarks.md; :func:`rows` gives the rows of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from benchmarks import _report
from benchmarks._rows import Row, row
from dataflow import FeatureSpec, SampleRef
from dataflow.streams import ReceiverConfig, SenderConfig, ZmqRefReceiver, ZmqRefSender
from dataflow.streams._wire import encode_ref, encode_ref_body

# Children fork from a server that imported torch and dataflow once: a spawned
# child pays seconds of imports on a loaded machine, for every run.
PROCESSES = mp.get_context("forkserver")
PROCESSES.set_forkserver_preload(["torch", "zmq", "dataflow.streams", "benchmarks.bench_streams"])
WAIT = 300.0
BATCH = 64
TARGET = 0.25  # of the raw rate
CONTENDERS = ("stream", "raw", "raw+json")


def make_ref(i: int, stamp: int = 0) -> SampleRef:
    specs = {
        "hidden": FeatureSpec((2048, 4096), torch.bfloat16),
        "input_ids": FeatureSpec((2048,), torch.int64),
    }
    return SampleRef(
        f"sample-{i:09d}", "dir:///data/features", 1, specs=specs, metadata={"t": stamp}
    )


def payload_bytes() -> int:
    return len(encode_ref("0" * 32, 1, encode_ref_body(make_ref(0))))


# -- the two ends of each contender, run in child processes ------------------------------------
def stream_consumer(window: int, pipe: Any) -> None:
    config = ReceiverConfig(window=window, idle_timeout=WAIT)
    with ZmqRefReceiver(config) as receiver:
        pipe.send(receiver.endpoint)
        ages: list[int] = []
        while refs := receiver.receive(BATCH):
            now = time.monotonic_ns()
            ages.extend(now - r.metadata["t"] for r in refs)
            receiver.credit(len(refs))
        pipe.send((time.monotonic(), ages))


def stream_producer(endpoint: str, count: int, rate: float, pipe: Any) -> None:
    config = SenderConfig(endpoints=(endpoint,), send_timeout=WAIT)
    with ZmqRefSender(config) as sender:
        refs = [make_ref(i) for i in range(count)] if rate == 0 else None
        pipe.send("ready")
        start = pipe.recv()
        for i in range(count):
            if refs is not None:
                sender.send(refs[i])
            else:
                _pace(start, i, rate)
                sender.send(make_ref(i, time.monotonic_ns()))


def raw_consumer(decode: bool, pipe: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    pipe.send(f"tcp://127.0.0.1:{port}")
    count = pipe.recv()
    ages: list[int] = []
    for _ in range(count):
        data = sock.recv()
        if decode:
            ref = SampleRef.from_json(data)
            ages.append(time.monotonic_ns() - ref.metadata["t"])
    pipe.send((time.monotonic(), ages))
    ctx.destroy(linger=0)


def raw_producer(endpoint: str, count: int, rate: float, encode: bool, pipe: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    frame = encode_ref("0" * 32, 1, encode_ref_body(make_ref(0)))
    refs = [make_ref(i) for i in range(count)] if encode and rate == 0 else None
    pipe.send("ready")
    start = pipe.recv()
    for i in range(count):
        if refs is not None:
            sock.send(refs[i].to_json().encode())
        elif encode:
            _pace(start, i, rate)
            sock.send(make_ref(i, time.monotonic_ns()).to_json().encode())
        else:
            sock.send(frame)
    ctx.destroy(linger=-1)


def _pace(start: float, i: int, rate: float) -> None:
    delay = start + i / rate - time.monotonic()
    if delay > 0:
        time.sleep(delay)


# -- running a contender -------------------------------------------------------------------------
def run(contender: str, count: int, *, rate: float = 0.0, window: int = 64) -> tuple[float, list]:
    """(seconds from the start signal to the last receipt, ages in ns) of one run."""
    consumer_pipe, consumer_end = PROCESSES.Pipe()
    producer_pipe, producer_end = PROCESSES.Pipe()
    if contender == "stream":
        consumer = PROCESSES.Process(target=stream_consumer, args=(window, consumer_end))
    else:
        consumer = PROCESSES.Process(
            target=raw_consumer, args=(contender == "raw+json", consumer_end)
        )
    consumer.start()
    endpoint = _recv(consumer_pipe)
    if contender == "stream":
        producer = PROCESSES.Process(
            target=stream_producer, args=(endpoint, count, rate, producer_end)
        )
    else:
        producer = PROCESSES.Process(
            target=raw_producer,
            args=(endpoint, count, rate, contender == "raw+json", producer_end),
        )
        consumer_pipe.send(count)
    producer.start()
    assert _recv(producer_pipe) == "ready"
    time.sleep(0.2)  # let the connection settle (and, for our stream, the first credit)
    start = time.monotonic()
    producer_pipe.send(start)
    end, ages = _recv(consumer_pipe)
    for proc in (producer, consumer):
        proc.join(WAIT)
    return end - start, ages


def _recv(pipe: Any) -> Any:
    if not pipe.poll(WAIT):
        raise TimeoutError(f"a benchmark process said nothing for {WAIT}s")
    return pipe.recv()


def throughput(
    count: int, repeats: int, window: int, contenders: tuple[str, ...] = CONTENDERS
) -> dict[str, float]:
    best = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):
        for contender in best:  # alternate, so machine drift hits all alike
            best[contender] = min(best[contender], run(contender, count, window=window)[0])
    return {name: _report.per_second(count, seconds) for name, seconds in best.items()}


def latency(count: int, rate: float) -> dict[str, tuple[float, float]]:
    result = {}
    for contender in ("stream", "raw+json"):
        _, ages = run(contender, count, rate=rate)
        ms = sorted(age / 1e6 for age in ages)
        result[contender] = (statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))])
    return result


@dataclass
class Measured:
    rates: dict[str, float]  # refs/s per contender, window ``window``
    big: float  # our refs/s with a window 8 times larger
    latency: dict[str, tuple[float, float]]  # (p50, p99) ms of "stream" and "raw+json"


def measure(args: argparse.Namespace) -> Measured:
    rates = throughput(args.refs, args.repeats, args.window)
    big = throughput(args.refs, args.repeats, args.window * 8, ("stream",))["stream"]
    return Measured(rates, big, latency(args.latency_refs, args.rate))


def rows(
    workdir: Path, *, quick: bool, refs: int | None = None, latency_refs: int | None = None
) -> list[Row]:
    """Our stream's refs/s against raw PUSH/PULL, and its latency against raw + JSON.

    ``workdir`` is unused: nothing touches the disk.
    """
    args = parse_args(["--quick"] if quick else [])
    args.refs = refs or args.refs
    args.latency_refs = latency_refs or args.latency_refs
    before = _report.load()
    got = measure(args)
    note = (
        f"one producer and one consumer process, {args.refs:,} refs of {payload_bytes()} bytes "
        f"per frame, best of {args.repeats}; latency of {args.latency_refs:,} refs offered at "
        f"{args.rate:,.0f} refs/s; load average {before:.1f} at the start, "
        f"{_report.load():.1f} at the end"
    )
    raw, raw_json = got.rates["raw"], got.rates["raw+json"]
    out = [
        row(f"stream refs/s, window {window}", rate, "refs/s", "raw PUSH/PULL, same frame bytes",
            raw, target=f">= {TARGET:g}", note=note)
        for window, rate in ((args.window, got.rates["stream"]), (args.window * 8, got.big))
    ]  # fmt: skip
    out.append(
        row(f"stream refs/s / raw + JSON, window {args.window * 8}", got.big, "refs/s",
            "raw PUSH/PULL + `SampleRef` JSON codec", raw_json, note=note)
    )  # fmt: skip
    for i, name in enumerate(("p50", "p99")):
        out.append(
            row(f"stream latency {name}", got.latency["stream"][i], "ms",
                f"raw PUSH/PULL + `SampleRef` JSON codec {name}", got.latency["raw+json"][i],
                note=note)
        )  # fmt: skip
    return out


def report(args: argparse.Namespace) -> str:
    got = measure(args)
    rates, big, lat = got.rates, got.big, got.latency
    raw, raw_json = rates["raw"], rates["raw+json"]
    rows = [
        (
            f"`ZmqRefSender` -> `ZmqRefReceiver`, window {args.window}",
            _report.fmt_rate(rates["stream"]),
            _report.fmt_ratio(rates["stream"] / raw),
            _report.fmt_ratio(rates["stream"] / raw_json),
        ),
        (
            f"`ZmqRefSender` -> `ZmqRefReceiver`, window {args.window * 8}",
            _report.fmt_rate(big),
            _report.fmt_ratio(big / raw),
            _report.fmt_ratio(big / raw_json),
        ),
        ("raw PUSH/PULL, same frame bytes", _report.fmt_rate(raw), "1.00x", ""),
        ("raw PUSH/PULL + `SampleRef` JSON codec", _report.fmt_rate(raw_json), "", "1.00x"),
    ]
    table = _report.markdown_table(["path", "refs/s", "vs raw", "vs raw + JSON"], rows)
    lat_rows = [
        (name, f"{p50:.2f}", f"{p99:.2f}")
        for name, (p50, p99) in (
            ("`ZmqRefSender` -> `ZmqRefReceiver`", lat["stream"]),
            ("raw PUSH/PULL + `SampleRef` JSON codec", lat["raw+json"]),
        )
    ]
    lat_table = _report.markdown_table(["path", "p50 ms", "p99 ms"], lat_rows)
    best = max(rates["stream"], big)
    verdict = "meets" if best >= TARGET * raw else "misses"
    return (
        f"{_report.today()}, 2-core machine ({_report.machine()}). One producer process, one "
        f"consumer process, {args.refs:,} refs of {payload_bytes()} bytes per frame, "
        f"credited in batches of {BATCH}; best of {args.repeats}.\n\n"
        f"{table}\n\n"
        f"Latency of {args.latency_refs:,} refs offered at {args.rate:,.0f} refs/s:\n\n"
        f"{lat_table}\n\n"
        f"The stream runs at {best / raw:.0%} of raw PUSH/PULL of the same bytes, so it "
        f"{verdict} the target of {TARGET:.0%}, and at {best / raw_json:.2f}x raw PUSH/PULL "
        "that carries the same refs as JSON. Raw PUSH/PULL moves bytes it never looks at; "
        "every ref on our path is encoded with the tensor-free check, decoded and validated "
        "into a `SampleRef` in Python, which costs several microseconds per ref on each side, "
        "while the credit protocol adds about one frame per window's eighth of refs.\n"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refs", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--latency-refs", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: proves it runs")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.refs, args.repeats, args.latency_refs = 2000, 1, 500
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    body = report(args)
    print(body)
    if args.write_docs:
        _report.write_section("Streams", body)
    return body


if __name__ == "__main__":
    main(sys.argv[1:])
