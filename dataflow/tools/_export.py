"""Export a run to Parquet (for analysis in pandas, DuckDB, Spark ...).

The events table has one row per event of one sample: a batch row of the ledger (a
lease, ack, nack or release of many samples, schema 4) is written as the rows of one
sample it stands for (``dataflow.model._events.expand_row``), so a query by sample id
reads the same from any ledger.

Two tables: the run's events, one row each, and, with ``samples_path``, the state of
each committed sample at the end of the log (the fold of the same events).
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from dataflow.interfaces._durable import fsync_path
from dataflow.model._events import Kind, expand_row

if TYPE_CHECKING:
    from dataflow.recorder._ledger import Ledger
    from dataflow.tools._progress import Progress

SCHEMA = pa.schema(
    [
        ("seq", pa.int64()),
        ("kind", pa.string()),
        ("sample_id", pa.string()),
        ("revision", pa.int32()),
        ("epoch", pa.int32()),
        ("step", pa.int64()),
        ("actor", pa.string()),
        ("payload", pa.string()),
        ("ts", pa.float64()),
    ]
)
#: One row per committed sample, in commit order. ``state``: one of
#: dataflow.tools._samples.SAMPLE_STATES; ``commit_seq`` and ``producer``: the commit of its
#: newest ``revision``; ``reason``: why it is dead or lost; ``excluded``: why it was excluded
#: (null: it is not).
SAMPLES_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("state", pa.string()),
        ("revision", pa.int32()),
        ("attempts", pa.int32()),
        ("trained_step", pa.int64()),
        ("leased_by", pa.string()),
        ("released", pa.bool_()),
        ("reason", pa.string()),
        ("commit_seq", pa.int64()),
        ("producer", pa.string()),
        ("excluded", pa.string()),
    ]
)
_BATCH = 50_000


def samples_path_for(path: str | os.PathLike[str]) -> Path:
    """Where ``export`` writes the per-sample table beside ``path``: ``X.samples.parquet``."""
    target = Path(path)
    stem = target.name.removesuffix(".parquet")
    return target.with_name(f"{stem}.samples.parquet")


def export_parquet(
    ledger: Ledger,
    run_id: str,
    path: str | os.PathLike[str],
    *,
    samples_path: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> int:
    """Write every event of ``run_id`` to ``path`` atomically; return the number of rows
    written (one per sample a batch row names: see the module's docstring).

    With ``samples_path``, also write the state of each committed sample there (one
    row each, SAMPLES_SCHEMA), folded from the same pass over the log; both files
    appear together, at the end. Streams in batches, so the events never sit in
    memory at once. Payloads stay JSON text. Each path must name a file in an existing
    directory that is new or an earlier export (IsADirectoryError, FileNotFoundError,
    FileExistsError before anything is written): never the ledger, or any other file.
    ``progress`` is called with the seq reached after each batch.
    """
    targets = [_check_target(path)]
    if samples_path is not None:
        targets.append(_check_target(samples_path))
        if targets[1].absolute() == targets[0].absolute():
            raise FileExistsError(
                errno.EEXIST,
                f"cannot export the events and the samples to the same file {str(path)!r}",
            )
    # Unique per call: two exports to one target (threads of one process too) never share one.
    tmps = [t.with_name(f".{t.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}") for t in targets]
    state = None
    if samples_path is not None:
        from dataflow.model._fold import RunState

        state = RunState(run_id, ref_source=ledger)
    commits: dict[str, tuple[int, str]] = {}  # sample id -> (seq, producer) of its newest
    count = 0
    try:
        with pq.ParquetWriter(tmps[0], SCHEMA) as writer:
            batch: list[tuple[Any, ...]] = []
            for row in ledger.rows(run_id):
                batch.append(tuple(row))
                if state is not None and row[1] == Kind.COMMIT:
                    commits[row[2]] = (row[0], row[6])
                if len(batch) >= _BATCH:
                    count += _write_events(writer, batch, state, progress)
                    batch = []
            if batch or count == 0:
                count += _write_events(writer, batch, state, progress)
        if state is not None:
            _write_samples(tmps[1], state, commits)
        for tmp, target in zip(tmps, targets, strict=True):
            fsync_path(tmp)
            os.replace(tmp, target)
            fsync_path(target.parent, directory=True)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
    return count


def _check_target(path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(
            errno.EISDIR,
            f"cannot export to {str(target)!r}: it is a directory; name the file to write, "
            f"e.g. {target / 'events.parquet'}",
        )
    if not target.absolute().parent.is_dir():
        raise FileNotFoundError(
            errno.ENOENT,
            f"cannot export to {str(target)!r}: its directory {target.absolute().parent} "
            "does not exist; create it first",
        )
    if target.exists() and not _is_parquet(target):
        # Only an earlier export is replaced: the path may name the ledger itself.
        raise FileExistsError(
            errno.EEXIST,
            f"cannot export to {str(target)!r}: it exists and is not a Parquet file (a "
            "ledger, or another program's file?); name a new file, or remove that one first",
        )
    return target


def _is_parquet(path: Path) -> bool:
    """Whether ``path`` holds a Parquet file: its magic bytes at both ends."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(-4, os.SEEK_END)
            return head == b"PAR1" and f.read(4) == b"PAR1"
    except OSError:  # shorter than 8 bytes, or unreadable
        return False


def _write_events(
    writer: pq.ParquetWriter,
    batch: list[tuple[Any, ...]],
    state: Any,
    progress: Progress | None,
) -> int:
    rows = [one for row in batch for one in expand_row(row)]
    writer.write_table(_table(rows, SCHEMA))
    if state is not None:
        state.apply_rows(batch)
    if progress is not None and batch:
        progress(batch[-1][0])
    return len(rows)


def _write_samples(path: Path, state: Any, commits: dict[str, tuple[int, str]]) -> None:
    from dataflow.tools._samples import sample_rows

    names = SAMPLES_SCHEMA.names
    with pq.ParquetWriter(path, SAMPLES_SCHEMA) as writer:
        batch: list[tuple[Any, ...]] = []
        written = 0
        for row in sample_rows(state):
            row["commit_seq"], row["producer"] = commits.get(row["sample_id"], (None, None))
            batch.append(tuple(row[name] for name in names))
            if len(batch) >= _BATCH:
                writer.write_table(_table(batch, SAMPLES_SCHEMA))
                written, batch = written + len(batch), []
        if batch or written == 0:
            writer.write_table(_table(batch, SAMPLES_SCHEMA))


def _table(rows: list[tuple[object, ...]], schema: pa.Schema) -> pa.Table:
    columns = list(zip(*rows, strict=True)) if rows else [[] for _ in schema.names]
    return pa.table(
        {
            name: pa.array(list(col), type=schema.field(name).type)
            for name, col in zip(schema.names, columns, strict=True)
        },
        schema=schema,
    )
