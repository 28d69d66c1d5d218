"""What the conformance suite feeds stores: dtypes, bad ids and tensors, sample tensors."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from dataflow.model import dtype_name
from stores import _tensors

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


def flip(data: bytearray, at: int) -> None:
    data[at] ^= 0x10


def zero(data: bytearray) -> None:
    data[:] = bytes(len(data))


_ids = itertools.count()


def fresh_id(prefix: str = "s") -> str:
    return f"{prefix}-{next(_ids)}"


_feature_names = st.sampled_from(["a", "b", "c_1", "d.2", "E-3", "f"])
_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
feature_sets = st.dictionaries(
    _feature_names,
    st.tuples(st.sampled_from(DTYPES), _shapes, st.booleans(), st.integers(0, 2**16)),
    min_size=1,
    max_size=4,
)


def recording(run: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    """``run`` that records what it raises (a thread's exception is lost otherwise)."""

    def recorded() -> None:
        try:
            run()
        except BaseException as exc:
            errors.append(exc)

    return recorded
