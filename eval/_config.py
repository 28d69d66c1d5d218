"""EvalConfig: the identity of an eval pass."""

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from eval._errors import EvalError, short_repr

# Fields that change how an eval runs but not what it measures.
_NOT_IDENTITY = {"identity": False}

# Integers of extra must fit 64 bits (signed or unsigned): many JSON readers lose the
# rest, and Python itself refuses to print one of more than 4300 digits.
_INT_RANGE = (-(2**63), 2**64 - 1)


class _ReadOnlyDict(dict[str, Any]):
    """``EvalConfig.extra``: a dict whose mutating methods raise ``TypeError``.

    A dict (not a ``MappingProxyType``) so that a config pickles, deep-copies and goes
    through ``dataclasses.asdict``; ``__reduce__`` rebuilds it from a plain dict, since
    unpickling a dict subclass would otherwise call the refused ``__setitem__``.
    """

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            "EvalConfig.extra is read-only; make another config with "
            "dataclasses.replace(config, extra=...)."
        )

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple[type["_ReadOnlyDict"], tuple[dict[str, Any]]]:
        return type(self), (dict(self),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """What an eval pass measures: its data, target model, tokenizer and shapes.

    Every field but ``micro_batch_size`` is part of the identity that ``EvalCache``
    keys on; metrics do not depend on the micro-batch size. Paths are kept as given
    (``os.PathLike`` is turned into ``str``), so a relative path means the same entry
    from any working directory.
    """

    eval_data_path: str
    """Path or URI of the eval data set."""

    target_model_path: str
    """Path or hub id of the target model that feeds the draft model."""

    chat_template: str
    """Name or text of the chat template used to render the eval conversations."""

    aux_hidden_state_layer_ids: tuple[int, ...]
    """Target-model layers whose hidden states the draft model reads, in that order."""

    max_seq_len: int
    """Sequences are truncated to this many tokens."""

    target_model_revision: str | None = None
    """Commit, tag or branch of the target model; ``None`` for a local directory."""

    tokenizer_path: str | None = None
    """Tokenizer path or hub id; ``None`` means ``target_model_path``."""

    micro_batch_size: int = dataclasses.field(default=1, metadata=_NOT_IDENTITY)
    """Samples per forward pass; not part of the identity."""

    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    """User fields of the identity: a JSON object (str keys, finite numbers, ints of at
    most 64 bits, no cycles); kept as a read-only copy."""

    def __post_init__(self) -> None:
        for name in ("eval_data_path", "target_model_path", "chat_template"):
            self._set(name, _non_empty_str(name, getattr(self, name)))
        for name in ("target_model_revision", "tokenizer_path"):
            if getattr(self, name) is not None:
                self._set(name, _non_empty_str(name, getattr(self, name)))
        if self.tokenizer_path is None:
            self._set("tokenizer_path", self.target_model_path)
        for name in ("max_seq_len", "micro_batch_size"):
            _positive_int(name, getattr(self, name))
        self._set("aux_hidden_state_layer_ids", _layer_ids(self.aux_hidden_state_layer_ids))
        if not isinstance(self.extra, Mapping):
            raise EvalError(
                f"extra is a {type(self.extra).__name__}; pass a mapping of JSON values."
            )
        try:
            plain = _json_copy("extra", self.extra, ancestors={})
        except RecursionError:
            raise EvalError(
                "extra is nested too deeply to encode; flatten it (e.g. join deep keys)."
            ) from None
        # A private copy, so mutating the caller's dict cannot change this identity; the
        # JSON round trip turns subclasses (IntEnum, str subclasses ...) into plain values.
        self._set("extra", _ReadOnlyDict(json.loads(json.dumps(plain))))

    def identity(self) -> dict[str, Any]:
        """The fields that define what this eval measures, as a JSON-able dict."""
        identity = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.metadata.get("identity", True)
        }
        identity["aux_hidden_state_layer_ids"] = list(self.aux_hidden_state_layer_ids)
        identity["extra"] = json.loads(json.dumps(dict(self.extra)))
        return identity

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)


def _non_empty_str(name: str, value: object) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise EvalError(f"{name} is {value!r}; pass a non-empty string.")
    return value


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EvalError(f"{name} is {value!r}; pass a positive int.")


def _layer_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise EvalError(
            f"aux_hidden_state_layer_ids is {value!r}; pass a tuple of layer indices, "
            "e.g. (2, 16, 29)."
        )
    for layer in value:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise EvalError(
                f"aux_hidden_state_layer_ids holds {layer!r}; layer ids are non-negative ints."
            )
    if len(set(value)) != len(value):
        raise EvalError(
            f"aux_hidden_state_layer_ids {tuple(value)!r} repeats a layer; list each once."
        )
    return tuple(value)


def _json_copy(path: str, value: object, *, ancestors: dict[int, str]) -> object:
    """A copy of ``value`` with plain dicts and lists, after rejecting what JSON refuses or
    silently changes (non-str keys, NaN, huge ints, sets, objects, cycles).

    ``ancestors`` maps the ids of the containers enclosing ``value`` to their paths:
    meeting one again is a cycle (the same list twice side by side is not).
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise EvalError(
                f"{path} is {short_repr(value)}, beyond 64 bits; pass a larger int as a string."
            )
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise EvalError(f"{path} is {value!r}; JSON has no NaN or infinity.")
        return value
    if isinstance(value, Mapping | list | tuple):
        if id(value) in ancestors:
            raise EvalError(
                f"{path} is {ancestors[id(value)]} itself (a cycle), which JSON cannot "
                "encode; pass a tree of values."
            )
        ancestors[id(value)] = path
        try:
            if isinstance(value, Mapping):
                copy = {}
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise EvalError(
                            f"{path} has the key {short_repr(key)}; JSON object keys must be "
                            "strings."
                        )
                    copy[key] = _json_copy(f"{path}[{key!r}]", item, ancestors=ancestors)
                return copy
            return [
                _json_copy(f"{path}[{i}]", item, ancestors=ancestors)
                for i, item in enumerate(value)
            ]
        finally:
            del ancestors[id(value)]
    raise EvalError(
        f"{path} is a {type(value).__name__} ({short_repr(value)}); extra holds JSON values "
        "only (None, bool, int, float, str, lists and str-keyed dicts of them)."
    )
