"""Reading the features of leased refs into batches: what ``FeatureLoader`` hands out."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dataflow import (
    CorruptFeatureError,
    DataflowError,
    InvalidArgumentError,
    SampleRef,
    StaleRefError,
    StoreUnavailableError,
)
from training._collate import PadCollate
from training._patience import patiently

Features = dict[str, torch.Tensor]
CollateFn = Callable[[list[Features]], Any]

log = logging.getLogger("training")


def collate(samples: list[Features]) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Stack each feature when shapes and dtypes match across samples, else list it."""
    names = list(samples[0])
    for sample in samples[1:]:
        if set(sample) != set(names):
            raise InvalidArgumentError(
                f"samples of one batch have different features: {sorted(names)} and "
                f"{sorted(sample)}; pass LoaderConfig(names=...) or a collate_fn"
            )
    batch: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for name in names:
        tensors = [sample[name] for sample in samples]
        first = tensors[0]
        if all(t.shape == first.shape and t.dtype == first.dtype for t in tensors):
            batch[name] = torch.stack(tensors)
        else:
            batch[name] = tensors
    return batch


def pinned(value: Any) -> Any:
    """``value`` with each CPU tensor in it (in dicts, lists and tuples) in pinned memory;
    a tensor already on a device stays where it is."""
    if isinstance(value, torch.Tensor):
        return value if value.device.type != "cpu" or value.is_pinned() else value.pin_memory()
    if isinstance(value, dict):
        return {key: pinned(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [pinned(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


@dataclass
class _Read:
    """What reading a leased batch gave: the refs that loaded, collated, and the stale ones."""

    refs: list[SampleRef]
    features: Any
    lost: list[tuple[SampleRef, str]]
    #: Batches still to come after this one, counted right after it was leased ahead
    #: (None: the number is not fixed yet).
    remaining: int | None = None
    counted: bool = False


def _each_loaded(
    refs: Sequence[SampleRef], load: Callable[[int, SampleRef], object], *, patience: float
) -> tuple[list[int], list[tuple[SampleRef, str]]]:
    """``load(row, ref)`` of each ref: the rows that loaded, and the refs whose features
    are gone or corrupt, with why (the loader reports them lost). A load the store cannot
    serve now goes on being tried for ``patience`` seconds (see :func:`_patiently`)."""
    loaded: list[int] = []
    lost: list[tuple[SampleRef, str]] = []
    for row, ref in enumerate(refs):
        try:
            _patiently(functools.partial(load, row, ref), [ref], patience)
        except StaleRefError as exc:
            lost.append((ref, f"features gone: {exc}"))
        except CorruptFeatureError as exc:
            lost.append((ref, f"features corrupt: {exc}"))
        else:
            loaded.append(row)
    return loaded, lost


def _patiently(attempt: Callable[[], object], refs: Sequence[SampleRef], patience: float) -> None:
    """``attempt()``, again while it raises StoreUnavailableError, for up to ``patience``
    seconds: a store's server restarting, or a dead machine's samples until the server
    drops it and they turn stale (which the loader reports lost, not as an error).
    ``refs`` are the samples it reads, named in the log and the error's note."""
    patiently(
        attempt,
        passing=StoreUnavailableError,
        patience=patience,
        warning=lambda exc: (
            f"cannot read {_named(refs)} now ({exc}); reading it again for up to "
            f"{patience:g}s (LoaderConfig.unavailable_timeout)"
        ),
        note=lambda: (
            f"the loader read {_named(refs)} again for {patience:g}s "
            "(LoaderConfig.unavailable_timeout) and its store could not serve it"
        ),
    )


def _named(refs: Sequence[SampleRef]) -> str:
    """``sample 'a'``, or ``samples 'a', 'b', 'c' and 5 more``."""
    ids = ", ".join(repr(ref.sample_id) for ref in refs[:3])
    more = f" and {len(refs) - 3} more" if len(refs) > 3 else ""
    return f"sample {ids}" if len(refs) == 1 else f"samples {ids}{more}"


def _empty_features(
    refs: Sequence[SampleRef], names: Sequence[str] | None
) -> list[dict[str, torch.Tensor]] | None:
    """Empty tensors for the features ``names`` (all, when None) of each ref, as its
    specs say; None when a ref lacks one of ``names``."""
    outs = []
    for ref in refs:
        wanted = list(ref.specs) if names is None else names
        if any(name not in ref.specs for name in wanted):
            return None
        outs.append({n: torch.empty(ref.specs[n].shape, dtype=ref.specs[n].dtype) for n in wanted})
    return outs


class _BatchReading:
    """How ``FeatureLoader`` reads a leased batch's features (a part of the loader)."""

    #: The loader's ledger call, made again while the ledger fails (``LedgerPatience``).
    _ledger: Callable[..., Any]

    def _read(self, refs: Sequence[SampleRef]) -> _Read:
        batch = self._batch_for(refs) if self.collate_fn is collate else None
        if batch is not None:
            return self._read_into(refs, batch)
        padded = self._padded_for(refs) if isinstance(self.collate_fn, PadCollate) else None
        if padded is not None:
            return self._read_into(refs, *padded)
        names = self.config.names
        outs = _empty_features(refs, names)
        if outs is None:  # a ref lacks a feature asked for: the store's get says which
            samples: list[Features] = []
            loaded, lost = _each_loaded(
                refs,
                lambda _, ref: samples.append(self.consumer.load(ref, names=names)),
                patience=self.config.unavailable_timeout,
            )
        else:  # each sample in tensors of its own, for collate_fn, in one read
            loaded, lost = self._read_rows(refs, outs)
            samples = [outs[row] for row in loaded]
        features = self.collate_fn(samples) if samples else None
        if self._pin:
            features = pinned(features)
        return _Read([refs[row] for row in loaded], features, lost)

    def _batch_for(self, refs: Sequence[SampleRef]) -> dict[str, torch.Tensor] | None:
        """Empty batch tensors for ``refs`` when each feature read has one spec across
        them (what ``collate`` would stack); else None."""
        if not refs:
            return None
        first = refs[0].specs
        names = list(first) if self.config.names is None else list(self.config.names)
        if not names or any(name not in first for name in names):
            return None  # nothing to stack, or the store's get names the missing feature
        for ref in refs[1:]:
            specs = ref.specs
            if (self.config.names is None and specs.keys() != first.keys()) or any(
                specs.get(name) != first[name] for name in names
            ):
                return None
        return {
            name: torch.empty(
                (len(refs), *first[name].shape), dtype=first[name].dtype, pin_memory=self._pin
            )
            for name in names
        }

    def _padded_for(
        self, refs: Sequence[SampleRef]
    ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]] | None:
        """A ``PadCollate`` batch for ``refs`` and each ref's rows in it, from their specs;
        None when a ref lacks a feature read, or the specs do not pad into one batch (the
        collate of samples read one by one then raises, or the store's get, naming it)."""
        names = self.config.names
        specs = []
        for ref in refs:
            wanted = list(ref.specs) if names is None else list(names)
            if any(name not in ref.specs for name in wanted):
                return None
            specs.append({name: ref.specs[name] for name in wanted})
        try:
            return self.collate_fn.empty(specs, pin_memory=self._pin)  # type: ignore[attr-defined]
        except DataflowError:
            return None

    def _read_into(
        self,
        refs: Sequence[SampleRef],
        batch: dict[str, torch.Tensor],
        rows: list[dict[str, torch.Tensor]] | None = None,
    ) -> _Read:
        """``_read`` straight into the rows of ``batch`` (``rows``: each ref's views of it,
        default ``batch[name][i]``): no tensor per sample, no stacking."""
        if rows is None:
            rows = [{n: t[row] for n, t in batch.items()} for row in range(len(refs))]
        loaded, lost = self._read_rows(refs, rows)
        if not loaded:
            return _Read([], None, lost)
        if lost:  # rare: keep the rows that loaded
            kept = torch.tensor(loaded)
            batch = {name: tensor[kept] for name, tensor in batch.items()}
            if self._pin:
                batch = pinned(batch)
        return _Read([refs[row] for row in loaded], batch, lost)

    def _read_rows(
        self, refs: Sequence[SampleRef], outs: list[dict[str, torch.Tensor]]
    ) -> tuple[list[int], list[tuple[SampleRef, str]]]:
        """Read each ref into its ``outs`` row: the rows that loaded, and the lost refs."""
        store, patience = self.consumer.store, self.config.unavailable_timeout
        items = list(zip(refs, outs, strict=True))
        try:  # the whole batch in one read (Mooncake: one round trip)
            _patiently(lambda: store.get_many_into(items), refs, patience)
        except (StaleRefError, CorruptFeatureError):  # which? read each, report those lost
            return _each_loaded(
                refs, lambda row, ref: store.get_into(ref, outs[row]), patience=patience
            )
        return list(range(len(refs))), []

    def _settle_lost(self, lost: list[tuple[SampleRef, str]]) -> None:
        if not lost:
            return
        for ref, reason in lost:
            warnings.warn(
                f"{reason[:300]} (sample {ref.sample_id!r}, store {ref.store}); reported lost "
                "and skipped: it is trained once it is regenerated",
                stacklevel=3,
            )
            self._ledger(self.consumer.lost, [ref], reason=reason[:1000])
        if self.on_lost is not None:
            self.on_lost([ref.sample_id for ref, _ in lost])
