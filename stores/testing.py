"""The FeatureStore conformance suite: the whole store contract as pytest tests.

Subclass :class:`FeatureStoreContract` in a test module and supply the store::

    from stores.testing import FeatureStoreContract

    class TestMyStore(FeatureStoreContract):
        def make_store(self, tmp_path):
            return MyStore(tmp_path / "store")

A store that keeps bytes at rest (files, a remote store) also implements
:meth:`FeatureStoreContract.rewrite_stored_bytes`, so that the suite checks
that bytes changed behind its back raise CorruptFeatureError; without it those
tests skip. Every built-in store runs it (``tests/test_store_*.py``). The class
name has no ``Test`` prefix, so pytest collects it only through a subclass.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import (
    CorruptFeatureError,
    InvalidRefError,
    InvalidSampleIdError,
    StaleRefError,
    StoreClosedError,
    StoreError,
    TensorInRefError,
)
from dataflow.interfaces import FeatureStore, StoredObject, StoreStats
from dataflow.model import FeatureSpec, SampleRef, dtype_name
from stores import _tensors
from stores._registry import open_store

_DTYPE_NAMES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
]
#: Every dtype a store must round-trip (the float8/float4 ones where this torch has them).
DTYPES: list[torch.dtype] = [getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)]

_SHELL_DTYPE_NAMES = [f"{sign}int{bits}" for sign in ("u", "") for bits in range(1, 8)]


def _fake_tensor() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(3)


def _quantized(dtype: torch.dtype) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.rand(4), 0.1, 1, dtype)


#: What every store must refuse on put, with InvalidRefError naming the feature,
#: before it stores anything: name -> (a maker of the tensor, what the message names).
UNSTORABLE_TENSORS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    **{
        dtype: (functools.partial(_quantized, getattr(torch, dtype)), dtype)
        for dtype in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    },
    "quint8_per_channel": (
        lambda: torch.quantize_per_channel(
            torch.rand(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8
        ),
        "quint8",
    ),
    **{
        name: (lambda name=name: torch.zeros(4, dtype=torch.uint8).view(getattr(torch, name)), name)
        for name in _SHELL_DTYPE_NAMES
        if hasattr(torch, name)
    },
    "meta": (lambda: torch.empty(3, device="meta"), "meta"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    "nested_jagged": (
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "nested",
    ),
    "sparse_coo": (lambda: torch.eye(3).to_sparse(), "sparse_coo"),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr"),
    "fake_tensor": (_fake_tensor, "FakeTensor"),
}

#: Sample ids every store must refuse with InvalidSampleIdError.
INVALID_SAMPLE_IDS: list[object] = [
    "",
    "../x",
    "/abs",
    "a..b",
    "a b",
    "x" * 257,
    "a\x00b",
    "caf\u00e9",
    "a\\b",
    None,
    3,
    b"x",
]

#: Valid ids that a careless escaping or hashing would merge into one key.
LOOKALIKE_SAMPLE_IDS: list[str] = ["a/b", "a:b", "a_b", "a.b", "a-b", "a/b/", "a//b", "A/b"]
LOOKALIKE_SAMPLE_IDS += ["a", ".", "-", ".a", "2F", "x" * 256, "x" * 255 + "y", "y" + "x" * 255]


def sample_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of random bits (NaNs and all) of any dtype; bools are 0 or 1."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(
        0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=generator
    )
    return raw.view(dtype).reshape(shape)


def assert_same_tensor(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bits (so NaN payloads and -0.0 count)."""
    assert isinstance(actual, torch.Tensor), type(actual)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (actual.shape, expected.shape)
    a, e = _tensors.byte_view(_tensors.dense(actual)), _tensors.byte_view(_tensors.dense(expected))
    assert torch.equal(a, e), f"{dtype_name(expected.dtype)} {tuple(expected.shape)} differs"


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert_same_tensor(actual[name], expected[name])


def _flip(data: bytearray, at: int) -> None:
    data[at] ^= 0x10


def _zero(data: bytearray) -> None:
    data[:] = bytes(len(data))


_ids = itertools.count()


def _fresh_id(prefix: str = "s") -> str:
    return f"{prefix}-{next(_ids)}"


_feature_names = st.sampled_from(["a", "b", "c_1", "d.2", "E-3", "f"])
_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
_features = st.dictionaries(
    _feature_names,
    st.tuples(st.sampled_from(DTYPES), _shapes, st.booleans(), st.integers(0, 2**16)),
    min_size=1,
    max_size=4,
)


