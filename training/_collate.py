"""Padding variable-length features into one batch: ``PadCollate``.

Sequence features (token ids, hidden states, masks) differ in length from sample to
sample. ``PadCollate`` pads the named features along their first dimension to the
longest sample of the batch and adds a mask of the real positions and the lengths. Each
sample's tensor is copied once, into its row of the batch tensor; with a
``FeatureLoader`` (``collate_fn=PadCollate(...)``) the store reads each sample straight
into that row, so there is no tensor per sample at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dataflow import FeatureSpec, InvalidArgumentError

Features = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class PadCollate:
    """A ``collate_fn`` that pads the features ``pad`` along their first dimension.

    For a batch of ``B`` samples whose longest is ``L`` positions (rounded up to a
    multiple of ``multiple_of``), each feature in ``pad`` becomes ``[B, L, *rest]`` with
    sample ``i`` in ``[i, :length_i]`` and ``pad_values[name]`` (default 0) after it;
    its dtype is kept. Every feature in ``pad`` of one sample must have the same first
    dimension (its length) and, across samples, the same dtype and trailing dimensions.
    The other features are stacked and must match in shape and dtype across the batch.
    Two tensors are added: ``mask`` (``[B, L]`` bool, True at real positions) and, unless
    ``lengths`` is None, ``lengths`` (``[B]`` int64).
    """

    pad: tuple[str, ...]
    """The features padded along their first dimension (the sequence)."""
    pad_values: Mapping[str, int | float | bool] = field(default_factory=dict)
    """The value each padded feature is filled with past a sample's length (default 0)."""
    mask: str = "attention_mask"
    """The name of the added ``[B, L]`` bool mask of real positions."""
    lengths: str | None = "lengths"
    """The name of the added ``[B]`` int64 lengths; None adds none."""
    multiple_of: int = 1
    """Round the padded length up to a multiple of this (a kernel may want 8 or 64)."""

    def __post_init__(self) -> None:
        if isinstance(self.pad, str) or not all(isinstance(n, str) for n in self.pad):
            raise InvalidArgumentError(
                f"pad must be a tuple of feature names, got {self.pad!r}; e.g. pad=('input_ids',)"
            )
        if not self.pad:
            raise InvalidArgumentError("pad names no feature: name the sequence features to pad")
        object.__setattr__(self, "pad", tuple(self.pad))
        unknown = sorted(set(self.pad_values) - set(self.pad))
        if unknown:
            raise InvalidArgumentError(
                f"pad_values names {unknown}, which are not in pad={self.pad}"
            )
        added = [self.mask] if self.lengths is None else [self.mask, self.lengths]
        clash = sorted(set(added) & set(self.pad))
        if clash or len(set(added)) != len(added):
            raise InvalidArgumentError(
                f"mask={self.mask!r} and lengths={self.lengths!r} must be two new names, "
                f"not a padded feature's {clash}"
            )
        if isinstance(self.multiple_of, bool) or not isinstance(self.multiple_of, int):
            raise InvalidArgumentError(f"multiple_of must be an int, got {self.multiple_of!r}")
        if self.multiple_of < 1:
            raise InvalidArgumentError(f"multiple_of must be >= 1, got {self.multiple_of}")

    def __call__(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> Features:
        """The padded batch of ``samples``: each sample copied once, into its row."""
        if not samples:
            raise InvalidArgumentError("PadCollate got no samples: a batch needs one at least")
        specs = [{name: FeatureSpec.of(t) for name, t in sample.items()} for sample in samples]
        batch, rows = self.empty(specs)
        for sample, row in zip(samples, rows, strict=True):
            for name, out in row.items():
                out.copy_(sample[name])
        return batch

    def empty(
        self, specs: Sequence[Mapping[str, FeatureSpec]], *, pin_memory: bool = False
    ) -> tuple[Features, list[Features]]:
        """The batch for samples of these ``specs``, padded, masked, its data unset; and
        for each sample, views of its rows (contiguous: ``batch[name][i, :length_i]``)
        that a store's ``get_many_into`` reads the sample into."""
        if not specs:
            raise InvalidArgumentError("PadCollate got no samples: a batch needs one at least")
        first = specs[0]
        names = list(first)
        missing = [name for name in self.pad if name not in first]
        if missing:
            raise InvalidArgumentError(
                f"PadCollate pads {missing}, which the samples do not have (they have "
                f"{sorted(first)}); name the sequence features in pad"
            )
        taken = [name for name in (self.mask, self.lengths) if name in first]
        if taken:
            raise InvalidArgumentError(
                f"the samples have features named {taken}, which PadCollate adds; pass "
                "PadCollate(mask=..., lengths=...) other names"
            )
        lengths = [self._length(i, spec) for i, spec in enumerate(specs)]
        for i, spec in enumerate(specs[1:], start=1):
            self._check_like(i, spec, first)
        longest = max(lengths)
        longest += -longest % self.multiple_of
        batch: Features = {}
        for name in names:
            spec = first[name]
            if name in self.pad:
                shape = (len(specs), longest, *spec.shape[1:])
                value = self.pad_values.get(name, 0)
                batch[name] = torch.full(shape, value, dtype=spec.dtype, pin_memory=pin_memory)
            else:
                shape = (len(specs), *spec.shape)
                batch[name] = torch.empty(shape, dtype=spec.dtype, pin_memory=pin_memory)
        length = torch.tensor(lengths, dtype=torch.int64)
        batch[self.mask] = torch.arange(longest)[None, :] < length[:, None]
        if self.lengths is not None:
            batch[self.lengths] = length
        rows = [
            {name: batch[name][i, :n] if name in self.pad else batch[name][i] for name in names}
            for i, n in enumerate(lengths)
        ]
        return batch, rows

    def _length(self, index: int, spec: Mapping[str, FeatureSpec]) -> int:
        """The one first dimension of sample ``index``'s padded features."""
        lengths = {}
        for name in self.pad:
            shape = spec[name].shape if name in spec else None
            if not shape:
                raise InvalidArgumentError(
                    f"sample {index} of the batch has no {name!r} with a first dimension to "
                    f"pad (shape {None if shape is None else list(shape)})"
                )
            lengths[name] = shape[0]
        if len(set(lengths.values())) > 1:
            raise InvalidArgumentError(
                f"the padded features of sample {index} differ in length: {lengths}; every "
                "feature in pad must have the sample's length as its first dimension"
            )
        return next(iter(lengths.values()))

    def _check_like(
        self, index: int, spec: Mapping[str, FeatureSpec], first: Mapping[str, FeatureSpec]
    ) -> None:
        """Sample ``index`` has the features of sample 0, of its dtypes and shapes (bar the
        padded first dimension)."""
        if set(spec) != set(first):
            raise InvalidArgumentError(
                f"samples of one batch have different features: {sorted(first)} and "
                f"{sorted(spec)} (sample {index}); pass LoaderConfig(names=...)"
            )
        for name, want in first.items():
            got = spec[name]
            trail = 1 if name in self.pad else 0
            if got.dtype != want.dtype or got.shape[trail:] != want.shape[trail:]:
                what = "trailing dimensions" if trail else "shape"
                raise InvalidArgumentError(
                    f"feature {name!r} of sample {index} is {got.dtype} {list(got.shape)}, "
                    f"sample 0's {want.dtype} {list(want.shape)}: the {what} and dtype must "
                    f"match across a batch"
                    + ("" if trail else f"; add {name!r} to pad if it is a sequence")
                )
