"""Consumer memory: a full in-flight window against its bytes, and a long run's fold.

Window. A producer (this process) pushes samples of 1 MiB (one float32 feature)
through a ``SharedDirFeatureStore`` on a real disk, a SQLite ledger and a
ZeroMQ stream to a consumer process whose receiver grants a window of ``W``
refs. The consumer runs a ``FeatureLoader`` (batches of 8, prefetching) and
keeps every batch without acking, so it ends holding its whole window, loaded.
Its peak resident set (``VmHWM``, reset once it is set up: ``/proc/self/clear_refs``)
less its resident set at that point is set against ``W`` times a sample's bytes:
what any consumer holding those features must keep. Above 1x: collating a batch
stacks it (the batch twice, briefly), and the batch read ahead.

Finished samples. A live consumer trains samples as a producer process commits them (at
most ``_BACKLOG`` ahead), acking and releasing each (policy ``on_ack``), on a SQLite
ledger; its anonymous resident set (``RssAnon``: the ledger file's mapped pages are not
the consumer's) grows by this much per finished sample, with
``Consumer.forget_finished`` against without it.

Fold. The resident set of a consumer restarted on a run of 10^6 committed samples
(10^4 with ``quick``), as ``bench_restart.consumer_memory`` measures it, per
committed sample over the process's resident set after its imports, against a
plain Python set of the run's sample ids in a fresh process: the least a consumer
that must not train a sample twice keeps.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.connection
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from benchmarks import bench_restart
from benchmarks._rows import Row, row
from benchmarks._runner import tiny
from dataflow.live._ports import loopback_port

SAMPLE_SHAPE = (256, 1024)  # float32: 1 MiB
SAMPLE_BYTES = 256 * 1024 * 4
BATCH = 8
RUN_ID = "memory"
WAIT_S = 300.0
MiB = 2**20


def window_size(*, quick: bool) -> int:
    if tiny():
        return 8
    return 32 if quick else 64


def fold_samples(*, quick: bool) -> int:
    if tiny():
        return 2_000
    return 10_000 if quick else 1_000_000


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


def _reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True


# -- the window -----------------------------------------------------------------------------
def _window_consumer(cfg: dict[str, Any], pipe: Any) -> None:
    import torch

    from dataflow import Consumer, Ledger
    from dataflow.streams import ReceiverConfig, ZmqRefReceiver
    from stores import SharedDirFeatureStore
    from training import FeatureLoader, LoaderConfig

    torch.set_num_threads(1)
    receiver = ZmqRefReceiver(
        ReceiverConfig(endpoint=cfg["endpoint"], window=cfg["window"], idle_timeout=WAIT_S)
    )
    consumer = Consumer(
        Ledger.open(cfg["ledger"]),
        SharedDirFeatureStore(cfg["store"]),
        run_id=RUN_ID,
        consumer_id="consumer",
        stream=receiver,
    )
    consumer.resume()
    reset = _reset_peak()
    base = _status("VmRSS")
    pipe.send("ready")
    config = LoaderConfig(batch_size=cfg["batch"], prefetch=cfg["prefetch"])
    held = list(FeatureLoader(consumer, config=config))
    pipe.send(
        {
            "samples": sum(len(b) for b in held),
            "bytes": sum(t.nbytes for b in held for t in b.features.values()),
            "base": base,
            "peak": _status("VmHWM"),
            "rss": _status("VmRSS"),
            "reset": reset,
        }
    )
    consumer.close()


def _wait(pipe: Any, child: Any, what: str) -> Any:
    """The child's next message; an error as soon as it died or timed out instead."""
    if pipe not in mp.connection.wait([pipe, child.sentinel], WAIT_S):
        raise RuntimeError(f"the window consumer did not {what} (exit code {child.exitcode})")
    return pipe.recv()


