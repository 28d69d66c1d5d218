"""The base of every suite of the contract: the store under test and how to reach it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from dataflow.interfaces import FeatureStore, StoredObject
from dataflow.model import SampleRef


class StoreSuite:
    """What each suite of the contract needs: :meth:`make_store` (which a subclass
    implements), the ``store`` fixture that closes what it made, and
    :meth:`rewrite_stored_bytes` for stores that keep bytes at rest."""

    def make_store(self, tmp_path: Path) -> FeatureStore:
        raise NotImplementedError("a FeatureStoreContract subclass implements make_store")

    def rewrite_stored_bytes(
        self, store: FeatureStore, ref: SampleRef, name: str, change: Callable[[bytearray], None]
    ) -> None:
        """Change the stored bytes of feature ``name`` of ``ref`` behind the store's back.

        ``change`` edits the bytes in place. A store that keeps bytes at rest
        (files, a remote store) implements this, and the contract then checks
        that a get notices; the default skips those tests, as fits a store of
        live tensors in process memory.
        """
        pytest.skip(f"{type(self).__name__} keeps no bytes at rest (no rewrite_stored_bytes)")

    def failing_puts(self, store: FeatureStore, after: int) -> AbstractContextManager[None]:
        """A context in which ``store`` stores ``after`` sample generations and then
        fails at the next one (with an OSError or a DataflowError), as a disk or a
        server that breaks in the middle of a batch.

        A store implements it with what fails there (a rename, a write, a round trip);
        the default skips the tests that need it.
        """
        pytest.skip(f"{type(self).__name__} cannot make its puts fail (no failing_puts)")

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[FeatureStore]:
        made = self.make_store(tmp_path)
        try:
            yield made
        finally:
            made.close()

    def _listed(self, store: FeatureStore, ids: set[str]) -> dict[str, StoredObject]:
        listed: dict[str, StoredObject] = {}
        for obj in store.scan():
            assert isinstance(obj, StoredObject), obj
            if obj.sample_id in ids:
                assert obj.sample_id not in listed, f"{obj.sample_id} listed twice"
                listed[obj.sample_id] = obj
        return listed
