"""Export a run's log to Parquet (for analysis in pandas, DuckDB, Spark ...)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from dataflow._durable import fsync_path

if TYPE_CHECKING:
    from dataflow._ledger import Ledger

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
_BATCH = 50_000


def export_parquet(ledger: Ledger, run_id: str, path: str | os.PathLike[str]) -> int:
    """Write every event of ``run_id`` to ``path`` atomically; return the number of events.

    Streams in batches, so memory stays bounded for long runs. Payloads stay
    JSON text. ``path`` must name a file in an existing directory
    (IsADirectoryError, FileNotFoundError before anything is written).
    """
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
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    count = 0
    try:
        with pq.ParquetWriter(tmp, SCHEMA) as writer:
            batch: list[tuple[object, ...]] = []
            for row in ledger.rows(run_id):
                batch.append(tuple(row))
                if len(batch) >= _BATCH:
                    writer.write_table(_table(batch))
                    count += len(batch)
                    batch = []
            if batch or count == 0:
                writer.write_table(_table(batch))
                count += len(batch)
        fsync_path(tmp)
        os.replace(tmp, target)
        fsync_path(target.parent, directory=True)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def _table(rows: list[tuple[object, ...]]) -> pa.Table:
    columns = list(zip(*rows, strict=True)) if rows else [[] for _ in SCHEMA.names]
    return pa.table(
        {
            name: pa.array(list(col), type=SCHEMA.field(name).type)
            for name, col in zip(SCHEMA.names, columns, strict=True)
        },
        schema=SCHEMA,
    )
