"""Hypothesis strategies for sample ids, feature tensors and refs."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from dataflow.model._refs import MAX_SAMPLE_ID_LENGTH, FeatureSpec, SampleRef

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/-"

#: Dtypes every store must round-trip.
DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def _valid_id(text: str) -> bool:
    return ".." not in text and not text.startswith("/")


def sample_ids(*, max_size: int = MAX_SAMPLE_ID_LENGTH) -> st.SearchStrategy[str]:
    """Valid sample ids, including awkward ones (slashes, colons, dots, 256 characters)."""
    return st.text(_ID_ALPHABET, min_size=1, max_size=max_size).filter(_valid_id)


def invalid_sample_ids() -> st.SearchStrategy[object]:
    """Values that every entry point must refuse with InvalidSampleIdError."""
    return st.one_of(
        st.just(""),
        st.text(_ID_ALPHABET, min_size=MAX_SAMPLE_ID_LENGTH + 1, max_size=300),
        st.builds(
            lambda a, b: f"{a}..{b}",
            st.text(_ID_ALPHABET, max_size=5),
            st.text(_ID_ALPHABET, max_size=5),
        ),
        st.builds(lambda a: "/" + a, st.text(_ID_ALPHABET, max_size=10)),
        st.text(min_size=1, max_size=20).filter(lambda s: any(c not in _ID_ALPHABET for c in s)),
        st.integers(),
        st.none(),
        st.binary(min_size=1, max_size=10),
    )


@st.composite
def tensors(draw: st.DrawFn, *, max_dims: int = 3, max_side: int = 6) -> torch.Tensor:
    """A tensor of any supported dtype; 0-d, empty and non-contiguous included."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, max_side), max_size=max_dims)))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if dtype == torch.bool:
        value = torch.rand(shape, generator=generator) > 0.5
    elif dtype.is_floating_point:
        value = torch.randn(shape, generator=generator).to(dtype)
    else:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -1000), min(info.max, 1000)
        value = torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)
    if value.dim() >= 2 and draw(st.booleans()):
        value = value.transpose(0, 1)  # non-contiguous
    return value


def feature_dicts(*, max_features: int = 3) -> st.SearchStrategy[dict[str, torch.Tensor]]:
    """name -> tensor mappings as producers emit them."""
    names = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
    return st.dictionaries(names, tensors(), min_size=1, max_size=max_features)


def json_values() -> st.SearchStrategy[object]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**53), 2**53),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=10,
    )


@st.composite
def sample_refs(draw: st.DrawFn) -> SampleRef:
    """Tensor-free refs with random specs and JSON metadata."""
    names = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
    specs = draw(
        st.dictionaries(
            names,
            st.builds(
                FeatureSpec,
                st.lists(st.integers(0, 64), max_size=4).map(tuple),
                st.sampled_from(DTYPES),
            ),
            max_size=4,
        )
    )
    return SampleRef(
        sample_id=draw(sample_ids()),
        store=draw(
            st.sampled_from(["mem://x", "dir:///tmp/features", "mooncake://h:1?namespace=n"])
        ),
        generation=draw(st.integers(0, 2**62)),
        specs=specs,
        metadata=draw(st.dictionaries(st.text(max_size=8), json_values(), max_size=4)),
    )
