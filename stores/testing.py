"""The FeatureStore conformance suite: the whole store contract as pytest tests.

Subclass :class:`FeatureStoreContract` in a test module and supply the store::

    from stores.testing import FeatureStoreContract

    class TestMyStore(FeatureStoreContract):
        def make_store(self, tmp_path):
            return MyStore(tmp_path / "store")

A store that keeps bytes at rest (files, a remote store) also implements
:meth:`FeatureStoreContract.rewrite_stored_bytes`, so that the suite checks
that bytes changed behind its back raise CorruptFeatureError; without it those
tests skip. Likewise :meth:`FeatureStoreContract.failing_puts` (make the store's
puts fail after a few, as a broken disk would) lets the suite check that a
``put_many`` failing midway keeps none of its generations. Every built-in store
runs it (``tests/test_store_*.py``). The class name has no ``Test`` prefix, so
pytest collects it only through a subclass.
"""

from __future__ import annotations

import pytest

from stores._contract._cases import (
    DTYPES,
    INVALID_SAMPLE_IDS,
    LOOKALIKE_SAMPLE_IDS,
    UNSTORABLE_TENSORS,
    assert_same_tensor,
    assert_same_tensors,
    sample_tensor,
)
from stores._contract._generations import GenerationSuite
from stores._contract._get import GetSuite
from stores._contract._lifecycle import ClosedStoreSuite, ReopenSuite
from stores._contract._partial_reads import PartialReadSuite
from stores._contract._put import PutSuite
from stores._contract._put_many import PutManySuite
from stores._contract._scan import ScanSuite
from stores._contract._threads import ThreadSuite

__all__ = [
    "DTYPES",
    "INVALID_SAMPLE_IDS",
    "LOOKALIKE_SAMPLE_IDS",
    "UNSTORABLE_TENSORS",
    "FeatureStoreContract",
    "assert_same_tensor",
    "assert_same_tensors",
    "sample_tensor",
]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
class FeatureStoreContract(
    PutSuite,
    GetSuite,
    PartialReadSuite,
    GenerationSuite,
    PutManySuite,
    ScanSuite,
    ThreadSuite,
    ClosedStoreSuite,
    ReopenSuite,
):
    """The contract of :class:`dataflow.FeatureStore`, for a subclass to run on its store.

    A subclass implements :meth:`make_store`; the ``store`` fixture closes
    what it made after each test.


    The tests come from one suite per concern (``stores._contract``): puts,
    gets, partial reads, generations and stale refs, ``put_many``, listing,
    threads, closed stores and reopening.
    """
