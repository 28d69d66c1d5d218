"""Deletes from a Mooncake store, in the order that leaves something ``scan`` lists.

A removal takes the head (while it names the generation), then the tensors,
then the record: a process that dies at any moment of it leaves the record
behind for as long as anything of the generation is stored, which ``scan``
lists and a collector frees (``dataflow gc``).
"""

from __future__ import annotations

from dataflow import CorruptFeatureError
from dataflow.interfaces import StoredObject
from dataflow.model import SampleRef
from stores import _tensors
from stores._mooncake_io import _Io


class _Deletes:
    """``delete`` of a ref and ``delete_stored`` of what ``scan`` listed."""

    def __init__(self, io: _Io) -> None:
        self._io = io

    def delete(self, ref: SampleRef) -> None:
        names = [name for name in sorted(ref.specs) if _tensors.nbytes(ref.specs[name])]
        self._remove_generation(ref.sample_id, ref.generation, names)

    def delete_stored(self, obj: StoredObject) -> bool:
        io = self._io
        key = io.keys.record(obj.sample_id, obj.generation)
        if io.client.removals.is_pending(key):
            return False  # this process is removing it already
        record = io.read_record(key, obj.sample_id)
        if record is None:
            return self._remove_leftovers(obj.sample_id, obj.generation)
        if record.generation != obj.generation:
            raise CorruptFeatureError(
                f"{key}: the record of sample {obj.sample_id!r} names generation "
                f"{record.generation}; it is corrupt: remove the keys under "
                f"{key.removesuffix('@')} from Mooncake by hand"
            )
        self._remove_generation(obj.sample_id, obj.generation, record.names)
        return True

    def _remove_generation(self, sample_id: str, generation: int, names: list[str]) -> None:
        """Remove the head while it names the generation, then its tensors, then its record."""
        io = self._io
        client = io.client
        keys = io.keys.generation(sample_id, generation, names)
        with client.id_locks([io.keys.head(sample_id)]):
            io.drop_head(sample_id, generation)
        if not client.removals.is_pending(keys[0]):
            client.removals.remove_generations([keys])

    def _remove_leftovers(self, sample_id: str, generation: int) -> bool:
        """Remove what is stored of a generation that has no record (what ``scan`` lists as a
        leftover): its tensors, and the head while it names it. Whether anything went.

        Tensors under a read lease stay, for a later collection to find again.
        """
        io = self._io
        client = io.client
        with client.id_locks([io.keys.head(sample_id)]):
            dropped = io.drop_head(sample_id, generation)
        pattern = io.keys.tensors_pattern(sample_id, generation)
        removed = client.call(client.raw.remove_by_regex, pattern, False)
        return dropped or removed > 0
