"""Feature store benchmark: put + get of one sample, each store beside its peers.

For samples of 1, 16 and 256 MiB (one float32 tensor plus a small int64 one),
each contender writes the sample and reads it back into fresh memory:

* ``SharedDirFeatureStore`` against raw file I/O of the same bytes with the
  same crash safety (write a temporary file, fsync, rename, fsync the
  directory; read into fresh memory): the floor; and ``torch.save``/
  ``torch.load`` files and safetensors files, fsynced too, in one directory;
* ``MooncakeFeatureStore`` (zero-copy) against Mooncake ``put``/``get`` of
  ``torch.save`` bytes, both on one client of a local master over TCP;
* ``LocalFeatureStore`` ``get``, which must not grow with the sample;
* what the checksums cost: each store again with its checksums switched off
  (``_checksums = False``, a switch for benchmarks only), and the XXH3-64 of
  the sample's bytes alone, twice (once for the put, once for the get), as a
  share of our put + get.

Contenders are interleaved (repetition i of each before repetition i + 1 of
any, in a seeded random order per round, so that no contender always follows
the same one: a fixed rotation flattered ours by 6-10%), each after one
untimed warm-up; the medians of
put and of get count. A get counts until every page of what it returned has been touched
(safetensors maps files lazily); deleting what a repetition wrote is not
timed. Ratios are throughput ratios, ours over theirs.

Run: ``python -m benchmarks.bench_stores [--out FILE.md] [--dir DIR] [--sizes 1,16,256]
[--no-mooncake] [--write-docs]``; :func:`rows` gives the rows of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import xxhash

from benchmarks import _report
from benchmarks._rows import Row, row
from dataflow import SampleRef, StoreDependencyError
from dataflow.interfaces._durable import fsync_path
from stores import LocalFeatureStore, MooncakeFeatureStore, SharedDirFeatureStore
from stores.mooncake_master import MooncakeMaster, find_master_binary

try:
    import safetensors.torch
except ImportError:  # an optional peer: its rows are left out, and the notes say so
    safetensors = None

SIZES_MIB = (1.0, 16.0, 256.0)
_MiB = 1 << 20
#: Ours ÷ contender, in throughput, that the issue asks for.
TARGETS = {"raw": 0.8, "torch.save": 1.5, "pickle": 2.0, "pickle, batched": 2.0}
#: What the checksums may add to a put + get, at most (a share of it).
CHECKSUM_TARGET = 0.10
QUICK_SIZES_MIB, QUICK_SCALE = (1.0,), 0.25
#: Samples per batch, and the largest size, of the batched Mooncake rows (put_many +
#: get_many_into, what a producer's emit_many and a FeatureLoader do) against Mooncake's
#: batched bytes: the sizes where a master round trip weighs most.
BATCH, BATCHED_MAX_MIB = 16, 1.0

# Contenders, as the tables name them.
SHARED_DIR = "`SharedDirFeatureStore`"
RAW_FILE = "raw file: write, fsync, rename, fsync dir; read"
TORCH_FILES = "`torch.save` / `torch.load` files"
SAFETENSORS = "safetensors files"
SHARED_DIR_UNCHECKED = "`SharedDirFeatureStore`, checksums off"
MOONCAKE = "`MooncakeFeatureStore` (zero-copy)"
MOONCAKE_PICKLE = "Mooncake `put`/`get` of `torch.save` bytes"
MOONCAKE_UNCHECKED = "`MooncakeFeatureStore`, checksums off"
MOONCAKE_BATCHED = f"`MooncakeFeatureStore` `put_many` + `get_many_into`, {BATCH} a batch"
MOONCAKE_PICKLE_BATCHED = f"Mooncake `put_batch`/`get_batch` of `torch.save` bytes, {BATCH} a batch"
LOCAL = "`LocalFeatureStore`"
LOCAL_RAW = "raw copy of the tensors (`empty_like` + `copy_`)"
#: The contender each ratio line and target compares ours with.
PEERS = {"raw": RAW_FILE, "torch.save": TORCH_FILES, "safetensors": SAFETENSORS,
         "pickle": MOONCAKE_PICKLE, "pickle, batched": MOONCAKE_PICKLE_BATCHED}  # fmt: skip


@dataclass
class Contender:
    """``put(sample, i) -> handle``, ``get(handle) -> tensors``, ``drop(handle)`` (untimed);
    a put and a get of ``samples`` samples at a time (the times are per sample)."""

    name: str
    put: Callable[[dict[str, torch.Tensor], int], Any]
    get: Callable[[Any], Any]
    drop: Callable[[Any], None] = lambda handle: None
    samples: int = 1
    puts: list[float] = field(default_factory=list)
    gets: list[float] = field(default_factory=list)

    @property
    def put_s(self) -> float:
        return statistics.median(self.puts) / self.samples

    @property
    def get_s(self) -> float:
        return statistics.median(self.gets) / self.samples

    @property
    def round_trip_s(self) -> float:
        return self.put_s + self.get_s


def make_sample(size: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(max(size // 4, 1)), "label": torch.arange(8)}


def touch(tensors: dict[str, torch.Tensor]) -> None:
    for tensor in tensors.values():
        if tensor.numel():
            tensor.reshape(-1).view(torch.uint8)[::4096].sum()


def run(contenders: list[Contender], sample: dict[str, torch.Tensor], reps: int) -> None:
    rng = random.Random(0)
    for i in range(-1, reps):  # -1: the warm-up
        for contender in rng.sample(contenders, len(contenders)):
            start = time.perf_counter()
            handle = contender.put(sample, i)
            middle = time.perf_counter()
            out = contender.get(handle)
            touch(out)
            end = time.perf_counter()
            del out
            contender.drop(handle)
            if i >= 0:
                contender.puts.append(middle - start)
                contender.gets.append(end - middle)


# -- files ---------------------------------------------------------------------
def raw_put(directory: Path, sample: dict[str, torch.Tensor], i: int) -> Path:
    tmp, path = directory / f"raw-{i}.tmp", directory / f"raw-{i}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for tensor in sample.values():
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_path(directory)
    return path


def raw_get(path: Path) -> dict[str, torch.Tensor]:
    fd = os.open(path, os.O_RDONLY)
    try:
        out = torch.empty(os.fstat(fd).st_size, dtype=torch.uint8)
        view, offset = memoryview(out.numpy()), 0
        while view:
            got = os.preadv(fd, [view], offset)
            view, offset = view[got:], offset + got
        return {"bytes": out}
    finally:
        os.close(fd)


def torch_put(directory: Path, sample: dict[str, torch.Tensor], i: int) -> Path:
    path = directory / f"torch-{i}.pt"
    with open(path, "wb") as f:
        torch.save(sample, f)
        f.flush()
        os.fsync(f.fileno())
    return path


def safetensors_put(directory: Path, sample: dict[str, torch.Tensor], i: int) -> Path:
    path = directory / f"st-{i}.safetensors"
    safetensors.torch.save_file(sample, path)
    fsync_path(path)
    return path


def file_contenders(directory: Path) -> list[Contender]:
    store = SharedDirFeatureStore(directory / "store")
    unchecked = SharedDirFeatureStore(directory / "store-unchecked")
    unchecked._checksums = False
    contenders = [
        Contender(SHARED_DIR, lambda s, i: store.put(f"bench-{i}", s), store.get, store.delete),
        Contender(RAW_FILE, lambda s, i: raw_put(directory, s, i), raw_get, os.unlink),
        Contender(
            TORCH_FILES,
            lambda s, i: torch_put(directory, s, i),
            lambda p: torch.load(p, weights_only=True),
            os.unlink,
        ),
        Contender(
            SHARED_DIR_UNCHECKED,
            lambda s, i: unchecked.put(f"bench-{i}", s),
            unchecked.get,
            unchecked.delete,
        ),
    ]
    if safetensors is not None:
        contenders.append(
            Contender(
                SAFETENSORS,
                lambda s, i: safetensors_put(directory, s, i),
                safetensors.torch.load_file,
                os.unlink,
            )
        )
    return contenders


def local_contenders(store: LocalFeatureStore) -> list[Contender]:
    """``LocalFeatureStore`` put + get beside the one copy of the tensors its put makes."""
    return [
        Contender(LOCAL, lambda s, i: store.put(f"bench-{i}", s), store.get, store.delete),
        Contender(
            LOCAL_RAW,
            lambda s, i: {k: torch.empty_like(t).copy_(t) for k, t in s.items()},
            lambda copied: copied,
        ),
    ]


# -- Mooncake --------------------------------------------------------------------
def mooncake_contenders(
    store: MooncakeFeatureStore, unchecked: MooncakeFeatureStore
) -> list[Contender]:
    client = store._client  # the pickle path shares our client, segment and removal queue

    def pickle_put(sample: dict[str, torch.Tensor], i: int) -> str:
        key = f"bench-pickle/{i}/{time.time_ns()}"
        buffer = io.BytesIO()
        torch.save(sample, buffer)
        code = client.raw.put(key, buffer.getbuffer(), client.config)
        if code != 0:
            raise RuntimeError(f"Mooncake put of {key} failed with {code}")
        return key

    def pickle_get(key: str) -> dict[str, torch.Tensor]:
        return torch.load(io.BytesIO(client.raw.get(key)), weights_only=True)

    return [
        Contender(MOONCAKE, lambda s, i: store.put(f"bench-{i}", s), store.get, store.delete),
        Contender(
            MOONCAKE_PICKLE, pickle_put, pickle_get, lambda key: client.removals.remove([key])
        ),
        Contender(
            MOONCAKE_UNCHECKED,
            lambda s, i: unchecked.put(f"bench-{i}", s),
            unchecked.get,
            unchecked.delete,
        ),
    ]


def batched_contenders(store: MooncakeFeatureStore) -> list[Contender]:
    """Batches of BATCH samples: ours through ``put_many`` and ``get_many_into`` (into fresh
    tensors, as a loader's batch), Mooncake's own through ``put_batch``/``get_batch``."""
    client = store._client

    def ours_put(sample: dict[str, torch.Tensor], i: int) -> list[SampleRef]:
        return store.put_many([(f"bench-b{i}-{j}", sample) for j in range(BATCH)])

    def ours_get(refs: list[SampleRef]) -> dict[str, torch.Tensor]:
        outs = [
            {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in ref.specs.items()}
            for ref in refs
        ]
        store.get_many_into(list(zip(refs, outs, strict=True)))
        return {f"{j}/{name}": t for j, out in enumerate(outs) for name, t in out.items()}

    def pickle_put(sample: dict[str, torch.Tensor], i: int) -> list[str]:
        keys = [f"bench-pickle-b/{i}/{j}/{time.time_ns()}" for j in range(BATCH)]
        values = []
        for _ in keys:
            buffer = io.BytesIO()
            torch.save(sample, buffer)
            values.append(buffer.getbuffer())  # no copy, as the single put
        code = client.raw.put_batch(keys, values, client.config)
        if code != 0:
            raise RuntimeError(f"Mooncake put_batch of {len(keys)} keys failed with {code}")
        return keys

    def pickle_get(keys: list[str]) -> dict[str, torch.Tensor]:
        got = client.raw.get_batch(keys)
        samples = [torch.load(io.BytesIO(data), weights_only=True) for data in got]
        return {f"{j}/{name}": t for j, sample in enumerate(samples) for name, t in sample.items()}

    def drop_refs(refs: list[SampleRef]) -> None:
        for ref in refs:
            store.delete(ref)

    return [
        Contender(MOONCAKE_BATCHED, ours_put, ours_get, drop_refs, samples=BATCH),
        Contender(
            MOONCAKE_PICKLE_BATCHED,
            pickle_put,
            pickle_get,
            lambda keys: client.removals.remove(keys),
            samples=BATCH,
        ),
    ]


# -- report ----------------------------------------------------------------------
def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def fmt_size(mib: float) -> str:
    return f"{mib:g} MiB" if mib >= 1 else f"{mib * 1024:g} KiB"


def group_table(results: dict[float, list[Contender]]) -> str:
    rows = []
    for mib, contenders in results.items():
        size = sum(t.nbytes for t in make_sample(int(mib * _MiB)).values())
        ours = contenders[0]
        for contender in contenders:
            rows.append(
                (
                    fmt_size(mib),
                    contender.name,
                    fmt_ms(contender.put_s),
                    fmt_ms(contender.get_s),
                    f"{size / _MiB / contender.round_trip_s:,.0f}",
                    _report.fmt_ratio(contender.round_trip_s / ours.round_trip_s),
                )
            )
    headers = ["sample", "contender", "put ms", "get ms", "put+get MiB/s", "ours ÷ it"]
    return _report.markdown_table(headers, rows)


def named(contenders: list[Contender], name: str) -> Contender:
    return next(c for c in contenders if c.name == name)


def ratio_line(results: dict[float, list[Contender]], label: str) -> str:
    """Ours over PEERS[label] per size, and whether TARGETS[label] (if any) holds."""
    ratios = {
        mib: named(cs, PEERS[label]).round_trip_s / cs[0].round_trip_s
        for mib, cs in results.items()
    }
    line = f"- ours ÷ {label}: " + ", ".join(f"{fmt_size(m)} {r:.2f}x" for m, r in ratios.items())
    target = TARGETS.get(label)
    if target is None:
        return line
    missed = [fmt_size(m) for m, r in ratios.items() if r < target]
    verdict = f"missed at {', '.join(missed)}" if missed else "met"
    return f"{line} (target ≥ {target:g}x: {verdict})"


def xxh3_s(sample: dict[str, torch.Tensor], reps: int) -> float:
    """Median time of the XXH3-64 of every tensor of ``sample``, in place."""
    views = [t.reshape(-1).view(torch.uint8).numpy() for t in sample.values()]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for view in views:
            xxhash.xxh3_64_intdigest(view)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def checksum_line(results: dict[float, list[Contender]], unchecked: str, scale: float) -> str:
    """Checksum cost per size: ours ÷ ours without checksums (contender ``unchecked``), and
    the XXH3-64 of the sample's bytes, twice (put and get), as a share of our put + get.

    The target is judged on the latter: it is the same work, without the noise
    of two separate round trips on a shared machine.
    """
    parts, missed = [], []
    for mib, contenders in results.items():
        ours, without = contenders[0].round_trip_s, named(contenders, unchecked).round_trip_s
        hashing = 2 * xxh3_s(make_sample(int(mib * _MiB)), reps_for(mib, scale))
        share = hashing / ours
        parts.append(
            f"{fmt_size(mib)} {(ours / without - 1) * 100:+.1f}% measured, "
            f"xxh3 {fmt_ms(hashing)} ms = {share * 100:.1f}%"
        )
        if share > CHECKSUM_TARGET:
            missed.append(fmt_size(mib))
    verdict = f"missed at {', '.join(missed)}" if missed else "met"
    return (
        "- checksum cost (put+get with checksums ÷ without; the xxh3 of the same bytes, put "
        f"and get, as a share of put+get): {'; '.join(parts)} (target ≤ "
        f"{CHECKSUM_TARGET * 100:g}% of put+get: {verdict})"
    )


def local_table(sizes: list[float]) -> str:
    rows = []
    with LocalFeatureStore() as store:
        for mib in sizes:
            ref = store.put("local", make_sample(int(mib * _MiB)))
            times = []
            for _ in range(200):
                start = time.perf_counter()
                store.get(ref)
                times.append(time.perf_counter() - start)
            rows.append((fmt_size(mib), f"{statistics.median(times) * 1e6:,.1f}"))
    return _report.markdown_table(["sample", "`LocalFeatureStore.get` µs"], rows)


def machine(directory: Path) -> str:
    return (
        f"{os.cpu_count()} cores ({platform.machine()}, {platform.system()}, load average "
        f"{os.getloadavg()[0]:.1f} at the start), Python {platform.python_version()}, torch "
        f"{torch.__version__}; files on {filesystem(directory)} ({directory})"
    )


def filesystem(path: Path) -> str:
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            if str(path).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def reps_for(mib: float, scale: float) -> int:
    base = 41 if mib <= 1 else 15 if mib <= 16 else 7
    return max(1, round(base * scale))


Results = dict[float, list[Contender]]  # per sample size in MiB, ours first


def measure_files(sizes: list[float], scale: float, directory: Path) -> Results:
    results: Results = {}
    for mib in sizes:
        results[mib] = file_contenders(directory)
        run(results[mib], make_sample(int(mib * _MiB)), reps_for(mib, scale))
    return results


def bench_files(sizes: list[float], scale: float, directory: Path) -> list[str]:
    results = measure_files(sizes, scale, directory)
    lines = [group_table(results), "", ratio_line(results, "raw")]
    lines.append(ratio_line(results, "torch.save"))
    if safetensors is not None:
        lines.append(ratio_line(results, "safetensors"))
    else:
        lines.append("- safetensors is not installed: no safetensors rows")
    return [*lines, checksum_line(results, SHARED_DIR_UNCHECKED, scale)]


def prefault(store: MooncakeFeatureStore, segment: int) -> None:
    """Fill the segment once and empty it, so that no contender pays its first page faults."""
    client = store._client
    block = torch.empty(64 * _MiB, dtype=torch.uint8)
    keys = []
    for i in range(segment // block.nbytes + 1):
        if client.raw.put_from(f"warmup/{i}", block.data_ptr(), block.nbytes, client.config):
            break
        keys.append(f"warmup/{i}")
    client.raw.batch_remove(keys, True)


def mooncake_missing() -> str | None:
    """Why the Mooncake rows cannot run here, or None when they can."""
    try:
        import mooncake.store  # noqa: F401

        find_master_binary()
    except (ImportError, FileNotFoundError, StoreDependencyError) as exc:
        return str(exc)
    return None


def measure_mooncake(sizes: list[float], scale: float) -> tuple[Results, Results]:
    """Single puts and gets at each size, then batches at each size up to BATCHED_MAX_MIB."""
    largest = int(max(sizes) * _MiB) + _MiB
    segment = max(8 * largest, 256 * _MiB)
    results: dict[float, list[Contender]] = {}
    batched: dict[float, list[Contender]] = {}
    with MooncakeMaster(lease_ttl_ms=200) as master:
        store = MooncakeFeatureStore(
            master.master_address,
            metadata=master.metadata_url,
            namespace="bench",
            segment_size=segment,
            buffer_size=max(2 * largest, 64 * _MiB),  # the pickle path copies through it
        )
        # The same client (one per process and cluster), another namespace.
        unchecked = MooncakeFeatureStore(
            master.master_address, metadata=master.metadata_url, namespace="bench-unchecked"
        )
        unchecked._checksums = False
        try:
            prefault(store, segment)
            for mib in sizes:
                results[mib] = mooncake_contenders(store, unchecked)
                run(results[mib], make_sample(int(mib * _MiB)), reps_for(mib, scale))
            for mib in (m for m in sizes if m <= BATCHED_MAX_MIB):
                batched[mib] = batched_contenders(store)
                run(batched[mib], make_sample(int(mib * _MiB)), reps_for(mib, scale))
        finally:
            unchecked.close()
            store.close()
    return results, batched


def bench_mooncake(sizes: list[float], scale: float) -> list[str]:
    missing = mooncake_missing()
    if missing is not None:
        return [f"Skipped: {missing}"]
    results, batched = measure_mooncake(sizes, scale)
    lines = [
        group_table(results),
        "",
        ratio_line(results, "pickle"),
        checksum_line(results, MOONCAKE_UNCHECKED, scale),
    ]
    if batched:
        lines += ["", f"Batches of {BATCH} (times per sample):", "", group_table(batched), ""]
        lines.append(ratio_line(batched, "pickle, batched"))
    return lines


def measure_local(sizes: list[float], scale: float) -> Results:
    results: Results = {}
    with LocalFeatureStore() as store:
        for mib in sizes:
            results[mib] = local_contenders(store)
            run(results[mib], make_sample(int(mib * _MiB)), reps_for(mib, scale))
    return results


def throughput_rows(results: Results, backend: str, peer: str, label: str, note: str) -> list[Row]:
    """Our put + get MiB/s against ``peer``'s, per size; the target of ``label`` if any."""
    out = []
    for mib, contenders in results.items():
        size = sum(t.nbytes for t in make_sample(int(mib * _MiB)).values()) / _MiB
        target = TARGETS.get(label)
        out.append(
            row(
                f"store {backend} put+get / {label}, {fmt_size(mib)}",
                size / contenders[0].round_trip_s,
                "MiB/s",
                f"{named(contenders, peer).name}, {fmt_size(mib)}",
                size / named(contenders, peer).round_trip_s,
                target=None if target is None else f">= {target:g}",
                note=note,
            )
        )
    return out


def rows(
    workdir: Path,
    *,
    quick: bool,
    sizes: tuple[float, ...] | None = None,
    scale: float | None = None,
) -> list[Row]:
    """Put + get of each store against its peers (raw files, torch.save, safetensors, Mooncake's
    pickle path, one memory copy), per sample size; files in ``workdir``."""
    sizes_mib = list(sizes or (QUICK_SIZES_MIB if quick else SIZES_MIB))
    scale = scale if scale is not None else QUICK_SCALE if quick else 1.0
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_stores_") as tmp:
        load = os.getloadavg()[0]
        fs = f"files on {filesystem(Path(tmp))} ({workdir})"
        files = measure_files(sizes_mib, scale, Path(tmp))
    note = f"load average {load:.1f} at the start; medians of interleaved repetitions"
    file_note = f"{note}; {fs}; fsynced write + rename, read into fresh memory"
    out = [
        *throughput_rows(files, "dir://", RAW_FILE, "raw", file_note),
        *throughput_rows(files, "dir://", TORCH_FILES, "torch.save", file_note),
    ]
    if safetensors is not None:
        out += throughput_rows(files, "dir://", SAFETENSORS, "safetensors", file_note)
    else:
        out[-1] = replace(out[-1], note=f"{file_note}; safetensors is not installed: no row")
    missing = mooncake_missing()
    if missing is None:
        moon, batched = measure_mooncake(sizes_mib, scale)
        moon_note = f"{note}; one client, local master, loopback TCP"
        out += throughput_rows(moon, "mooncake://", MOONCAKE_PICKLE, "pickle", moon_note)
        out += throughput_rows(
            batched,
            "mooncake://",
            MOONCAKE_PICKLE_BATCHED,
            "pickle, batched",
            f"{moon_note}; batches of {BATCH}, MiB/s per sample",
        )
    else:
        out[-1] = replace(out[-1], note=f"{out[-1].note}; no mooncake:// rows: {missing}")
    local = measure_local(sizes_mib, scale)
    out += throughput_rows(local, "mem://", LOCAL_RAW, "copy", f"{note}; in process memory")
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_stores",
        description="Feature stores beside raw files, torch.save, safetensors and Mooncake bytes.",
    )
    parser.add_argument("--sizes", default="1,16,256", help="sample sizes in MiB (1,16,256)")
    parser.add_argument("--reps", type=float, default=1.0, help="scale the repetitions (1.0)")
    parser.add_argument(
        "--dir", type=Path, default=Path.cwd(),
        help="where the files go (default: the current directory; a real disk, not tmpfs)",
    )  # fmt: skip
    parser.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake rows")
    parser.add_argument("--out", type=Path, help="also write the report to this markdown file")
    parser.add_argument(
        "--write-docs", action="store_true", help="update the Stores section of docs/benchmarks.md"
    )
    parser.add_argument("--date", default=_report.today(), help="the date the report shows")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    sizes = [float(size) for size in args.sizes.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_stores_") as tmp:
        where = machine(Path(tmp))
        files = bench_files(sizes, args.reps, Path(tmp))
    command = " ".join(["python -m benchmarks.bench_stores", *argv])
    body = [f"{args.date}, {where}. `{command}`", "", "### Shared directory", "", *files]
    if not args.no_mooncake:
        body += [
            "",
            "### Mooncake (one client, local master, TCP)",
            "",
            *bench_mooncake(sizes, args.reps),
        ]
    body += ["", "### LocalFeatureStore", "", local_table(sizes)]
    body += ["", f"The whole run took {time.perf_counter() - started:.0f} s."]
    text = "\n".join(body)
    print(f"## Benchmarks\n\n{text}")
    if args.out:
        args.out.write_text(f"## Benchmarks\n\n{text}\n")
    if args.write_docs:
        _report.write_section("Stores", text)
    return text


if __name__ == "__main__":
    main()
