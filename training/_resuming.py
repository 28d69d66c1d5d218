"""What a Trainer does around a resume: checks a checkpoint fits, and puts lost samples back."""

from __future__ import annotations

import hashlib
import logging
import random
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from dataflow import InvalidArgumentError, Producer
from training._dist import agree
from training._errors import IncompatibleCheckpointError
from training._layout import rank_file
from training._rng import rng_state, set_rng_state

log = logging.getLogger("training")

#: Called with the ids to regenerate on a resume; yields ``(sample_id, features)``.
RegenerateFn = Callable[[list[str]], Iterable[tuple[str, Mapping[str, torch.Tensor]]]]
#: The state entry where the Trainer records its set-up (checked on resume).
TRAINER_ENTRY = "trainer"
#: The per-rank state entry where the Trainer records the rank's data position.
DATA_ENTRY = "data"
#: The per-rank state entry where the Trainer records the rank's random generators.
RNG_ENTRY = "rng"
#: The producer id under which rank 0 commits regenerated samples.
REGENERATE_PRODUCER_ID = "trainer-regenerate"


def _derived_seed(digest: str, rank: int) -> int:
    """A 63-bit seed for ``rank``'s fresh generators, from old rank 0's file digest."""
    key = f"{digest}:{rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) >> 1


def _seed_generators(seed: int) -> None:
    """Seed what ``rng_state`` saves: Python's, NumPy's (when installed) and torch's."""
    random.seed(seed)
    torch.manual_seed(seed)  # the CPU's and every accelerator device's
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


