"""The one error tree of dataflow, stores and streams.

Every error a user can see derives from :class:`DataflowError`; where a
builtin category fits, the error also derives from it, so ``except KeyError``
keeps working around a store lookup::

    DataflowError
    ├── InvalidSampleIdError (ValueError)
    ├── InvalidRefError (ValueError)
    ├── InvalidIdError (ValueError)            a bad run, producer or consumer id
    ├── TensorInRefError (TypeError)
    ├── InvalidArgumentError (ValueError)      an argument of a call has a bad value
    ├── ArgumentTypeError (TypeError)          an argument of a call has the wrong type
    ├── PeerFailedError                        a call all ranks make together failed on another
    ├── LedgerError
    │   ├── NotALedgerError                    nothing at the URL, or it is not a ledger
    │   ├── InvalidCheckpointPathError (ValueError)  missing, or not a file or directory
    │   ├── CorruptLedgerError                 an event that cannot be read, or names another sample
    │   ├── SchemaVersionError
    │   ├── LedgerStateError (ValueError)      a write the run's state forbids
    │   │   ├── UnknownCheckpointError (LookupError)
    │   │   └── UnknownSampleError (LookupError)  an exclude or include named an
    │   │                                      uncommitted sample (or, include, one not excluded)
    │   ├── StaleEpochError                    a fenced-off (zombie) consumer wrote
    │   ├── ReadOnlyLedgerError                a write through a ledger opened read_only=True,
    │   │                                      or one on a read-only file system opened to write
    │   ├── ProducerFencedError                another process took this producer's id
    │   ├── IntegrityError                     a database constraint refused a write
    │   └── OperationalError                   the database could not be reached or used
    │       ├── CommitOutcomeUnknownError      it failed while committing: the write may have landed
    │       └── LedgerFilesReplacedError       a SQLite ledger's file (-wal, -shm, the database)
    │                                          was deleted or replaced while it was open
    ├── StoreError
    │   ├── UnknownStoreError (ValueError)     a URI scheme nobody registered
    │   ├── StoreDependencyError (ImportError) a store's package or binary is missing
    │   ├── StoreClosedError
    │   ├── StaleRefError (KeyError)           the ref's generation is gone or superseded
    │   ├── StoreFullError (MemoryError)
    │   ├── CorruptFeatureError                stored bytes differ from what was put
    │   └── StoreUnavailableError (ConnectionError)
    └── StreamError
        ├── BadFrameError (ValueError)
        ├── BackpressureError (TimeoutError)   every credit window stayed full, or a
        │                                      producer's backlog is at its high watermark
        ├── StreamIdleError (TimeoutError)     nothing arrived within the idle timeout
        └── ProducerLostError                  a producer stopped heart-beating

Database driver errors are mapped into this tree in exactly one place,
:func:`dataflow.recorder._db.translate_errors`.
"""

from __future__ import annotations


class DataflowError(Exception):
    """Root of every error raised by dataflow, stores and streams."""


class InvalidSampleIdError(DataflowError, ValueError):
    """A sample id is not a string of 1-256 characters from ``[A-Za-z0-9._:/-]``."""


class InvalidRefError(DataflowError, ValueError):
    """A SampleRef or its JSON form is malformed (bad field type, non-JSON metadata)."""


class InvalidIdError(DataflowError, ValueError):
    """A run, producer or consumer id is not 1-256 printable characters without outer spaces.

    Control characters (NUL, tab, newline, DEL ...) are refused: an id is
    printed by the CLI and compared byte for byte, and an invisible character
    would make two different runs look alike.
    """


class TensorInRefError(DataflowError, TypeError):
    """A tensor was found inside a ref or its metadata; refs must stay tensor-free."""


class InvalidArgumentError(DataflowError, ValueError):
    """An argument of a dataflow call has a value it cannot take; the message names it."""


class ArgumentTypeError(DataflowError, TypeError):
    """An argument of a dataflow call has the wrong type; the message names it."""


class PeerFailedError(DataflowError):
    """A call that every rank makes together (``Consumer.checkpoint``, ``Consumer.resume``)
    failed on another rank; that rank raised its own error, and this one raises this
    instead of waiting for it in a collective. Call it again on every rank."""


class LedgerError(DataflowError):
    """Base of errors raised by the ledger."""


class NotALedgerError(LedgerError):
    """There is no ledger at the URL, or the file or database there is not one.

    Raised when opening: a missing file where nothing may be created
    (``Ledger.open(url, create=False)``), an existing file that is empty, not
    a SQLite database, or a database without the dataflow tables. Such a file
    is never initialized over: it may be a ledger that lost its data.
    """


class InvalidCheckpointPathError(LedgerError, ValueError):
    """A checkpoint path does not exist, is not a file or directory, or has a ``..`` part."""