def measure_window(
    workdir: Path, window: int, *, batch: int = BATCH, prefetch: int = 1
) -> dict[str, Any]:
    """Fill a consumer's window of ``window`` samples; what its process reported."""
    import torch

    from dataflow import Ledger, Producer
    from dataflow.streams import SenderConfig, ZmqRefSender
    from stores import SharedDirFeatureStore

    cfg = {
        "endpoint": f"tcp://127.0.0.1:{loopback_port()}",
        "window": window,
        "batch": batch,
        "prefetch": prefetch,
        "ledger": f"sqlite:///{workdir / 'window.db'}",
        "store": str(workdir / "features"),
    }
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_window_consumer, args=(cfg, theirs))
    child.start()
    try:
        _wait(ours, child, "start")
        ledger = Ledger.open(cfg["ledger"])
        store = SharedDirFeatureStore(cfg["store"])
        sender = ZmqRefSender(SenderConfig(endpoints=(cfg["endpoint"],), send_timeout=WAIT_S))
        producer = Producer(ledger, store, run_id=RUN_ID, stream=sender)
        x = torch.randn(SAMPLE_SHAPE)
        # Exactly one window: all of it fits the credit, so the consumer ends holding it all.
        producer.emit_many([(f"s{i:05d}", {"x": x}) for i in range(window)])
        sender.close()
        producer.close()
        got = _wait(ours, child, "report")
        store.close()
        ledger.close()
    finally:
        child.join(WAIT_S)
        if child.is_alive():
            child.kill()
            child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the window consumer exited with {child.exitcode}")
    if got["samples"] != window:
        raise RuntimeError(f"the consumer held {got['samples']} samples, not its window {window}")
    return got


def window_row(got: dict[str, Any], window: int) -> Row:
    extra = got["peak"] - got["base"]
    note = (
        f"window of {window} samples of 1 MiB, batches of {BATCH}, prefetch 1: peak "
        f"{got['peak'] / MiB:.0f} MiB resident, {got['base'] / MiB:.0f} MiB before the first "
        f"lease, {got['rss'] / MiB:.0f} MiB holding the window"
    )
    if not got["reset"]:
        note += " (VmHWM could not be reset: the peak may predate the window)"
    return row(
        "consumer peak memory holding its full window, over its resident set before",
        extra / MiB,
        "MiB",
        "the window's feature bytes",
        window * SAMPLE_BYTES / MiB,
        target="<= 1.5",
        note=note,
    )


# -- the fold of a long run --------------------------------------------------------------------
_IDS = textwrap.dedent(
    """
    import sys
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    n = int(sys.argv[1])
    before = rss()
    ids = {f"sample-{i:09d}" for i in range(n)}
    print((rss() - before) / n)
    """
)


