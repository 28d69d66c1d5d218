"""The demo's models and data: a small frozen target network, the draft heads trained on its
hidden states, and the synthetic prompts both are fed.

The target network is a tiny language model over ``VOCAB`` tokens: its hidden state at a
position depends on the current and the previous token, and its LM head picks the next
token greedily. A prompt is a token sequence it "generates" (greedy, with a little noise).
The draft model is a set of Medusa-style heads: head ``k`` predicts, from the target's
hidden state at position ``t``, the token at ``t + 1 + k``, which is what speculative
decoding proposes and the target then verifies. Everything is seeded: the features of a
sample id are the same in every process, so a trainer can regenerate them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

VOCAB = 32
HIDDEN = 64
SEQ = 16  # hidden states per sample
DRAFT = 3  # draft positions: the heads of the draft model
NOISE = 0.1  # chance that a generated token is random rather than the target's greedy pick
EVAL_SAMPLES = 64
EVAL_BATCH = 16


def sample_id(index: int) -> str:
    return f"prompt-{index:06d}"


def producer_id(index: int) -> str:
    """The id of demo producer ``index``: kept across its restarts, named by the ranks."""
    return f"producer-{index}"


def sample_index(sample_id: str) -> int:
    return int(sample_id.rsplit("-", 1)[1])


class TargetNetwork(torch.nn.Module):
    """The frozen model whose hidden states the draft heads learn to read."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        scale = 1 / math.sqrt(HIDDEN)
        self.register_buffer("embed", torch.randn(VOCAB, HIDDEN, generator=g))
        self.register_buffer("embed_prev", 0.5 * torch.randn(VOCAB, HIDDEN, generator=g))
        self.register_buffer("w1", scale * torch.randn(HIDDEN, HIDDEN, generator=g))
        self.register_buffer("w2", scale * torch.randn(HIDDEN, HIDDEN, generator=g))
        self.register_buffer("lm_head", 4 * scale * torch.randn(HIDDEN, VOCAB, generator=g))
        self.seed = seed
        self.requires_grad_(False)
        self.eval()
        # The greedy next token for every (previous, current) pair: generation is a lookup.
        prev, cur = torch.meshgrid(torch.arange(VOCAB), torch.arange(VOCAB), indexing="ij")
        self.greedy = self._logits(self._hidden(cur, prev)).argmax(-1)  # [prev, cur]

    def _hidden(self, tokens: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens] + self.embed_prev[previous]
        return torch.tanh(x @ self.w1) @ self.w2 + x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head

    @torch.no_grad()
    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[..., L]`` token ids -> ``[..., L, HIDDEN]`` hidden states (the first token is its
        own predecessor)."""
        previous = torch.cat([tokens[..., :1], tokens[..., :-1]], dim=-1)
        return self._hidden(tokens, previous)

    def generate(self, generator: torch.Generator, length: int) -> torch.Tensor:
        """A prompt of ``length`` tokens: two random ones, then greedy picks with noise."""
        tokens = torch.randint(0, VOCAB, (length,), generator=generator)
        noise = torch.rand(length, generator=generator) < NOISE
        for t in range(2, length):
            if not noise[t]:
                tokens[t] = self.greedy[tokens[t - 2], tokens[t - 1]]
        return tokens

    def features(self, index: int, *, split: str = "train") -> dict[str, torch.Tensor]:
        """The features of sample ``index``: the target's hidden states of its prompt
        (bfloat16, as a serving engine would hand them over) and the draft targets."""
        salt = 0 if split == "train" else 1 << 40
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + salt + index)
        tokens = self.generate(g, SEQ + DRAFT)
        positions = torch.arange(SEQ)[:, None] + 1 + torch.arange(DRAFT)[None, :]
        return {
            "hidden": self.hidden_states(tokens[:SEQ]).to(torch.bfloat16),
            "targets": tokens[positions],  # [SEQ, DRAFT]: head k at t predicts t + 1 + k
        }

    def eval_batches(self, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's shard of the eval set: ``(hidden, targets)`` batches."""
        mine = [self.features(i, split="eval") for i in range(rank, EVAL_SAMPLES, world_size)]
        return [
            (
                torch.stack([f["hidden"] for f in mine[i : i + EVAL_BATCH]]).float(),
                torch.stack([f["targets"] for f in mine[i : i + EVAL_BATCH]]),
            )
            for i in range(0, len(mine), EVAL_BATCH)
        ]


class DraftHeads(torch.nn.Module):
    """The draft model: a small trunk and one linear head per draft position."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(HIDDEN, width), torch.nn.GELU())
        self.heads = torch.nn.Linear(width, DRAFT * VOCAB)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, S, HIDDEN]`` -> logits ``[B, S, DRAFT, VOCAB]``."""
        return self.heads(self.trunk(hidden)).unflatten(-1, (DRAFT, VOCAB))


def draft_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every position and head (0 for an empty batch)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


def eval_outputs(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """One eval batch's output dict, as ``eval.Evaluator`` takes it: per draft position,
    how many of the head's predictions the target would accept."""
    hidden, targets = batch
    logits = model(hidden)
    correct = (logits.argmax(-1) == targets).sum(dim=(0, 1))
    count = targets.shape[0] * targets.shape[1]
    return {
        "loss": draft_loss(logits, targets) / max(targets.numel(), 1),
        "num_tokens": targets.numel(),
        "acc_corrects": correct,
        "acc_denoms": torch.full((DRAFT,), count),
    }
