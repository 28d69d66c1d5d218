"""FeatureStore: the interface every store implements.

Public methods validate their input and then call a private hook (``_put``,
``_get`` ...) that a backend overrides; a backend never overrides the public
methods, because that would bypass the guards (id validation, closed checks,
the tensor-free rule).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from dataflow.interfaces._copy import copy
from dataflow.model._errors import (
    InvalidRefError,
    StoreClosedError,
    StoreError,
)
from dataflow.model._refs import (
    SampleRef,
    dtype_name,
    validate_feature_name,
    validate_metadata,
    validate_sample_id,
)


@dataclass(frozen=True)
class StoreStats:
    """What a store holds now: stored objects (sample generations) and their tensor bytes.

    It counts everything stored, whether or not the ledger references it. A
    store cannot know the ledger, so the features that a producer put but never
    committed (it was killed between put and commit, or its transaction rolled
    back) stay stored as orphans and are counted here until they are deleted;
    the coming ``dataflow gc`` deletes what no ledger references, from the
    list that ``FeatureStore.scan`` gives.
    """

    objects: int
    bytes: int


@dataclass(frozen=True)
class StoredObject:
    """One sample generation that a store holds, as ``FeatureStore.scan`` lists it.

    ``nbytes`` counts its tensor bytes (as ``SampleRef.nbytes`` does);
    ``created`` is when it was put, in seconds since the epoch (wall clock),
    so that a garbage collector can spare what is younger than a grace period:
    a producer puts its features before it commits their ref to the ledger.
    """

    sample_id: str
    generation: int
    nbytes: int
    created: float

    def __post_init__(self) -> None:
        validate_sample_id(self.sample_id)
        for name in ("generation", "nbytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidRefError(f"StoredObject.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.created, (int, float)) or isinstance(self.created, bool):
            raise InvalidRefError(f"StoredObject.created must be seconds, got {self.created!r}")
        object.__setattr__(self, "created", float(self.created))


class FeatureStore(ABC):
    """Holds feature tensors by sample id; hands out tensor-free SampleRefs.

    Contract (checked by ``stores.testing.FeatureStoreContract``):

    * ``put`` accepts tensors of every torch dtype that torch can copy: bool,
      the signed and unsigned integers of 8 to 64 bits, float16, bfloat16,
      float32, float64, the float8 and float4 dtypes, complex32/64/128 and the
      ``bits*`` dtypes; on any device but ``meta``; non-contiguous, 0-d and
      empty ones too. It returns a ref whose specs describe every tensor. Each
      put of the same id gets a new, larger generation.
    * ``put`` refuses with InvalidRefError (a ValueError), before anything is
      stored, what no store can round-trip as raw bytes: quantized dtypes
      (qint8, quint8, qint32, quint4x2, quint2x4: their scale and zero point are
      not in their bytes), the sub-byte shell dtypes that torch cannot copy
      (uint1-uint7, int1-int7), meta tensors (no data), nested tensors, layouts
      other than strided (sparse, mkldnn ...), and tensor subclasses that
      override ``__torch_dispatch__`` (FakeTensor, DTensor ...: their data is
      not their own memory).
    * ``put_many`` puts several samples as that many ``put`` calls would, in
      order (a repeated id: the later item supersedes the earlier), and a
      store may batch them (Mooncake does: a few round trips for the whole
      batch). It checks every sample before it stores any, and if it raises,
      none of the generations it put stays stored.
    * ``get(ref)`` returns the tensors of exactly that generation; a ref to a
      deleted or superseded generation raises StaleRefError (a KeyError).
      ``names`` restricts the read to some features. ``get_into(ref, out)``
      reads the same bytes into tensors the caller gives (checked against the
      ref's specs first).
    * ``delete(ref)`` is idempotent and never frees a newer generation.
    * ``scan()`` lists what the store holds, one StoredObject (sample id,
      generation, tensor bytes, when it was put) per stored sample generation,
      for a garbage collector that compares it with the ledger. It lists the
      current generation of every sample, and also a generation that no get
      can read but that still takes space, where a store can hold one (in
      Mooncake: a put whose process died before it made its generation
      current, or that lost a race with another process's put of the same
      id). Deleted and superseded generations are not listed, except by a
      store that frees them lazily, until it has (Mooncake frees an object
      only after its read lease). It is a generator and no snapshot: it is
      safe while other threads and processes put and delete (what is deleted
      meanwhile is skipped, what is put meanwhile may or may not show), it
      holds bounded memory where the backend allows (the shared directory:
      constant), and it never leaves the store (no symlink is followed).
    * ``delete_stored(obj)`` frees the generation a scan listed, without its
      ref, and only that generation: when the sample was put again since,
      the newer generation stays. It returns True when it freed it (or began
      to), False when the store no longer held it. A collector deletes what
      no committed ref names, and only what is older than a grace period:
      ``created`` is before the producer's commit.
    * Invalid sample ids raise InvalidSampleIdError; ids never become a path
      or a key unescaped. Nothing is pickled.
    * All methods are thread-safe; after ``close()`` they raise StoreClosedError.

    Backends implement the private hooks ``_put``, ``_get``, ``_delete``,
    ``_exists`` and ``_scan``; optionally ``_put_many`` (by default ``_put``
    per sample), ``_get_into`` (by default ``_get`` and a copy),
    ``_get_many_into`` (by default ``_get_into`` per item),
    ``_delete_stored`` (by default ``_delete`` of a ref without specs, which
    suits a store whose ``_delete`` needs only the sample id and the
    generation), ``_stats`` (by default summed over ``_scan``) and
    ``_close``.
    """

    #: URI that reopens this store through ``stores.open_store``.
    uri: str

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def open_uri(self) -> str:
        """``uri`` with the settings another process needs to collect this store
        (``dataflow gc``), such as Mooncake's admin address; a producer records it
        with the run. By default ``uri`` itself."""
        return self.uri

    # -- public, guarded ---------------------------------------------------
    def put(
        self,
        sample_id: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> SampleRef:
        """Store ``tensors`` under ``sample_id`` as a new generation; return its ref."""
        self._check_open()
        return self._put(*self._check_sample(sample_id, tensors, metadata))

    def put_many(self, samples: Iterable[tuple[Any, ...]]) -> list[SampleRef]:
        """Put ``(sample_id, tensors)`` or ``(sample_id, tensors, metadata)`` items; their refs.

        The same as a ``put`` of each item in order, in fewer round trips
        where the store can batch. Every item is checked before any is stored;
        if it raises, none of the generations it put stays stored (a sample
        whose previous generation one of them superseded is then gone, as
        after a put and a delete).
        """
        self._check_open()
        if isinstance(samples, (str, bytes, Mapping)):
            raise InvalidRefError(
                f"put_many takes (sample_id, tensors[, metadata]) items, got {samples!r:.80}"
            )
        items = []
        for item in samples:
            if not isinstance(item, tuple) or len(item) not in (2, 3):
                raise InvalidRefError(
                    f"put_many takes (sample_id, tensors[, metadata]) tuples, got {item!r:.80}"
                )
            items.append(self._check_sample(*item))
        return self._put_many(items) if items else []

    def get(self, ref: SampleRef, *, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Return the tensors of ``ref`` (only ``names`` when given)."""
        self._check_open()
        self._check_ref(ref)
        if names is None:
            wanted = list(ref.specs)
        else:
            if isinstance(names, str):
                raise InvalidRefError(f"names must be a collection of names, got the str {names!r}")
            wanted = list(names)
            unknown = [n for n in wanted if n not in ref.specs]
            if unknown:
                raise InvalidRefError(
                    f"features {unknown} are not in ref {ref.sample_id!r}; "
                    f"it has {sorted(ref.specs)}"
                )
        return self._get(ref, wanted)

    def get_into(self, ref: SampleRef, out: Mapping[str, torch.Tensor]) -> None:
        """Read the features of ``ref`` named in ``out`` into its tensors, in place.

        Each ``out[name]`` must be a contiguous CPU tensor of the feature's dtype
        and shape, not a lazy conjugate or negative view (a row of a batch tensor
        qualifies), so a loader can read a
        batch's samples straight into the batch, without a tensor per sample
        and a copy to stack them. The same checks and errors as :meth:`get`
        (StaleRefError, CorruptFeatureError); after an error the tensors hold
        unspecified bytes.
        """
        self._check_open()
        self._get_into(ref, self._checked_out(ref, out))

    def get_many_into(self, items: Iterable[tuple[SampleRef, Mapping[str, torch.Tensor]]]) -> None:
        """:meth:`get_into` of each ``(ref, out)`` item, in fewer round trips where the
        store can batch (Mooncake reads a whole batch in one).

        Every item is checked before any is read. A failed read raises the
        error that ``get_into`` of its item would (the first, in item order,
        for a store that reads one at a time); after an error every item's
        tensors hold unspecified bytes, so a caller that must know which
        samples are readable reads them one by one with ``get_into``.
        """
        self._check_open()
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
            raise InvalidRefError(
                f"get_many_into takes (ref, out) items, got {type(items).__name__}"
            )
        checked = []
        for item in items:
            if not isinstance(item, tuple) or len(item) != 2:
                raise InvalidRefError(f"get_many_into takes (ref, out) pairs, got {item!r:.80}")
            ref, out = item
            checked.append((ref, self._checked_out(ref, out)))
        if checked:
            self._get_many_into(checked)

    def delete(self, ref: SampleRef) -> None:
        """Free ``ref``'s generation; deleting twice or deleting a gone ref is a no-op."""
        self._check_open()
        self._check_ref(ref)
        self._delete(ref)

    def exists(self, ref: SampleRef) -> bool:
        """True while ``ref``'s generation is stored."""
        self._check_open()
        self._check_ref(ref)
        return self._exists(ref)

    def scan(self) -> Iterator[StoredObject]:
        """Yield a StoredObject for every sample generation the store holds, lazily.

        Orphans included: this is what ``dataflow gc`` compares with the
        ledger. What is deleted while the scan runs is skipped; the scan
        raises StoreClosedError at its next item once the store is closed.
        """
        self._check_open()
        return self._guarded_scan(iter(self._scan()))

    def delete_stored(self, obj: StoredObject) -> bool:
        """Free the generation that ``scan`` listed as ``obj``, and never another one.

        For deleting without the ref: when the sample was put again after the
        scan, its newer generation stays. True when this call freed ``obj``'s
        generation (or began to: Mooncake frees an object once its read lease
        ends); False when the store no longer held it.
        """
        self._check_open()
        if not isinstance(obj, StoredObject):
            raise InvalidRefError(f"expected a StoredObject, got {type(obj).__name__}")
        return self._delete_stored(obj)

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed

    def stats(self) -> StoreStats:
        """What the store holds: every stored sample generation and its tensor bytes.

        That includes orphans: features a producer put but never committed to
        the ledger (it was killed in between) are stored, so they are counted,
        until something deletes them; the store cannot tell them apart because
        it does not know the ledger. ``dataflow gc`` deletes what no ledger
        references (``scan`` lists it, ``delete_stored`` frees it).
        """
        self._check_open()
        return self._stats()

    def close(self) -> None:
        """Release resources; idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    # -- guards ------------------------------------------------------------
    def _check_sample(
        self, sample_id: object, tensors: object, metadata: object = None
    ) -> tuple[str, dict[str, torch.Tensor], dict[str, Any]]:
        """``(sample_id, tensors, metadata)`` checked for a put, as a ``_put`` takes them."""
        validate_sample_id(sample_id)
        if not isinstance(tensors, Mapping):
            raise InvalidRefError(
                f"tensors must be a dict of name -> torch.Tensor, got {type(tensors).__name__}"
            )
        for name, tensor in tensors.items():
            validate_feature_name(name)
            self._check_tensor(name, tensor)
        return sample_id, dict(tensors), validate_metadata(metadata)  # type: ignore[return-value]

    def _checked_out(self, ref: object, out: object) -> dict[str, torch.Tensor]:
        """``out`` as a dict, checked for a read of ``ref`` into it (see ``get_into``)."""
        self._check_ref(ref)
        assert isinstance(ref, SampleRef)  # for the type checker: _check_ref raised otherwise
        if not isinstance(out, Mapping):
            raise InvalidRefError(
                f"out must map feature names to tensors, got {type(out).__name__}"
            )
        import torch

        for name, tensor in out.items():
            spec = ref.specs.get(name)
            if spec is None:
                raise InvalidRefError(
                    f"feature {name!r} is not in ref {ref.sample_id!r}; it has {sorted(ref.specs)}"
                )
            if not isinstance(tensor, torch.Tensor):
                raise InvalidRefError(f"out[{name!r}] must be a torch.Tensor, got {tensor!r:.80}")
            if tensor.is_conj() or tensor.is_neg():
                raise InvalidRefError(
                    f"out[{name!r}] is a lazily {'conjugated' if tensor.is_conj() else 'negated'}"
                    " view, which a read cannot write through; pass a plain tensor (e.g. "
                    "torch.empty_like(out), or out.resolve_conj().resolve_neg())"
                )
            if (
                tensor.dtype != spec.dtype
                or tensor.shape != spec.shape
                or not tensor.is_cpu
                or not tensor.is_contiguous()
            ):
                raise InvalidRefError(
                    f"out[{name!r}] is a {'' if tensor.is_contiguous() else 'non-contiguous '}"
                    f"{dtype_name(tensor.dtype)} {list(tensor.shape)} tensor on "
                    f"{tensor.device}; feature {name!r} of {ref.sample_id!r} needs a contiguous "
                    f"{dtype_name(spec.dtype)} {list(spec.shape)} CPU tensor"
                )
        return dict(out)

    def _guarded_scan(self, objects: Iterator[StoredObject]) -> Iterator[StoredObject]:
        try:
            while True:
                self._check_open()  # never resume the hook of a closed store
                obj = next(objects, None)
                if obj is None:
                    return
                yield obj
        finally:
            close = getattr(objects, "close", None)
            if close is not None:  # a generator: release what it holds (dir fds ...) now
                close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed; open a new store with stores.open_store")

    @classmethod
    def _check_tensor(cls, name: str, tensor: object) -> None:
        """Refuse a value that no store can round-trip as raw bytes, naming the feature."""
        import torch

        where = f"tensors[{name!r}]"
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRefError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_nested:
            raise InvalidRefError(
                f"{where} is a nested tensor; put its components as separate features "
                "(t.unbind()) or pad it into one dense tensor (t.to_padded_tensor(0))"
            )
        if type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
            raise InvalidRefError(
                f"{where} is a {type(tensor).__name__}, a tensor subclass whose data is not "
                "its own memory (it overrides __torch_dispatch__); put a plain tensor of its "
                "values instead (e.g. DTensor.full_tensor())"
            )
        if tensor.layout != torch.strided:
            raise InvalidRefError(
                f"{where} has layout {tensor.layout}; stores keep dense (strided) tensors "
                "only: put t.to_dense()"
            )
        if tensor.device.type == "meta":
            raise InvalidRefError(
                f"{where} ({dtype_name(tensor.dtype)}) is on the meta device: it has a shape "
                "but no data; materialize it on a real device first"
            )
        why = cls._unstorable_dtype(tensor.dtype)
        if why is not None:
            raise InvalidRefError(f"{where} has dtype {dtype_name(tensor.dtype)}, {why}")

    @staticmethod
    @functools.cache
    def _unstorable_dtype(dtype: torch.dtype) -> str | None:
        """Why no store can keep ``dtype`` as raw bytes; None when every store can."""
        import torch

        probe = torch.empty(1, dtype=dtype)
        if probe.is_quantized:
            return (
                "a quantized dtype: its scale and zero point are not in its bytes, so no "
                "store can give it back; put t.dequantize(), or t.int_repr() and the "
                "quantization parameters (t.q_scale(), t.q_zero_point()) as metadata"
            )
        try:
            probe.clone()
        except (RuntimeError, NotImplementedError):
            return (
                "a dtype that torch cannot copy (a sub-byte shell dtype); put its bytes "
                "instead (t.view(torch.uint8))"
            )
        return None

    def _check_ref(self, ref: object) -> None:
        if not isinstance(ref, SampleRef):
            raise InvalidRefError(f"expected a SampleRef, got {type(ref).__name__}")
        if ref.store != self.uri:
            raise StoreError(
                f"ref {ref.sample_id!r} belongs to store {ref.store!r}, not {self.uri!r}; "
                "open its store with stores.open_store(ref.store)"
            )

    # -- hooks -------------------------------------------------------------
    @abstractmethod
    def _put(
        self, sample_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> SampleRef: ...

    @abstractmethod
    def _get(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def _delete(self, ref: SampleRef) -> None: ...

    @abstractmethod
    def _exists(self, ref: SampleRef) -> bool: ...

    @abstractmethod
    def _scan(self) -> Iterator[StoredObject]: ...

    def _put_many(
        self, items: list[tuple[str, dict[str, torch.Tensor], dict[str, Any]]]
    ) -> list[SampleRef]:
        return self._all_or_none([self._put(*item)] for item in items)

    def _get_into(self, ref: SampleRef, out: dict[str, torch.Tensor]) -> None:
        # A store that can read into memory it is given overrides this copy (one memcpy
        # per tensor: torch's copy_ crawls in its OpenMP region on a busy machine).
        for name, tensor in self._get(ref, list(out)).items():
            copy(out[name], tensor)

    def _get_many_into(self, items: list[tuple[SampleRef, dict[str, torch.Tensor]]]) -> None:
        for ref, out in items:
            self._get_into(ref, out)

    def _all_or_none(self, batches: Iterable[list[SampleRef]]) -> list[SampleRef]:
        """The refs of every batch of puts, or none: when one raises, delete what came before."""
        refs: list[SampleRef] = []
        try:
            for batch in batches:
                refs += batch
        except BaseException:
            for ref in refs:
                with contextlib.suppress(Exception):  # the first error is the one to see
                    self._delete(ref)
            raise
        return refs

    def _delete_stored(self, obj: StoredObject) -> bool:
        # Not atomic, and it need not be: _delete frees only the generation it
        # is given, so a put in between costs at most a wrong False or True.
        ref = SampleRef(obj.sample_id, self.uri, obj.generation)
        if not self._exists(ref):
            return False
        self._delete(ref)
        return True

    def _stats(self) -> StoreStats:
        objects = nbytes = 0
        for obj in self._scan():
            objects, nbytes = objects + 1, nbytes + obj.nbytes
        return StoreStats(objects=objects, bytes=nbytes)

    def _close(self) -> None:  # noqa: B027 - optional hook
        pass
