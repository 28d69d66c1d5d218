"""FeatureSpec and SampleRef: the tensor-free description of a sample's features.

They are all that travels through the ledger and streams.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from dataflow.model._errors import (
    InvalidRefError,
    InvalidSampleIdError,
    TensorInRefError,
)

MAX_SAMPLE_ID_LENGTH = 256
_SAMPLE_ID_RE = re.compile(r"[A-Za-z0-9._:/-]+")
_FEATURE_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


def validate_sample_id(sample_id: object) -> str:
    """Return ``sample_id`` if it is a valid sample id, else raise InvalidSampleIdError.

    A valid id is a string of 1 to 256 characters from ``[A-Za-z0-9._:/-]`` that
    does not contain ``..`` and does not start with ``/``; so an id is always a
    safe relative key, never a path traversal.
    """
    if not isinstance(sample_id, str):
        raise InvalidSampleIdError(
            f"sample id must be a str, got {type(sample_id).__name__} {sample_id!r}"
        )
    if not 0 < len(sample_id) <= MAX_SAMPLE_ID_LENGTH:
        raise InvalidSampleIdError(
            f"sample id must have 1 to {MAX_SAMPLE_ID_LENGTH} characters, "
            f"got {len(sample_id)}: {sample_id[:80]!r}"
        )
    if not _SAMPLE_ID_RE.fullmatch(sample_id):
        raise InvalidSampleIdError(
            f"sample id {sample_id!r} has characters outside [A-Za-z0-9._:/-]; "
            "encode it (e.g. hex or urlsafe base64) before using it as an id"
        )
    if ".." in sample_id or sample_id.startswith("/"):
        raise InvalidSampleIdError(
            f"sample id {sample_id!r} must not contain '..' or start with '/'"
        )
    return sample_id


def validate_feature_name(name: object) -> str:
    if not isinstance(name, str) or not _FEATURE_NAME_RE.fullmatch(name):
        raise InvalidRefError(f"feature name {name!r} must be 1-128 characters from [A-Za-z0-9_.-]")
    return name


def _dtype_from_name(name: object) -> torch.dtype:
    import torch  # here, not at import: the ledger and the CLI never touch a tensor

    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidRefError(f"unknown torch dtype {name!r}; use a name like 'float32'")
    return dtype


@functools.cache
def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FeatureSpec:
    """Shape and dtype of one named feature tensor; enough to allocate it before a read."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        shape = self.shape
        if not isinstance(shape, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise InvalidRefError(f"FeatureSpec.shape must be non-negative ints, got {shape!r}")
        object.__setattr__(self, "shape", tuple(shape))
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", _dtype_from_name(self.dtype))
        elif not _is_dtype(self.dtype):
            raise InvalidRefError(f"FeatureSpec.dtype must be a torch.dtype, got {self.dtype!r}")

    @classmethod
    def of(cls, tensor: torch.Tensor) -> FeatureSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_dict(cls, data: object) -> FeatureSpec:
        if not isinstance(data, dict) or set(data) != {"shape", "dtype"}:
            raise InvalidRefError(f"a feature spec needs exactly 'shape' and 'dtype', got {data!r}")
        return cls(tuple(data["shape"]), _dtype_from_name(data["dtype"]))


def _is_dtype(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.dtype)


def _is_tensor(obj: object) -> bool:
    # No tensor can exist before its library was imported: checking sys.modules
    # keeps torch and numpy out of the import path of the ledger and the CLI.
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return (torch is not None and isinstance(obj, torch.Tensor)) or (
        np is not None and isinstance(obj, np.ndarray)
    )


def assert_no_tensors(obj: object, *, where: str = "ref") -> None:
    """Raise TensorInRefError if a tensor (torch or numpy) hides anywhere in ``obj``.

    Walks dataclasses (SampleRef included), mappings, and sequences; the error
    names the path to the offending value.
    """
    stack: list[tuple[str, object]] = [(where, obj)]
    while stack:
        path, value = stack.pop()
        if _is_tensor(value):
            raise TensorInRefError(
                f"{path} holds a {type(value).__name__}; refs and their metadata must be "
                "tensor-free: put tensors into the FeatureStore and keep only their ref"
            )
        if isinstance(value, SampleRef):
            stack.append((f"{path}.metadata", value.metadata))
            stack.extend((f"{path}.specs[{k!r}]", v) for k, v in value.specs.items())
        elif isinstance(value, Mapping):
            for k, v in value.items():
                stack.append((f"{path}[{k!r}] (key)", k))
                stack.append((f"{path}[{k!r}]", v))
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def _check_json_value(value: object, path: str) -> None:
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise InvalidRefError(f"{path} is {value!r}; JSON has no NaN or infinity")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidRefError(f"{path} has a non-string key {k!r}")
            _check_json_value(v, f"{path}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json_value(v, f"{path}[{i}]")
        return
    raise InvalidRefError(
        f"{path} is a {type(value).__name__}, which is not JSON-able; "
        "metadata may hold only str, int, float, bool, None, lists and dicts"
    )


def validate_metadata(metadata: object) -> dict[str, Any]:
    """Return a tensor-free, JSON-able copy of ``metadata`` (None gives {}).

    Nesting is capped at 32 levels (the top dict is level 1): the ledger stores metadata
    as JSON, and its readers parse it recursively, so deeper metadata would be committed
    but unreadable (RecursionError on a later lease or replay). The depth is checked
    first, without recursion, so nothing deeper (not even a cycle) reaches a store.
    """
    if metadata is None or (type(metadata) is dict and not metadata):
        return {}  # the common case, and a new dict as the copy would be
    max_depth = 32
    walk: list[tuple[object, int, str]] = [(metadata, 1, "metadata")]
    while walk:
        value, depth, path = walk.pop()
        if isinstance(value, Mapping):
            children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
            children += [(f"{path}[{k!r}] (key)", k) for k in value]
        elif isinstance(value, (list, tuple, set, frozenset)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        if depth > max_depth:
            raise InvalidRefError(
                f"metadata nested deeper than {max_depth} levels at {path}; flatten it"
            )
        walk.extend((child, depth + 1, child_path) for child_path, child in children)
    assert_no_tensors(metadata, where="metadata")
    if not isinstance(metadata, Mapping):
        raise InvalidRefError(f"metadata must be a dict, got {type(metadata).__name__}")
    _check_json_value(dict(metadata), "metadata")
    return json.loads(json.dumps(dict(metadata)))


@dataclass(frozen=True)
class SampleRef:
    """A tensor-free handle to one sample's features in a store.

    ``store`` is the URI of the store holding the features (``mem://...``,
    ``dir:///...``, ``mooncake://...``), so any process can reopen it;
    ``generation`` distinguishes successive puts of the same ``sample_id``.
    """

    sample_id: str
    store: str
    generation: int
    specs: Mapping[str, FeatureSpec] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert_no_tensors(self.metadata, where="SampleRef.metadata")
        validate_sample_id(self.sample_id)
        if not isinstance(self.store, str) or not self.store:
            raise InvalidRefError(f"SampleRef.store must be a non-empty URI, got {self.store!r}")
        if not isinstance(self.generation, int) or isinstance(self.generation, bool):
            raise InvalidRefError(f"SampleRef.generation must be an int, got {self.generation!r}")
        if self.generation < 0:
            raise InvalidRefError(f"SampleRef.generation must be >= 0, got {self.generation}")
        if not isinstance(self.specs, Mapping):
            raise InvalidRefError(f"SampleRef.specs must be a mapping, got {self.specs!r}")
        for name, spec in self.specs.items():
            validate_feature_name(name)
            if not isinstance(spec, FeatureSpec):
                raise InvalidRefError(f"SampleRef.specs[{name!r}] must be a FeatureSpec")
        object.__setattr__(self, "specs", dict(self.specs))
        object.__setattr__(self, "metadata", validate_metadata(self.metadata))

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "store": self.store,
            "generation": self.generation,
            "specs": {name: spec.to_dict() for name, spec in self.specs.items()},
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: object) -> SampleRef:
        keys = {"sample_id", "store", "generation", "specs", "metadata"}
        if not isinstance(data, dict) or set(data) != keys:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise InvalidRefError(f"a SampleRef needs exactly the keys {sorted(keys)}, got {got}")
        specs = data["specs"]
        if not isinstance(specs, dict):
            raise InvalidRefError(f"SampleRef specs must be an object, got {specs!r}")
        return cls(
            sample_id=data["sample_id"],
            store=data["store"],
            generation=data["generation"],
            specs={name: FeatureSpec.from_dict(s) for name, s in specs.items()},
            metadata=data["metadata"],
        )

    def to_json(self) -> str:
        try:
            return _JSON.encode(self.to_dict())
        except TypeError:
            assert_no_tensors(self)  # metadata mutated after construction: say where
            raise

    @classmethod
    def from_json(cls, text: str | bytes) -> SampleRef:
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise InvalidRefError(f"not a JSON SampleRef: {exc}") from exc
        return cls.from_dict(data)


SpecCheck = Callable[[str, FeatureSpec], None]
_REF_FIELDS = ("sample_id", "store", "generation", "specs", "metadata")
_REF_KEYS = frozenset(_REF_FIELDS)
_SPEC_KEYS = frozenset(("shape", "dtype"))


def _no_check(name: str, spec: FeatureSpec) -> None:
    """The default ``check`` of :func:`ref_from_parsed`: every valid spec is fine."""


@functools.lru_cache(maxsize=4096)
def _parsed_spec(name: str, dtype: str, shape: tuple[int, ...], check: SpecCheck) -> FeatureSpec:
    # Cached by exact value (FeatureSpecs are immutable); a spec that fails raises, so
    # it is never cached.
    validate_feature_name(name)
    spec = FeatureSpec(shape, _dtype_from_name(dtype))
    check(name, spec)
    return spec


def ref_from_parsed(data: object, check: SpecCheck = _no_check) -> SampleRef:
    """``SampleRef.from_dict(data)`` for ``data`` fresh from ``json.loads`` of a ref that was
    valid when written (the ledger's, a stream's), then ``check`` of each spec.

    Its metadata is plain JSON by construction, so the tensor walk and the JSON
    round trip of ``SampleRef.__post_init__`` are skipped (most of a ref's
    decoding time), and specs are decoded once per distinct value. Anything
    unusual goes through ``from_dict``, which raises the precise error.
    """
    if type(data) is dict and data.keys() == _REF_KEYS:
        sample_id, store, generation = data["sample_id"], data["store"], data["generation"]
        specs, metadata = data["specs"], data["metadata"]
        plain = (
            type(store) is str
            and store
            and type(generation) is int
            and generation >= 0
            and type(specs) is dict
            and type(metadata) is dict
            and all(
                type(s) is dict
                and s.keys() == _SPEC_KEYS
                and type(s["dtype"]) is str
                and type(s["shape"]) is list
                and all(type(d) is int for d in s["shape"])
                for s in specs.values()
            )
        )
        if plain:
            validate_sample_id(sample_id)
            decoded = {
                name: _parsed_spec(name, s["dtype"], tuple(s["shape"]), check)
                for name, s in specs.items()
            }
            ref = object.__new__(SampleRef)
            for name, value in zip(
                _REF_FIELDS, (sample_id, store, generation, decoded, metadata), strict=True
            ):
                object.__setattr__(ref, name, value)
            return ref
    ref = SampleRef.from_dict(data)
    for name, spec in ref.specs.items():
        check(name, spec)
    return ref


def ref_from_ledger(text: str | bytes) -> SampleRef:
    """The ref a commit event's JSON holds (valid when it was committed)."""
    return ref_from_parsed(json.loads(text))