def _recording(run: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    """``run`` that records what it raises (a thread's exception is lost otherwise)."""

    def recorded() -> None:
        try:
            run()
        except BaseException as exc:
            errors.append(exc)

    return recorded


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
class FeatureStoreContract:
    """The contract of :class:`dataflow.FeatureStore`, for a subclass to run on its store.

    A subclass implements :meth:`make_store`; the ``store`` fixture closes
    what it made after each test.
    """

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

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[FeatureStore]:
        made = self.make_store(tmp_path)
        try:
            yield made
        finally:
            made.close()

    # -- round trips -------------------------------------------------------
    @pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
    def test_round_trip_every_dtype(self, store: FeatureStore, dtype: torch.dtype) -> None:
        tensor = sample_tensor((3, 5), dtype, seed=7)
        ref = store.put(_fresh_id(), {"x": tensor})
        assert ref.specs == {"x": FeatureSpec((3, 5), dtype)}
        assert_same_tensors(store.get(ref), {"x": tensor})

    def test_zero_dim_and_empty_tensors(self, store: FeatureStore) -> None:
        tensors = {
            "scalar": torch.tensor(2.5),
            "flag": torch.tensor(True),
            "half": torch.tensor(-1.5, dtype=torch.bfloat16),
            "none": torch.empty(0),
            "rows": torch.empty(3, 0, 2, dtype=torch.int64),
            "nobool": torch.empty(0, dtype=torch.bool),
        }
        ref = store.put(_fresh_id(), tensors)
        assert ref.specs["scalar"].shape == () and ref.specs["rows"].shape == (3, 0, 2)
        assert_same_tensors(store.get(ref), tensors)

    def test_only_empty_tensors(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id(), {"none": torch.empty(0, 4)})
        assert store.exists(ref)
        assert_same_tensors(store.get(ref), {"none": torch.empty(0, 4)})
        empty = store.put(_fresh_id(), {})
        assert store.get(empty) == {} and store.exists(empty)
        store.delete(ref)
        assert not store.exists(ref)
        with pytest.raises(StaleRefError):
            store.get(ref)

    def test_non_contiguous_inputs(self, store: FeatureStore) -> None:
        base = sample_tensor((6, 8), torch.float32, seed=1)
        tensors = {
            "transposed": base.t(),
            "strided": base[::2, 1::3],
            "column": base[:, 3],
            "expanded": torch.arange(4.0).expand(3, 4),
            "permuted": sample_tensor((2, 3, 4), torch.int16, seed=2).permute(2, 0, 1),
            "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
            "conj": torch.randn(3, 2, dtype=torch.complex64).conj(),
            "negative": torch.randn(4, dtype=torch.complex64).conj().imag,
            "bool_view": torch.tensor([[True, False], [False, True]]).t(),
        }
        ref = store.put(_fresh_id(), tensors)
        assert_same_tensors(store.get(ref), tensors)

    def test_several_features_and_partial_reads(self, store: FeatureStore) -> None:
        tensors = {
            n: sample_tensor((4, i + 1), DTYPES[i], seed=i)
            for i, n in enumerate(["a", "b", "c", "d", "e"])
        }
        ref = store.put(_fresh_id(), tensors)
        assert_same_tensors(
            store.get(ref, names=["d", "b"]), {"b": tensors["b"], "d": tensors["d"]}
        )
        assert store.get(ref, names=[]) == {}
        with pytest.raises(InvalidRefError):
            store.get(ref, names=["zz"])
        with pytest.raises(InvalidRefError):
            store.get(ref, names="a")

    @pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
    def test_get_into_reads_into_rows_of_a_batch(
        self, store: FeatureStore, dtype: torch.dtype
    ) -> None:
        tensors = [sample_tensor((3, 5), dtype, seed=seed) for seed in range(3)]
        refs = [
            store.put(_fresh_id(), {"x": t, "n": torch.tensor(i)}) for i, t in enumerate(tensors)
        ]
        batch = torch.zeros(3, 3, 5, dtype=dtype)
        for row, ref in zip(batch, reversed(refs), strict=True):
            store.get_into(ref, {"x": row})  # only the features named in out
        for row, tensor in zip(batch, reversed(tensors), strict=True):
            assert_same_tensor(row, tensor)

    def test_get_into_reads_what_get_reads(self, store: FeatureStore) -> None:
        tensors = {
            "scalar": torch.tensor(2.5),
            "none": torch.empty(3, 0),
            "big": sample_tensor((1024, 1100), torch.float32, seed=5),
            "ids": torch.arange(7),
        }
        ref = store.put(_fresh_id(), tensors)
        out = {name: torch.full_like(t, 9) for name, t in tensors.items()}
        store.get_into(ref, out)
        assert_same_tensors(out, tensors)
        store.get_into(ref, {})

    def test_get_into_a_tensor_that_does_not_fit_is_refused(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id(), {"x": torch.arange(6.0).reshape(2, 3)})
        for bad in (
            torch.zeros(3, 2),
            torch.zeros(2, 3, dtype=torch.float64),
            torch.zeros(3, 2).t(),  # right shape, not contiguous
        ):
            with pytest.raises(InvalidRefError, match="'x'"):
                store.get_into(ref, {"x": bad})
            assert not bad.any()
        with pytest.raises(InvalidRefError, match="'y' is not in ref"):
            store.get_into(ref, {"y": torch.zeros(2, 3)})
        with pytest.raises(InvalidRefError, match=r"must be a torch\.Tensor"):
            store.get_into(ref, {"x": [[0.0] * 3] * 2})  # type: ignore[dict-item]
        with pytest.raises(InvalidRefError, match="out must map"):
            store.get_into(ref, [torch.zeros(2, 3)])  # type: ignore[arg-type]

    def test_get_into_a_lazy_conjugate_view_is_refused(self, store: FeatureStore) -> None:
        # Contiguous, of the right dtype and shape, yet no read can write through it.
        stored = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
        ref = store.put(_fresh_id(), {"z": stored})
        base = torch.zeros(2, dtype=torch.complex64)
        with pytest.raises(InvalidRefError, match=r"out\['z'\] is a lazily conjugated view"):
            store.get_into(ref, {"z": base.conj()})
        with pytest.raises(InvalidRefError, match="lazily conjugated"):
            store.get_many_into([(ref, {"z": base.conj()})])
        assert not base.any()  # nothing was read into it
        store.get_into(ref, {"z": base})
        assert torch.equal(base, stored)

    def test_get_into_a_stale_ref_raises(self, store: FeatureStore) -> None:
        sample_id = _fresh_id()
        old = store.put(sample_id, {"x": torch.tensor([1, 2])})
        store.put(sample_id, {"x": torch.tensor([3, 4])})
        with pytest.raises(StaleRefError):
            store.get_into(old, {"x": torch.zeros(2, dtype=torch.int64)})
        with pytest.raises(StaleRefError):  # as get(ref, names=[]) does
            store.get_into(old, {})

    @pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
    def test_get_many_into_reads_each_item_as_get_into_would(
        self, store: FeatureStore, dtype: torch.dtype
    ) -> None:
        tensors = [sample_tensor((3, 5), dtype, seed=seed) for seed in range(4)]
        refs = [
            store.put(_fresh_id(), {"x": t, "n": torch.tensor(i), "none": torch.empty(0)})
            for i, t in enumerate(tensors)
        ]
        batch = torch.zeros(4, 3, 5, dtype=dtype)
        whole = {  # other bits than the sample's, in every feature
            name: sample_tensor(tuple(t.shape), t.dtype, seed=99)
            for name, t in store.get(refs[0]).items()
        }
        items = [(ref, {"x": row}) for ref, row in zip(reversed(refs), batch, strict=True)]
        store.get_many_into([*items, (refs[0], whole), (refs[1], {})])  # refs[0] twice
        for row, tensor in zip(batch, reversed(tensors), strict=True):
            assert_same_tensor(row, tensor)
        assert_same_tensors(whole, store.get(refs[0]))
        store.get_many_into([])
        store.get_many_into(iter([(refs[2], {"n": torch.tensor(0)})]))  # any iterable

    def test_get_many_into_reads_many_large_samples(self, store: FeatureStore) -> None:
        tensors = [sample_tensor((1024, 1100), torch.float32, seed=s) for s in range(3)]
        refs = [store.put(_fresh_id(), {"big": t}) for t in tensors]
        outs = [{"big": torch.zeros(1024, 1100)} for _ in refs]
        store.get_many_into(list(zip(refs, outs, strict=True)))
        for out, tensor in zip(outs, tensors, strict=True):
            assert_same_tensor(out["big"], tensor)

    def test_get_many_into_raises_for_a_stale_ref_among_good_ones(
        self, store: FeatureStore
    ) -> None:
        good = store.put(_fresh_id(), {"x": torch.tensor([1, 2])})
        sample_id = _fresh_id()
        old = store.put(sample_id, {"x": torch.tensor([1, 2])})
        store.put(sample_id, {"x": torch.tensor([3, 4])})
        gone = store.put(_fresh_id(), {"x": torch.tensor([5, 6])})
        store.delete(gone)
        for bad in (old, gone):
            items = [(good, {"x": torch.zeros(2, dtype=torch.int64)})]
            with pytest.raises(StaleRefError, match=bad.sample_id):
                store.get_many_into([*items, (bad, {"x": torch.zeros(2, dtype=torch.int64)})])
        out = torch.zeros(2, dtype=torch.int64)
        store.get_many_into([(good, {"x": out})])  # the store still serves the good one
        assert out.tolist() == [1, 2]

    @pytest.mark.parametrize(
        "spec",
        [
            FeatureSpec((2, 3), torch.int32),  # another dtype, the same bytes
            FeatureSpec((3, 2), torch.float32),  # another shape
            FeatureSpec((6,), torch.float32),  # the same elements, flat
        ],
    )
    def test_a_ref_whose_specs_are_not_what_was_put_is_corrupt(
        self, store: FeatureStore, spec: FeatureSpec
    ) -> None:
        # A ref made by hand must never reinterpret the stored bytes as another tensor.
        ref = store.put(_fresh_id(), {"x": torch.arange(6.0).reshape(2, 3)})
        forged = SampleRef(ref.sample_id, ref.store, ref.generation, {"x": spec}, {})
        reads: list[Callable[[], object]] = [
            lambda: store.get(forged),
            lambda: store.get_into(forged, {"x": torch.zeros(spec.shape, dtype=spec.dtype)}),
            lambda: store.get_many_into(
                [
                    (ref, {"x": torch.zeros(2, 3)}),
                    (forged, {"x": torch.zeros(spec.shape, dtype=spec.dtype)}),
                ]
            ),
        ]
        for read in reads:
            with pytest.raises(CorruptFeatureError, match=ref.sample_id):
                read()
        assert store.get(ref)["x"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]

    def test_get_many_into_checks_every_item_before_reading_any(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id(), {"x": torch.arange(6.0).reshape(2, 3)})
        first = torch.zeros(2, 3)
        for bad_item, match in (
            ((ref, {"x": torch.zeros(3, 2)}), "'x'"),
            ((ref, {"y": torch.zeros(2, 3)}), "'y' is not in ref"),
            ((ref, [torch.zeros(2, 3)]), "out must map"),
            ((ref,), r"\(ref, out\) pairs"),
            ([ref, {"x": torch.zeros(2, 3)}], r"\(ref, out\) pairs"),
            (("not-a-ref", {"x": torch.zeros(2, 3)}), "expected a SampleRef"),
        ):
            with pytest.raises(InvalidRefError, match=match):
                store.get_many_into([(ref, {"x": first}), bad_item])  # type: ignore[list-item]
            assert not first.any(), f"read before {bad_item!r:.60} was refused"
        for not_items in ({ref.sample_id: {"x": first}}, "ab", ref):
            with pytest.raises(InvalidRefError, match="get_many_into takes"):
                store.get_many_into(not_items)  # type: ignore[arg-type]
        other = SampleRef(ref.sample_id, "mem://elsewhere", ref.generation, ref.specs)
        with pytest.raises(StoreError, match="belongs to store"):
            store.get_many_into([(other, {"x": first})])

    def test_larger_sample(self, store: FeatureStore) -> None:
        tensors = {
            "big": sample_tensor((1024, 1024), torch.float32, seed=3),
            "small": torch.arange(5),
        }
        ref = store.put(_fresh_id(), tensors)
        assert ref.nbytes == 4 * 1024 * 1024 + 40
        assert_same_tensors(store.get(ref), tensors)

    def test_put_keeps_its_own_copy(self, store: FeatureStore) -> None:
        tensor = torch.arange(10.0)
        ref = store.put(_fresh_id(), {"x": tensor})
        tensor.fill_(-1.0)
        assert_same_tensor(store.get(ref)["x"], torch.arange(10.0))

    def test_ref_is_tensor_free_and_reads_after_json(self, store: FeatureStore) -> None:
        metadata = {"label": 3, "split": "train", "weights": [0.5, 1.5], "extra": {"k": None}}
        tensors = {"x": sample_tensor((2, 3), torch.bfloat16), "y": torch.tensor([1, 2])}
        ref = store.put(_fresh_id(), tensors, metadata=metadata)
        assert ref.store == store.uri
        assert dict(ref.metadata) == metadata
        again = SampleRef.from_json(ref.to_json())
        assert again == ref
        assert_same_tensors(store.get(again), tensors)

    # -- generations -------------------------------------------------------
    def test_each_put_gets_a_new_larger_generation(self, store: FeatureStore) -> None:
        sample_id = _fresh_id()
        generations = [store.put(sample_id, {"x": torch.tensor(i)}).generation for i in range(5)]
        assert generations == sorted(set(generations))

    def test_superseded_ref_is_stale(self, store: FeatureStore) -> None:
        sample_id = _fresh_id()
        old = store.put(sample_id, {"x": torch.tensor([1, 2])})
        new = store.put(sample_id, {"x": torch.tensor([3, 4, 5])})
        with pytest.raises(StaleRefError):
            store.get(old)
        with pytest.raises(KeyError):  # StaleRefError is a KeyError
            store.get(old, names=["x"])
        assert not store.exists(old) and store.exists(new)
        assert_same_tensor(store.get(new)["x"], torch.tensor([3, 4, 5]))

    def test_deleting_an_old_generation_keeps_the_new_one(self, store: FeatureStore) -> None:
        sample_id = _fresh_id()
        old = store.put(sample_id, {"x": torch.tensor(1.0)})
        store.get(old)
        new = store.put(sample_id, {"x": torch.tensor(2.0)})
        store.delete(old)
        store.delete(old)
        assert store.exists(new)
        assert_same_tensor(store.get(new)["x"], torch.tensor(2.0))

    def test_delete_is_idempotent(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id(), {"x": torch.ones(3)})
        other = store.put(_fresh_id(), {"x": torch.zeros(3)})
        store.get(ref)
        store.delete(ref)
        store.delete(ref)
        assert not store.exists(ref)
        with pytest.raises(StaleRefError):
            store.get(ref)
        assert_same_tensor(store.get(other)["x"], torch.zeros(3))

    def test_put_after_delete_gets_a_newer_generation(self, store: FeatureStore) -> None:
        sample_id = _fresh_id()
        first = store.put(sample_id, {"x": torch.tensor(1)})
        store.delete(first)
        second = store.put(sample_id, {"x": torch.tensor(2)})
        assert second.generation > first.generation
        with pytest.raises(StaleRefError):
            store.get(first)
        assert_same_tensor(store.get(second)["x"], torch.tensor(2))

    def test_exists(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id(), {"x": torch.ones(2)})
        assert store.exists(ref)
        never = SampleRef(_fresh_id(), store.uri, ref.generation, dict(ref.specs))
        assert not store.exists(never)
        with pytest.raises(StaleRefError):
            store.get(never)

    def test_lookalike_ids_stay_apart(self, store: FeatureStore) -> None:
        refs = {
            sample_id: store.put(sample_id, {"x": torch.tensor([i])})
            for i, sample_id in enumerate(LOOKALIKE_SAMPLE_IDS)
        }
        for i, sample_id in enumerate(LOOKALIKE_SAMPLE_IDS):
            assert_same_tensor(store.get(refs[sample_id])["x"], torch.tensor([i]))

    # -- corruption (stores that keep bytes) --------------------------------
    @pytest.mark.parametrize("size", [1000, 2 << 20], ids=["small", "large"])
    def test_a_flipped_stored_byte_is_corrupt(self, store: FeatureStore, size: int) -> None:
        tensors = {"a": torch.arange(size, dtype=torch.float32), "b": torch.ones(9)}
        ref = store.put(_fresh_id("flip"), tensors)
        self.rewrite_stored_bytes(store, ref, "a", lambda data: _flip(data, 4 * (size // 2)))
        for names in (None, ["a"]):
            with pytest.raises(CorruptFeatureError) as corrupt:
                store.get(ref, names=names)
            assert ref.sample_id in str(corrupt.value) and "'a'" in str(corrupt.value)
        assert_same_tensor(store.get(ref, names=["b"])["b"], torch.ones(9))  # b is intact

    def test_get_into_checks_the_bytes_it_reads(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id("into"), {"x": torch.arange(1000, dtype=torch.float32)})
        self.rewrite_stored_bytes(store, ref, "x", lambda data: _flip(data, 2000))
        with pytest.raises(CorruptFeatureError, match="'x'"):
            store.get_into(ref, {"x": torch.zeros(1000)})

    def test_zeroed_stored_bytes_are_corrupt(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id("zeroed"), {"x": torch.arange(1, 1001, dtype=torch.int64)})
        self.rewrite_stored_bytes(store, ref, "x", _zero)
        with pytest.raises(CorruptFeatureError) as corrupt:
            store.get(ref)
        assert ref.sample_id in str(corrupt.value) and "'x'" in str(corrupt.value)

    # -- refusals ----------------------------------------------------------
    @pytest.mark.parametrize("bad", INVALID_SAMPLE_IDS, ids=repr)
    def test_invalid_sample_id_is_refused(self, store: FeatureStore, bad: object) -> None:
        before = store.stats()
        with pytest.raises(InvalidSampleIdError):
            store.put(bad, {"x": torch.ones(1)})  # type: ignore[arg-type]
        assert store.stats() == before

    def test_tensors_in_metadata_are_refused(self, store: FeatureStore) -> None:
        before = store.stats()
        for metadata in (
            {"t": torch.ones(1)},
            {"n": [np.zeros(2)]},
            {"deep": {"t": torch.ones(1)}},
        ):
            with pytest.raises(TensorInRefError):
                store.put(_fresh_id(), {"x": torch.ones(1)}, metadata=metadata)
        assert store.stats() == before

    @pytest.mark.parametrize("case", sorted(UNSTORABLE_TENSORS))
    @pytest.mark.filterwarnings("ignore::UserWarning")  # prototype, beta, deprecated: all of them
    def test_unstorable_tensors_are_refused(self, store: FeatureStore, case: str) -> None:
        make, named = UNSTORABLE_TENSORS[case]
        before, sample_id = store.stats(), _fresh_id()
        with pytest.raises(InvalidRefError, match=r"tensors\['bad'\]") as refused:
            store.put(sample_id, {"good": torch.ones(2), "bad": make()})
        assert re.search(rf"\b{re.escape(named)}\b", str(refused.value)), refused.value
        assert store.stats() == before
        never = SampleRef(sample_id, store.uri, 1, {"good": FeatureSpec((2,), torch.float32)})
        assert not store.exists(never)

    def test_ref_of_another_store_is_refused(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id(), {"x": torch.ones(1)})
        foreign = SampleRef(ref.sample_id, "mem://somewhere-else", ref.generation, ref.specs)
        with pytest.raises(StoreError):
            store.get(foreign)
        with pytest.raises(InvalidRefError):
            store.get("not a ref")  # type: ignore[arg-type]

    # -- stats, lifecycle, reopening ---------------------------------------
    def test_stats_counts_live_generations_and_tensor_bytes(self, store: FeatureStore) -> None:
        assert (store.stats().objects, store.stats().bytes) == (0, 0)
        a = store.put(_fresh_id(), {"x": torch.ones(4), "y": torch.ones(2, dtype=torch.int64)})
        b = store.put(_fresh_id(), {"x": torch.ones(8, dtype=torch.float64)})
        assert (store.stats().objects, store.stats().bytes) == (2, 16 + 16 + 64)
        store.put(a.sample_id, {"x": torch.ones(1)})
        assert (store.stats().objects, store.stats().bytes) == (2, 4 + 64)
        store.delete(b)
        store.delete(a)  # superseded already: no effect
        assert (store.stats().objects, store.stats().bytes) == (1, 4)

    def test_closed_store_refuses_everything(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id(), {"x": torch.ones(1)})
        listed = StoredObject(ref.sample_id, ref.generation, ref.nbytes, time.time())
        scanning = store.scan()
        store.close()
        store.close()
        for call in (
            lambda: store.put(_fresh_id(), {"x": torch.ones(1)}),
            lambda: store.put_many([(_fresh_id(), {"x": torch.ones(1)})]),
            lambda: store.get(ref),
            lambda: store.get_into(ref, {"x": torch.zeros(1)}),
            lambda: store.delete(ref),
            lambda: store.exists(ref),
            store.stats,
            store.scan,
            lambda: store.delete_stored(listed),
            lambda: next(scanning),  # a scan begun before the close
        ):
            with pytest.raises(StoreClosedError):
                call()

    def test_refs_reopen_their_store_by_uri(self, store: FeatureStore) -> None:
        tensors = {"x": sample_tensor((5, 2), torch.float16, seed=4)}
        ref = SampleRef.from_json(store.put(_fresh_id(), tensors).to_json())
        reopened = open_store(ref.store)
        try:
            assert reopened.uri == store.uri
            assert_same_tensors(reopened.get(ref), tensors)
        finally:
            if reopened is not store:
                reopened.close()

    # -- batches -----------------------------------------------------------
    def test_put_many_is_put_in_order(self, store: FeatureStore) -> None:
        a, b = _fresh_id("many"), _fresh_id("many")
        samples = [
            (a, {"x": sample_tensor((3, 4), torch.bfloat16, seed=1), "e": torch.empty(0)}),
            (b, {"y": torch.arange(5)}, {"split": "val"}),
            (a, {"x": torch.ones(2)}),  # a repeated id: the later item supersedes
        ]
        refs = store.put_many(samples)
        assert [ref.sample_id for ref in refs] == [a, b, a]
        assert refs[2].generation > refs[0].generation
        assert dict(refs[1].metadata) == {"split": "val"} and dict(refs[0].metadata) == {}
        with pytest.raises(StaleRefError):
            store.get(refs[0])
        assert_same_tensors(store.get(refs[1]), samples[1][1])
        assert_same_tensors(store.get(refs[2]), samples[2][1])
        assert store.put_many([]) == []
        assert store.put_many(iter([(_fresh_id(), {})]))[0].specs == {}

    @pytest.mark.parametrize(
        "bad",
        [
            ("not a valid id", {"x": torch.ones(1)}),
            ("ok-id", {"x": np.ones(1)}),
            ("ok-id", {"x": torch.ones(1)}, {"t": torch.ones(1)}),
            ("ok-id",),
            ["ok-id", {"x": torch.ones(1)}],
        ],
        ids=["invalid-id", "numpy", "tensor-in-metadata", "one-field", "a-list"],
    )
    def test_put_many_checks_every_sample_before_storing_any(
        self, store: FeatureStore, bad: object
    ) -> None:
        before = store.stats()
        good = _fresh_id("first")
        with pytest.raises((ValueError, TypeError)):
            store.put_many([(good, {"x": torch.ones(3)}), bad])  # type: ignore[list-item]
        assert store.stats() == before
        assert [o for o in store.scan() if o.sample_id == good] == []
        with pytest.raises(InvalidRefError):
            store.put_many("abc")  # type: ignore[arg-type]

    # -- listing what the store holds ----------------------------------------
    def _listed(self, store: FeatureStore, ids: set[str]) -> dict[str, StoredObject]:
        listed: dict[str, StoredObject] = {}
        for obj in store.scan():
            assert isinstance(obj, StoredObject), obj
            if obj.sample_id in ids:
                assert obj.sample_id not in listed, f"{obj.sample_id} listed twice"
                listed[obj.sample_id] = obj
        return listed

    def test_scan_lists_what_was_put(self, store: FeatureStore) -> None:
        before = time.time()
        refs = [
            store.put(_fresh_id("scan"), {"x": torch.ones(4), "y": torch.arange(3)}),
            store.put(_fresh_id("scan"), {"x": sample_tensor((2, 7), torch.float16, seed=3)}),
            store.put(_fresh_id("scan/nested:id"), {"none": torch.empty(0)}),
        ]
        listed = self._listed(store, {ref.sample_id for ref in refs})
        assert set(listed) == {ref.sample_id for ref in refs}
        for ref in refs:
            obj = listed[ref.sample_id]
            assert (obj.generation, obj.nbytes) == (ref.generation, ref.nbytes)
            # Some file systems keep coarse times (a file's mtime may lag by a tick).
            assert before - 2 <= obj.created <= time.time() + 2, (obj.created, before)

    def test_scan_skips_deleted_and_superseded_generations(self, store: FeatureStore) -> None:
        replaced, deleted, kept = _fresh_id("re"), _fresh_id("del"), _fresh_id("keep")
        old = store.put(replaced, {"x": torch.ones(8)})
        store.get(old)  # a read first: some stores must then wait before freeing
        new = store.put(replaced, {"x": torch.ones(2)})
        gone = store.put(deleted, {"x": torch.ones(8)})
        store.get(gone)
        store.delete(gone)
        store.put(kept, {"x": torch.ones(1)})
        listed = self._listed(store, {replaced, deleted, kept})
        assert set(listed) == {replaced, kept}
        assert (listed[replaced].generation, listed[replaced].nbytes) == (new.generation, 8)

    def test_stats_are_what_scan_lists(self, store: FeatureStore) -> None:
        for i in range(5):
            store.put(_fresh_id("st"), {"x": torch.ones(i + 1)})
        store.delete(store.put(_fresh_id("st"), {"x": torch.ones(3)}))
        listed = list(store.scan())
        assert store.stats() == StoreStats(len(listed), sum(o.nbytes for o in listed))

    def test_delete_stored_frees_the_listed_generation(self, store: FeatureStore) -> None:
        ref = store.put(_fresh_id("gc"), {"x": torch.ones(4)})
        other = store.put(_fresh_id("gc"), {"x": torch.zeros(4)})
        (obj,) = self._listed(store, {ref.sample_id}).values()
        assert store.delete_stored(obj) is True
        assert not store.exists(ref)
        with pytest.raises(StaleRefError):
            store.get(ref)
        assert store.delete_stored(obj) is False  # gone already
        assert self._listed(store, {ref.sample_id}) == {}
        assert_same_tensor(store.get(other)["x"], torch.zeros(4))
        deleted = store.put(_fresh_id("gc"), {"x": torch.ones(1)})
        (listed,) = self._listed(store, {deleted.sample_id}).values()
        store.delete(deleted)
        assert store.delete_stored(listed) is False
        with pytest.raises(InvalidRefError):
            store.delete_stored(ref)  # type: ignore[arg-type]

    def test_delete_stored_never_frees_a_newer_generation(self, store: FeatureStore) -> None:
        sample_id = _fresh_id("gc-race")
        old = store.put(sample_id, {"x": torch.ones(4)})
        (listed,) = self._listed(store, {sample_id}).values()
        assert listed.generation == old.generation
        store.get(old)
        new = store.put(sample_id, {"x": torch.full((4,), 7.0)})  # put after the scan
        assert isinstance(store.delete_stored(listed), bool)
        assert store.exists(new)
        assert_same_tensor(store.get(new)["x"], torch.full((4,), 7.0))
        (now,) = self._listed(store, {sample_id}).values()
        assert now.generation == new.generation

    def test_scan_while_threads_put_and_delete(self, store: FeatureStore) -> None:
        ids = [_fresh_id("busy") for _ in range(12)]
        done = threading.Event()
        survivors: dict[str, SampleRef] = {}
        lock = threading.Lock()

        def churn(worker: int) -> None:
            mine = ids[worker::4]
            for round_ in range(6):
                for sample_id in mine:
                    ref = store.put(sample_id, {"x": torch.full((64,), float(round_))})
                    if (round_ + worker) % 3 == 0:
                        store.delete(ref)
                        with lock:
                            survivors.pop(sample_id, None)
                    else:
                        with lock:
                            survivors[sample_id] = ref

        scans = 0

        def scan_until_done() -> None:
            nonlocal scans
            while not done.is_set() or scans == 0:
                for obj in store.scan():
                    assert obj.nbytes >= 0 and obj.generation >= 0
                scans += 1

        scanner = threading.Thread(target=scan_until_done)
        errors: list[BaseException] = []
        scanner.run = _recording(scanner.run, errors)  # type: ignore[method-assign]
        scanner.start()
        try:
            with ThreadPoolExecutor(max_workers=4) as pool:
                list(pool.map(churn, range(4)))
        finally:
            done.set()
            scanner.join()
        assert not errors, errors
        listed = self._listed(store, set(ids))
        assert {sid: o.generation for sid, o in listed.items()} == {
            sid: ref.generation for sid, ref in survivors.items()
        }

    # -- concurrency -------------------------------------------------------
    def test_thread_safety(self, store: FeatureStore) -> None:
        shared = _fresh_id("shared")
        shared_puts: dict[int, int] = {}  # generation -> the value put with it
        lock = threading.Lock()

        def work(i: int) -> None:
            own = sample_tensor((16, 16), DTYPES[i % len(DTYPES)], seed=i)
            ref = store.put(_fresh_id("t"), {"x": own})
            assert_same_tensor(store.get(ref)["x"], own)
            if i % 2:
                store.delete(ref)
                assert not store.exists(ref)
            shared_ref = store.put(shared, {"i": torch.tensor(i)})
            with lock:
                shared_puts[shared_ref.generation] = i

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(work, range(48)))
        assert len(shared_puts) == 48  # no two puts got the same generation
        refs = [
            SampleRef(shared, store.uri, g, {"i": FeatureSpec((), torch.int64)})
            for g in shared_puts
        ]
        current = [ref for ref in refs if store.exists(ref)]
        assert len(current) == 1
        assert store.get(current[0])["i"].item() == shared_puts[current[0].generation]
        assert store.stats().objects == 24 + 1

    # -- properties --------------------------------------------------------
    # One store serves every example (it is reusable by contract), and every
    # subclass runs this same method: both health checks are about neither.
    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.differing_executors,
        ],
    )
    @given(features=_features)
    def test_round_trip_property(self, store: FeatureStore, features: dict) -> None:
        tensors = {}
        for name, (dtype, shape, transpose, seed) in features.items():
            tensor = sample_tensor(shape, dtype, seed)
            tensors[name] = tensor.t() if transpose and tensor.dim() == 2 else tensor
        ref = store.put(_fresh_id("p"), tensors)
        assert {n: (s.shape, s.dtype) for n, s in ref.specs.items()} == {
            n: (tuple(t.shape), t.dtype) for n, t in tensors.items()
        }
        assert_same_tensors(store.get(ref), tensors)
        store.delete(ref)