class CorruptLedgerError(LedgerError):
    """The ledger holds an event that cannot be read, or that contradicts its own row.

    A damaged or hand-edited database: a commit whose ref names another sample,
    a payload that is not the JSON its kind needs. Nothing is written on top of
    it; ``replay(...).verify()`` lists every such event with its seq.
    """


class SchemaVersionError(LedgerError):
    """The ledger database was written by a newer (or unknown) schema version."""


class LedgerStateError(LedgerError, ValueError):
    """A write that the run's current state forbids (ack of a sample never leased, ...)."""


class UnknownCheckpointError(LedgerStateError, LookupError):
    """A resume named a checkpoint that the run's ledger does not record."""


class UnknownSampleError(LedgerStateError, LookupError):
    """An exclude named a sample the run never committed, or an include one not excluded."""


class StaleEpochError(LedgerError):
    """A consumer wrote with an epoch older than the run's current one (it was fenced)."""


class ReadOnlyLedgerError(LedgerError):
    """A write through a ledger opened with ``Ledger.open(..., read_only=True)``, or
    a SQLite ledger on a read-only file system opened for writing.

    Nothing was written; open the ledger without ``read_only`` to write. A
    SQLite ledger on a read-only file system can only be opened read-only.
    """


class ProducerFencedError(LedgerError):
    """A producer wrote after another process claimed its producer id (it was fenced)."""


class IntegrityError(LedgerError):
    """The database refused a write that breaks one of its constraints."""


class OperationalError(LedgerError):
    """The database could not be reached, was locked for too long, or failed."""


class CommitOutcomeUnknownError(OperationalError):
    """The database failed while committing a write: it may or may not have landed.

    A connection lost during COMMIT leaves the client unable to tell whether the
    server committed. Read the ledger back before acting as if it did not;
    ``Producer.commit`` does so itself and keeps the features meanwhile.
    """


class LedgerFilesReplacedError(OperationalError):
    """A SQLite ledger's ``-wal``, ``-shm`` or database file was deleted or replaced
    while a process had the ledger open.

    SQLite keeps the commits not yet checkpointed in the ``-wal`` file and finds
    them through the ``-shm`` file; a process that holds the deleted ones writes
    where no other process looks, and one that opens the ledger afterwards makes
    new ones that the first process's close would fold over or unlink. So a write
    through such a connection is refused (nothing written), and so is opening a
    ledger whose ``-shm`` is gone while another process holds it. Stop every
    process of the ledger (close, not kill: the last close folds its WAL into the
    database), then open it again; ``dataflow replay --verify`` shows what remains.
    """


class StoreError(DataflowError):
    """Base of errors raised by feature stores."""


class UnknownStoreError(StoreError, ValueError):
    """No store is registered for a URI's scheme."""


class StoreDependencyError(StoreError, ImportError):
    """A store needs a package or program that is not installed; the message says how."""


class StoreClosedError(StoreError):
    """The store was used after ``close()``."""


class StaleRefError(StoreError, KeyError):
    """The features a ref names are gone: deleted, or superseded by a newer generation."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StoreFullError(StoreError, MemoryError):
    """A put would exceed the store's byte bound."""


class CorruptFeatureError(StoreError):
    """Stored features differ from what was put: truncated or malformed (short read,
    bad header), failing a checksum (a flipped or zeroed byte), a header or head that
    names another sample, or a format version this dataflow does not read.

    The message names the sample, the feature where one is to blame, and the file or
    Mooncake key, and says what to do: the sample must be put again (regenerated).
    Not a StaleRefError: a ref whose generation was deleted or superseded raises that.
    """


class StoreUnavailableError(StoreError, ConnectionError):
    """The store's server (e.g. a Mooncake master) cannot be reached."""


class StreamError(DataflowError):
    """Base of errors raised by ref streams."""


class BadFrameError(StreamError, ValueError):
    """A stream frame is malformed, oversized, of an unknown version, or holds a tensor."""


class BackpressureError(StreamError, TimeoutError):
    """Consumers are not keeping up, and the caller would not (or could not) wait.

    Raised by a stream's ``send`` when every consumer's credit window stayed
    full for the whole send timeout, and by ``Producer.emit`` / ``emit_many``
    with ``backpressure=Watermarks(...)`` when the run's un-trained features
    in the store are at the high mark and ``block=False`` was passed or the
    ``timeout`` ran out; then nothing was stored or committed. A StreamError
    (and a TimeoutError) in both cases, so one ``except`` serves either.
    """


class StreamIdleError(StreamError, TimeoutError):
    """Nothing arrived on a stream within its idle timeout."""


class ProducerLostError(StreamError):
    """A producer stopped sending heartbeats without closing its stream.

    ``producer_id`` names it (None where the raiser did not say). Its committed refs
    stay in the ledger: a consumer that goes on leasing trains them once it is back,
    or from the ledger once the stream ends.
    """

    def __init__(self, *args: object, producer_id: str | None = None) -> None:
        super().__init__(*args)
        self.producer_id = producer_id