def ids_bytes_per_sample(samples: int) -> float:
    """Resident bytes per id of a set of ``samples`` sample ids (bench_ledger's), fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _IDS, str(samples)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip())


def fold_row(workdir: Path, samples: int) -> Row:
    rss, base = bench_restart.consumer_memory(workdir, samples)
    verdict = "met" if rss < 256 * MiB else "missed"
    note = (
        f"about {samples:,} committed samples ({samples * 3:,} events), restarted from a "
        f"snapshot: {rss / MiB:.0f} MiB resident, {base / MiB:.0f} MiB after imports "
        f"(budget < 256 MiB at 10^6 samples: {verdict})"
    )
    return row(
        "consumer memory per committed sample (the fold)",
        (rss - base) / samples,
        "B/sample",
        "a Python set of the sample ids",
        ids_bytes_per_sample(samples),
        note=note,
    )


# -- finished samples in a live fold -----------------------------------------------------------
_BACKLOG = 8_000  # committed and not yet acked, at most: what a live run keeps in flight


def finished_samples(*, quick: bool) -> int:
    return 20_000 if quick else 200_000


def _finishing_producer(url: str, samples: int, acked: Any) -> None:
    from benchmarks.bench_ledger import bench_ref
    from dataflow import Ledger, Producer
    from stores import LocalFeatureStore

    with Ledger.open(url, create=False) as ledger, LocalFeatureStore() as store:
        producer = Producer(ledger, store, run_id=RUN_ID, producer_id="p")
        for start in range(0, samples, 1_000):
            while start - acked.value > _BACKLOG:
                time.sleep(0.002)
            end = min(samples, start + 1_000)
            producer.commit([bench_ref(f"p-sample-{i:09d}") for i in range(start, end)])
        producer.close()


def _finishing_consumer(url: str, samples: int, forget: bool, pipe: Any) -> None:
    import logging

    from dataflow import Consumer, Ledger
    from stores import LocalFeatureStore

    # bench_ref's refs name a store no process holds: their deletes fail, and say so.
    logging.disable(logging.CRITICAL)
    with Ledger.open(url, create=False) as ledger, LocalFeatureStore() as store:
        consumer = Consumer(ledger, store, run_id=RUN_ID, consumer_id="c", release_policy="on_ack")
        consumer.forget_finished = forget
        consumer.resume()
        gc.collect()
        base = _status("RssAnon")
        ctx = mp.get_context("fork")
        acked = ctx.Value("q", 0, lock=False)
        producer = ctx.Process(target=_finishing_producer, args=(url, samples, acked))
        producer.start()
        done, step, half, deadline = 0, 0, None, time.monotonic() + WAIT_S
        while done < samples and time.monotonic() < deadline:
            refs = consumer.lease(512, timeout=0.2)
            if refs:
                step += 1
                consumer.ack(refs, step=step)
                done += len(refs)
                acked.value = done
                if not half and done >= samples // 2:
                    gc.collect()
                    half = (done, _status("RssAnon"))
        producer.join(WAIT_S)
        gc.collect()
        pipe.send({"done": done, "base": base, "half": half, "end": _status("RssAnon")})
        consumer.close()


def measure_finished(workdir: Path, samples: int, *, forget: bool) -> dict[str, Any]:
    """A consumer process's anonymous memory before and after ``samples`` finished samples."""
    from dataflow import Ledger

    url = f"sqlite:///{workdir / f'finished-{int(forget)}.db'}"
    Ledger.open(url).close()
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_finishing_consumer, args=(url, samples, forget, theirs))
    child.start()
    try:
        got = _wait(ours, child, "report")
    finally:
        child.join(WAIT_S)
    if got["done"] != samples:
        raise RuntimeError(f"the consumer finished {got['done']} samples, not {samples}")
    return got


def finished_row(workdir: Path, samples: int) -> Row:
    forgets = measure_finished(workdir, samples, forget=True)
    keeps = measure_finished(workdir, samples, forget=False)
    # Over the second half: what each further sample costs, once the samples in flight
    # (and the allocator's pools they leave behind) are in the resident set.
    per = {
        k: (g["end"] - g["half"][1]) / (samples - g["half"][0])
        for k, g in (("f", forgets), ("k", keeps))
    }
    note = (
        f"{samples:,} samples committed, trained and released (at most {_BACKLOG:,} in flight), "
        f"SQLite; over the second half; anonymous resident set {forgets['base'] / MiB:.0f} -> "
        f"{forgets['end'] / MiB:.0f} MiB forgetting, {keeps['base'] / MiB:.0f} -> "
        f"{keeps['end'] / MiB:.0f} MiB keeping them"
    )
    return row(
        "live consumer memory per finished sample, forget_finished",
        per["f"],
        "B/sample",
        "the same consumer keeping every sample",
        per["k"],
        target="<= 0.1",
        note=note,
    )


def rows(workdir: Path, *, quick: bool) -> list[Row]:
    window = window_size(quick=quick)
    (workdir / "window").mkdir()
    got = measure_window(workdir / "window", window)
    # Not under --tiny: a slope over a few thousand samples is noise, not a figure.
    finished = [] if tiny() else [finished_row(workdir, finished_samples(quick=quick))]
    return [window_row(got, window), *finished, fold_row(workdir, fold_samples(quick=quick))]


if __name__ == "__main__":
    from benchmarks._runner import main

    sys.exit(main(["--only", "memory", *sys.argv[1:]]))
