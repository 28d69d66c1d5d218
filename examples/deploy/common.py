"""What the walk-through's producers and ranks share: the sample set and its features.

A sample's features are a pure function of its id, so a rank can regenerate a sample
whose features were freed (a resume from an older checkpoint) with the producers' code.
"""

from __future__ import annotations

import os

import torch

HIDDEN = 32


def env(name: str) -> str:
    """A setting of the walk-through (docs/deploy.md exports them); a clear error if unset."""
    value = os.environ.get(name)
    if not value:
        raise SystemExit(f"{name} is not set: export it as docs/deploy.md shows")
    return value


def sample_ids(producer: int, producers: int, samples: int) -> list[str]:
    """The ids producer ``producer`` of ``producers`` makes: every producers-th prompt."""
    return [f"prompt-{i:06d}" for i in range(producer, samples, producers)]


def features(sample_id: str) -> dict[str, torch.Tensor]:
    """The features of one sample: a hidden state and a regression target."""
    generator = torch.Generator().manual_seed(int(sample_id.rsplit("-", 1)[1]))
    hidden = torch.randn(HIDDEN, generator=generator)
    return {"hidden": hidden, "target": hidden[:4].sum(0, keepdim=True)}
