"""The public surface is deliberate: exported names are a promise to users."""

from __future__ import annotations

import subprocess
import sys

import dataflow
import dataflow.streams
import dataflow.testing
import eval as eval_pkg
import stores
import stores.testing
import training

REQUIRED = {
    "Ledger",
    "Producer",
    "Consumer",
    "replay",
    "SampleRef",
    "FeatureSpec",
    "DataflowError",
    "StaleEpochError",
    "ProducerFencedError",
    "InvalidSampleIdError",
    "TensorInRefError",
    "NotALedgerError",
    "InvalidIdError",
    "InvalidCheckpointPathError",
    "Watermarks",
    "RunMetrics",
    "MetricsServer",
    "serve_metrics",
}


def test_required_names_are_exported() -> None:
    assert set(dataflow.__all__) >= REQUIRED
    assert {"FeatureStore", "LocalFeatureStore", "lend_memory"} <= set(stores.__all__)
    for name in dataflow.__all__:
        assert hasattr(dataflow, name), name


def test_all_is_sorted() -> None:
    for module in (dataflow, dataflow.streams, dataflow.testing, stores, eval_pkg, training):
        assert list(module.__all__) == sorted(module.__all__), module.__name__


def test_every_error_derives_from_the_root() -> None:
    errors = [getattr(dataflow, n) for n in dataflow.__all__ if n.endswith("Error")]
    assert len(errors) > 10
    for error in errors:
        assert issubclass(error, dataflow.DataflowError), error
    assert issubclass(dataflow.TensorInRefError, TypeError)
    assert issubclass(dataflow.InvalidSampleIdError, ValueError)
    assert issubclass(dataflow.StaleRefError, KeyError)
    assert issubclass(dataflow.StoreFullError, MemoryError)
    assert issubclass(dataflow.NotALedgerError, dataflow.LedgerError)
    assert issubclass(dataflow.InvalidCheckpointPathError, dataflow.LedgerError)
    assert issubclass(dataflow.InvalidCheckpointPathError, ValueError)
    assert issubclass(dataflow.InvalidIdError, ValueError)
    assert issubclass(dataflow.InvalidArgumentError, ValueError)
    assert issubclass(dataflow.ArgumentTypeError, TypeError)
    assert issubclass(dataflow.CommitOutcomeUnknownError, dataflow.OperationalError)
    assert issubclass(dataflow.LedgerFilesReplacedError, dataflow.OperationalError)
    assert issubclass(dataflow.ReadOnlyLedgerError, dataflow.LedgerError)


def test_layering() -> None:
    """dataflow never imports training or eval; eval imports neither dataflow nor stores."""
    code = (
        "import sys, dataflow, dataflow.cli, stores\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('training', 'eval')]\n"
        "assert not bad, bad\n"
        "import eval\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('training',)]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
