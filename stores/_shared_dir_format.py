"""The file format of the shared directory store: one file per sample generation.

File format (little endian)::

    b"DFFEAT02" | u64 header length | u64 generation | u64 header xxh3 | header JSON
    | zero pad | tensor bytes

The header is ``{"sample_id": ..., "data_bytes": ..., "tensors": {name: {"dtype",
"shape", "offset", "nbytes", "xxh3"}}}``. The data starts at the first 64-byte
aligned offset after the header; tensor offsets count from there, each 64-byte
aligned, tensors in name order (see :mod:`stores._tensors`). ``xxh3`` is the
XXH3-64 of a tensor's bytes (16 hex digits); the header xxh3 covers magic,
length, generation and header JSON. A header that fails its checksum, or names
another sample, is corruption; only an intact header of another generation
means the ref's generation is gone (stale).

A file is written whole once its generation is chosen (:func:`sealed_head`), then
linked or renamed into place (``SharedDirFeatureStore._put_file``).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import msgspec
import torch
import xxhash

from dataflow import CorruptFeatureError
from dataflow.model import FeatureSpec, SampleRef
from stores import _tensors

MAGIC = b"DFFEAT02"
_MAGIC_FAMILY = b"DFFEAT"
_PREFIX = struct.Struct("<8sQQQ")
_SUMMED = struct.Struct("<8sQQ")  # what the header xxh3 covers, with the header JSON
_HEADER_READ = 4096
_MAX_HEADER = 64 << 20
_IOV_MAX = 512
_encode_json = msgspec.json.Encoder().encode
_ZEROS = memoryview(bytes(_tensors.ALIGN))
_FIX = "delete the file and put the sample again (regenerate it); refs to it cannot be read"


def _corrupt(path: str, sample_id: str | None, what: str) -> CorruptFeatureError:
    sample = "of an unknown sample" if sample_id is None else f"of sample {sample_id!r}"
    return CorruptFeatureError(f"{path} ({sample}): {what}; the file is corrupt: {_FIX}")


def _header_checksum(header: bytes, generation: int) -> int:
    """XXH3-64 of everything before the data but the checksum itself."""
    return xxhash.xxh3_64_intdigest(_SUMMED.pack(MAGIC, len(header), generation) + header)


# -- writing -------------------------------------------------------------------
#: A tensor's name, shape and dtype, for each tensor of a sample in the order given.
LayoutKey = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


class FileLayout:
    """What the files of samples with the same specs share: their specs, where each
    tensor goes and the pads between them.

    A producer's samples mostly share their specs, so a put works this out once for many
    (``SharedDirFeatureStore._layout``) and only hashes, heads and writes each file.
    """

    def __init__(self, key: LayoutKey, checksums: bool) -> None:
        #: The specs, in the order given (a ref's, and the header's).
        self.specs = {name: _spec(shape, dtype) for name, shape, dtype in key}
        self.checksums = checksums
        self._spans = _tensors.layout(self.specs)
        #: The tensors' names in the order the file holds their bytes (by name).
        self.names = list(self._spans)
        #: Bytes of data after the header: the tensors, each aligned.
        self.data_bytes = _tensors.end_of(self._spans.values())
        #: ``pads[i]``: the zeros after the i-th tensor of ``names``.
        spans = list(self._spans.values())
        ends = [offset for offset, _ in spans[1:]] + [self.data_bytes] * bool(spans)
        self.pads = [
            _ZEROS[: end - (offset + nbytes)]
            for (offset, nbytes), end in zip(spans, ends, strict=True)
        ]

        #: Where each checksum of the header (in the order of ``specs``) is in ``sums``.
        self._sum_order = [self.names.index(name) for name in self.specs] if checksums else []
        self._cuts = self._cut_header()

    def header(self, sample_id: str, sums: list[str]) -> bytes:
        """The header JSON of ``sample_id`` with ``sums``, the checksums of the tensors in
        the order of ``names`` (none without checksums)."""
        if self._cuts is None:
            return self._encoded(sample_id, sums)
        cuts = self._cuts
        pieces = [cuts[0], _encode_json(sample_id)]
        for cut, at in zip(cuts[1:], self._sum_order, strict=False):  # cuts: one more
            pieces += (cut, b'"%s"' % sums[at].encode())
        pieces.append(cuts[-1])
        return b"".join(pieces)

    def _encoded(self, sample_id: str, sums: list[str]) -> bytes:
        named = dict(zip(self.names, sums, strict=True)) if self.checksums else {}
        return _header(sample_id, self.specs, self._spans, self.data_bytes, named)

    def _cut_header(self) -> list[bytes] | None:
        """The header JSON of these specs cut where the sample id and each checksum go
        (the bytes that are the same in every sample's), or None where it cannot be cut
        cleanly: then each header is encoded whole, as ``_encoded`` does.

        Encoding each header's dict was a third of the Python of a put."""
        marks = [b'"@%d@"' % i for i in range(len(self._sum_order) + 1)]
        text = self._encoded(
            "@0@", [f"@{1 + self._sum_order.index(i)}@" for i in range(len(self._sum_order))]
        )
        cuts, rest = [], text
        for mark in marks:
            before, found, rest = rest.partition(mark)
            if not found or b"@" in before:
                return None
            cuts.append(before)
        cuts.append(rest)
        self._cuts = cuts
        sums = [f"{i:016x}" for i in range(len(self._sum_order))]
        return cuts if self.header("a", sums) == self._encoded("a", sums) else None


def _spec(shape: tuple[int, ...], dtype: torch.dtype) -> FeatureSpec:
    """``FeatureSpec(tuple(shape), dtype)`` of a tensor's own, without its checks."""
    spec = object.__new__(FeatureSpec)
    object.__setattr__(spec, "shape", tuple(shape))
    object.__setattr__(spec, "dtype", dtype)
    return spec


def file_pieces(
    sample_id: str, arrays: list[Any], layout: FileLayout
) -> tuple[bytes, list[Any], int]:
    """A new file of ``sample_id`` but for its first bytes: its header JSON, the buffers
    that follow the header (pads and tensor bytes), and the file's size;
    :func:`sealed_head` gives the first bytes once the generation is chosen.

    ``arrays``: the tensors' bytes (:func:`array_of`), in the order of ``layout.names``.
    """
    sums = [_tensors.checksum(array) for array in arrays] if layout.checksums else []
    header = layout.header(sample_id, sums)
    position = _PREFIX.size + len(header)
    start = _tensors.align(position)
    pieces: list[Any] = [_ZEROS[: start - position]]
    for array, pad in zip(arrays, layout.pads, strict=True):
        pieces += (array, pad)
    return header, pieces, start + layout.data_bytes


def array_of(tensor: torch.Tensor) -> Any:
    """The bytes of ``tensor`` (CPU or not, any layout in memory) as a C-contiguous numpy
    array: the tensor's own where it is a plain contiguous CPU tensor of a dtype numpy has
    (without a copy), else a uint8 view of a dense copy (bfloat16, float8, complex32, a
    strided view, a tensor that needs grad or lives on a GPU)."""
    try:
        array = tensor.numpy()
        if array.flags.c_contiguous:
            return array
    except (TypeError, RuntimeError):  # a dtype numpy lacks, a GPU, grad, a conj bit
        pass
    return _tensors.byte_view(_tensors.dense(tensor)).numpy()


def sealed_head(header: bytes, generation: int) -> bytes:
    """The first bytes of the file of ``header`` and ``generation``: magic, lengths,
    generation, the header's checksum, then the header JSON."""
    checksum = _header_checksum(header, generation)
    return _PREFIX.pack(MAGIC, len(header), generation, checksum) + header


def _header(
    sample_id: str,
    specs: dict[str, FeatureSpec],
    spans: dict[str, tuple[int, int]],
    data_bytes: int,
    sums: dict[str, str | None],
) -> bytes:
    tensors = {
        name: {
            "dtype": _tensors.dtype_str(spec.dtype),
            "shape": list(spec.shape),
            "offset": spans[name][0],
            "nbytes": spans[name][1],
            "xxh3": sums.get(name),
        }
        for name, spec in specs.items()
    }
    doc = {"sample_id": sample_id, "data_bytes": data_bytes, "tensors": tensors}
    # The compact JSON that json.dumps(separators=(",", ":")) writes, at a sixth of its cost.
    return _encode_json(doc)


def writev_all(fd: int, buffers: list[Any], nbytes: int) -> None:
    """Write ``buffers`` (``nbytes`` in all) at ``fd``'s offset, after short writes too."""
    written = 0
    if len(buffers) <= _IOV_MAX:
        written = os.writev(fd, buffers)
        if written == nbytes:
            return  # the usual: one call wrote it all
    views = [view for view in (memoryview(b).cast("B") for b in buffers) if view.nbytes]
    while True:  # after a short write: skip what went, write the rest
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if not views:
            return
        if written:
            views[0] = views[0][written:]
        written = os.writev(fd, views[:_IOV_MAX])


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write ``data`` at ``offset`` of ``fd``, after short writes too."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


# -- reading -------------------------------------------------------------------
def current_generation(path: str, sample_id: str) -> int:
    """Generation in ``path``; 0 when there is none, or a corrupt one (so replaceable)."""
    return file_generation(path, sample_id)[1]


def file_generation(path: str, sample_id: str) -> tuple[bool, int]:
    """Whether anything is at ``path`` (a file, or what a hand put there), and the
    generation it holds: 0 when there is none, or a corrupt one (so replaceable)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False, 0
    try:
        return True, read_sealed(fd, path, sample_id)[0]
    except CorruptFeatureError:
        return True, 0
    finally:
        os.close(fd)


def read_sealed(fd: int, path: str, sample_id: str | None) -> tuple[int, bytes, int]:
    """(generation, header JSON, where it ends) of a file whose header passes its checksum.

    ``sample_id`` (None: unknown) only names the sample in errors.
    """
    try:
        head = os.pread(fd, _HEADER_READ, 0)
    except IsADirectoryError:
        # A directory in place of the file (made by hand): corrupt, so that a get
        # names it and a trainer counts the sample lost, and a put may replace it.
        raise CorruptFeatureError(
            f"{path} should be the file of "
            f"{'a sample' if sample_id is None else f'sample {sample_id!r}'} but is a "
            "directory: remove it and put the sample again"
        ) from None
    if len(head) < _PREFIX.size:
        raise _corrupt(path, sample_id, f"truncated ({len(head)} bytes, no header)")
    magic, length, generation, written = _PREFIX.unpack_from(head)
    if magic != MAGIC and magic[:6] == _MAGIC_FAMILY:
        raise _corrupt(
            path,
            sample_id,
            f"file format version {magic[6:].decode(errors='replace')}, this dataflow reads "
            f"only version {MAGIC[6:].decode()} (files with checksums)",
        )
    if magic != MAGIC or length > _MAX_HEADER:
        raise _corrupt(path, sample_id, "not a dataflow feature file (bad magic or header)")
    end = _PREFIX.size + length
    if end > len(head):
        head += os.pread(fd, end - len(head), len(head))
    if end > len(head):
        raise _corrupt(path, sample_id, "truncated inside its header")
    raw = head[_PREFIX.size : end]
    if _header_checksum(raw, generation) != written:
        raise _corrupt(
            path,
            sample_id,
            "its header (sample id, generation, tensor table) fails its checksum",
        )
    return generation, raw, end


def read_header(fd: int, path: str, sample_id: str | None) -> tuple[int, dict[str, Any]]:
    """(generation, header) of an intact file of ``sample_id`` (None: of any sample)."""
    generation, raw, end = read_sealed(fd, path, sample_id)
    try:
        header = json.loads(raw)
        if not isinstance(header["tensors"], dict) or not isinstance(header["data_bytes"], int):
            raise TypeError("bad field types")
    except (ValueError, KeyError, TypeError) as exc:
        raise _corrupt(path, sample_id, f"unreadable header: {exc}") from exc
    if sample_id is not None and header.get("sample_id") != sample_id:
        raise _corrupt(path, sample_id, f"its header names sample {header.get('sample_id')!r}")
    header["start"] = _tensors.align(end)
    size, actual = header["start"] + header["data_bytes"], os.fstat(fd).st_size
    if actual < size:
        raise _corrupt(path, sample_id, f"truncated: {actual} bytes, its header says {size}")
    return generation, header


def check_header(header: dict[str, Any], ref: SampleRef, names: list[str], path: str) -> None:
    for name in names:
        entry = header["tensors"].get(name)
        spec = ref.specs[name]
        if (
            not isinstance(entry, dict)
            or entry.get("dtype") != _tensors.dtype_str(spec.dtype)
            or entry.get("shape") != list(spec.shape)
        ):
            raise _corrupt(
                path,
                ref.sample_id,
                f"feature {name!r} is {entry!r} on disk, the ref says "
                f"{_tensors.dtype_str(spec.dtype)} {list(spec.shape)}",
            )
        nbytes, offset = _tensors.nbytes(spec), entry.get("offset")
        if (
            entry.get("nbytes") != nbytes
            or not isinstance(offset, int)
            or not 0 <= offset <= header["data_bytes"] - nbytes
        ):
            raise _corrupt(path, ref.sample_id, f"feature {name!r} has a bad extent {entry!r}")


def read_tensor(
    fd: int,
    target: Any,
    header: dict[str, Any],
    ref: SampleRef,
    name: str,
    path: str,
    *,
    checksums: bool,
) -> None:
    """Read feature ``name`` into ``target`` (a uint8 numpy array); verify it if ``checksums``."""
    entry = header["tensors"][name]
    offset = header["start"] + entry["offset"]
    view = memoryview(target)
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise _corrupt(path, ref.sample_id, f"truncated at byte {offset}")
        view, offset = view[got:], offset + got
    if checksums:
        _tensors.verify(
            target, entry.get("xxh3"), sample_id=ref.sample_id, name=name, where=path, fix=_FIX
        )