class _Resuming:
    """The resume checks and regeneration of ``Trainer`` (a part of the trainer)."""

    def _setup(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this trainer."""
        consumer = self.consumer
        # A seeded dataset's size, once it is whole: a seeded stream trains while its
        # producers still commit, and its size at a checkpoint says nothing then.
        sized = consumer.order_seed is not None and consumer.producers_done
        return {
            "grad_accum": self.config.grad_accum,
            "world_size": consumer.world_size,
            "order_seed": consumer.order_seed,
            "dataset_size": len(consumer.state.committed) if sized else None,
        }

    def _check_resumable(self, state: dict, rank_state: dict | None) -> None:
        """Before the resume event: refuse a checkpoint of a differently set-up run."""
        self._resumed_rank_state = rank_state
        self._check_model_keys(state)
        resized = self._note_resize()
        data = (rank_state or {}).get(DATA_ENTRY)
        self._resumed_position = 0
        # A resize starts a new split: the saved positions were places in the old ranks'
        # queues, and this rank's batches now start where its new queue starts (0).
        if not resized and isinstance(data, dict) and "position" in data:
            # The loader checks its own state: in a seeded order a place in the rank's
            # queue, where batches must line up; in arrival order only a count.
            try:
                self.loader.load_state_dict(data)
            except ValueError as exc:
                raise IncompatibleCheckpointError(
                    f"cannot resume rank {self.consumer.rank} of run {self.consumer.run_id!r}: "
                    f"{exc}"
                ) from None
            self._resumed_position = data["position"]
        saved = state.get(TRAINER_ENTRY)
        if not isinstance(saved, dict) or "grad_accum" not in saved:
            return  # not saved by a Trainer: nothing to compare
        mine = self._setup()
        consumer = self.consumer
        compared = ("grad_accum", "order_seed") + (
            () if self.config.allow_resize else ("world_size",)
        )
        problems = [
            f"{name} was {saved.get(name)!r}, now {mine[name]!r}"
            for name in compared
            if saved.get(name) != mine[name]
        ]
        # The dataset: only a committed one has a size, and only rank 0 has caught up.
        sizes = saved.get("dataset_size"), mine["dataset_size"]
        comparable = consumer.rank == 0 and None not in sizes and consumer.producers_done
        if comparable and sizes[0] != sizes[1]:
            problems.append(f"dataset_size was {sizes[0]}, now {sizes[1]}")
        if problems:
            resize = (
                "; to re-split the run over another number of ranks, pass "
                'TrainerConfig(allow_resize=True) (docs/operations.md, "Resizing a run")'
                if saved.get("world_size") != mine["world_size"] and not self.config.allow_resize
                else ""
            )
            raise IncompatibleCheckpointError(
                f"cannot resume run {consumer.run_id!r} from this checkpoint: "
                + "; ".join(problems)
                + ". Resume with the set-up it was saved with"
                + resize
            )

    def _note_resize(self) -> bool:
        """Whether this resume changes the number of ranks; note what this rank's own
        state becomes. (Without ``allow_resize``, the manager refused a checkpoint with
        per-rank state already, and the set-up check refuses the others.)"""
        saved = self.checkpoints.resumed_from
        rank = self.consumer.rank
        if saved is None or saved.world_size == self.consumer.world_size:
            return False
        if saved.has_rank_state and rank >= saved.world_size:
            self._new_rank = True
            if RNG_ENTRY in saved.manifest.get("entries", {}).get("rank", ()):
                # Old rank 0's file digest covers its generators: the same checkpoint
                # resumed on the same world always gives this rank the same ones.
                sha256 = saved.manifest["files"][rank_file(0)]["sha256"]
                self._fresh_seed = _derived_seed(sha256, rank)
        return True

    def _check_model_keys(self, state: dict) -> None:
        """The checkpoint's model must have exactly this model's keys (before any load)."""
        saved = state.get("model")
        if self.model is None or not isinstance(saved, Mapping):
            return
        mine, theirs = set(self.model.state_dict()), set(saved)
        if not mine & theirs:
            raise IncompatibleCheckpointError(
                f"the checkpoint's model has no key in common with this model (saved: "
                f"{sorted(theirs)[:5]}, this model: {sorted(mine)[:5]}): another model, or a "
                "wrapped one (save and pass the unwrapped module, not the DDP wrapper)"
            )
        unexpected, missing = sorted(theirs - mine), sorted(mine - theirs)
        if unexpected or missing:
            raise IncompatibleCheckpointError(
                f"the checkpoint's model does not fit this model: unexpected keys "
                f"{unexpected[:10]}, missing keys {missing[:10]}"
            )

    def _regenerate(self, sample_ids: list[str]) -> None:
        """Rank 0 puts the released samples back, as producer ``REGENERATE_PRODUCER_ID``;
        the other ranks wait for it (an error on rank 0 is raised on every rank)."""
        consumer = self.consumer
        error = None
        if consumer.rank == 0:
            try:
                self._put_back(sample_ids)
            except Exception as exc:
                error = exc
        agree(
            error,
            world_size=consumer.world_size if self._distributed() else 1,
            rank=consumer.rank,
            what="regeneration",
        )
        log.info("regenerated %d samples of run %r", len(sample_ids), consumer.run_id)

    def _put_back(self, sample_ids: list[str]) -> None:
        """Commit ``regenerate_fn``'s features for ``sample_ids`` as ``REGENERATE_PRODUCER_ID``
        (rank 0) or ``REGENERATE_PRODUCER_ID-rankN``: a producer id is held by one process at
        a time, and ranks put back what they found lost at once."""
        consumer = self.consumer
        suffix = f"-rank{consumer.rank}" if consumer.rank else ""
        producer = Producer(
            consumer.ledger,
            consumer.store,
            run_id=consumer.run_id,
            producer_id=REGENERATE_PRODUCER_ID + suffix,
        )
        wanted = set(sample_ids)
        # The training's generators come out as they went in: a regenerate_fn that draws
        # from (or seeds) the global ones must not change what the steps after draw, or a
        # resume that regenerates would not end with the uninterrupted run's weights.
        generators = rng_state()
        try:
            for sample_id, tensors in self.regenerate_fn(sample_ids):  # type: ignore[misc]
                if sample_id not in wanted:
                    raise InvalidArgumentError(
                        f"regenerate_fn returned {sample_id!r}, which is not to regenerate"
                    )
                producer.regenerate(sample_id, tensors)
                wanted.discard(sample_id)
        finally:
            set_rng_state(generators)
        producer.close()
        if wanted:
            raise InvalidArgumentError(
                f"regenerate_fn left out {len(wanted)} samples to regenerate: {sorted(wanted)[:10]}"
            )

    def _on_lost(self, sample_ids: list[str]) -> None:
        """The loader found features gone: this rank, the only one that knows, puts them back
        (no collective: the other ranks may be anywhere in their step)."""
        if self.regenerate_fn is None:
            warnings.warn(
                f"{len(sample_ids)} samples of run {self.consumer.run_id!r} lost their features "
                f"({sample_ids[:5]}): without a regenerate_fn, a producer must regenerate them "
                "(Producer.regenerate) before they are trained",
                stacklevel=2,
            )
            return
        self._put_back(sample_ids)
        log.info("regenerated %d lost samples of run %r", len(sample_ids), self.consumer.run_id)
