"""The EAGLE-3 draft head, its training-time-test (TTT) loss and its acceptance counts.

The draft reads the target's hidden states of three layers (low, middle, high,
concatenated), projects them to the target's width (``fc``), and runs one decoder layer
whose input at position ``t`` is that projection beside the target's embedding of token
``t + 1``; a norm of its own and the target's frozen LM head turn its output into a
proposal for token ``t + 2``. Training-time test unrolls ``steps`` draft steps: step
``k + 1`` reads the draft's own output of step ``k`` in place of the target's hidden state,
with the token one further on, as speculative decoding does once it drafts past the
target's features; step ``k`` at position ``t`` is trained towards the target's
distribution at ``t + 1 + k``.

Simplifications against the paper, for a readable example: the layer attends causally
within one step (not across the steps' keys, as EAGLE-3's tree mask does), and it has no
rotary positions. The draft trains in float32; the bfloat16 features are cast on entry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: The weight of draft step k's loss is DECAY ** k (EAGLE-3's 0.8).
DECAY = 0.8


class DraftLayer(nn.Module):
    """One decoder layer over ``[embedding, hidden]`` (2 x H in, H out)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm_embed = nn.RMSNorm(hidden)
        self.norm_hidden = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(2 * hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.norm_mlp = nn.RMSNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 2 * hidden, bias=False),
            nn.SiLU(),
            nn.Linear(2 * hidden, hidden, bias=False),
        )

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """``[B, L, H]`` twice and a ``[B, L]`` bool mask of real positions -> ``[B, L, H]``."""
        b, n, h = hidden.shape
        x = torch.cat([self.norm_embed(embeds), self.norm_hidden(hidden)], -1)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).unbind(2)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        # A padded query attends to itself alone: a row of no keys would give NaN.
        allowed = (causal & mask[:, None, :]) | torch.eye(n, dtype=torch.bool)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None]
        )
        hidden = hidden + self.out(attn.transpose(1, 2).reshape(b, n, h))
        return hidden + self.mlp(self.norm_mlp(hidden))


class Eagle3Draft(nn.Module):
    """The draft head: ``fc`` of the three layers, one ``DraftLayer``, and the target's
    frozen embedding, final norm and LM head (buffers: not trained, not checkpointed)."""

    def __init__(self, target: nn.Module, *, steps: int) -> None:
        super().__init__()
        config = target.config
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.steps = steps
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.layer = DraftLayer(hidden, heads)
        self.norm = nn.RMSNorm(hidden)
        frozen = {
            "embed": target.get_input_embeddings().weight,
            "lm_head": target.get_output_embeddings().weight,
        }
        for name, weight in frozen.items():
            self.register_buffer(name, weight.detach().float().clone(), persistent=False)

    def target_log_probs(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's next-token log-probabilities from its final hidden state."""
        return F.log_softmax(last_hidden.float() @ self.lm_head.T, -1)

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor
    ) -> list[torch.Tensor]:
        """The logits of each draft step: ``steps`` tensors ``[B, L, vocab]``; step ``k`` at
        position ``t`` proposes token ``t + 2 + k`` (fed tokens up to ``t + 1 + k``)."""
        hidden = self.fc(hidden_states.float())
        logits = []
        for k in range(self.steps):
            fed = shifted(input_ids, 1 + k)
            hidden = self.layer(F.embedding(fed, self.embed), hidden, mask)
            logits.append(self.norm(hidden) @ self.lm_head.T)
        return logits


def shifted(x: torch.Tensor, by: int, fill: int | bool | float = 0) -> torch.Tensor:
    """``x`` moved ``by`` positions to the left along dim 1: ``out[:, t] = x[:, t + by]``,
    ``fill`` past the end."""
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


def step_masks(loss_mask: torch.Tensor, mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """For each draft step ``k``, the positions ``t`` it is trained and scored at: a real
    position on the trained part (``loss_mask``) whose label, position ``t + 1 + k``, is
    inside the sample."""
    real = loss_mask & mask
    return [real & shifted(mask, 1 + k, False) for k in range(steps)]


def ttt_loss(
    draft: Eagle3Draft, logits: list[torch.Tensor], features: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """The summed, step-weighted cross-entropy of the draft's step ``logits`` against the
    target's distributions, and the number of (position, step) terms in it."""
    target = draft.target_log_probs(features["last_hidden"])
    masks = step_masks(features["loss_mask"], features["attention_mask"], len(logits))
    total = torch.zeros(())
    terms = 0
    for k, (step_logits, where) in enumerate(zip(logits, masks, strict=True)):
        wanted = shifted(target, 1 + k)[where].exp()
        loss = -(wanted * F.log_softmax(step_logits[where], -1)).sum()
        total = total + DECAY**k * loss
        terms += int(where.sum())
    return total, terms


def draft_logits(model: nn.Module, features: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """``model`` (the draft, or its DDP wrapper) over a padded batch."""
    return model(features["hidden_states"], features["input_ids"], features["attention_mask"])


def acceptance_counts(
    logits: list[torch.Tensor], labels: torch.Tensor, where: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per draft step ``k``: how many positions accept steps ``0..k`` (``corrects``), out
    of those that accepted ``0..k-1`` (``denoms``), over the positions ``where`` (every
    step's label inside the sample). ``logits[k][:, t]`` proposes ``labels[:, t + 1 + k]``.

    Conditional counts: ``eval.simulated_acceptance_length`` multiplies the rates, so its
    sum is the expected number of draft tokens the target accepts in a row at a position,
    what a verification step of speculative decoding gains.
    """
    steps = len(logits)
    accepted = where.clone()
    corrects, denoms = torch.zeros(steps), torch.zeros(steps)
    for k, step_logits in enumerate(logits):
        denoms[k] = accepted.sum()
        accepted = accepted & (step_logits.argmax(-1) == shifted(labels, 1 + k))
        corrects[k] = accepted.sum()
    return corrects, denoms


def eval_outputs(draft: Eagle3Draft, features: dict[str, torch.Tensor]) -> dict:
    """One held-out batch's output dict, as ``eval.Evaluator`` takes it."""
    logits = draft_logits(draft, features)
    labels = draft.target_log_probs(features["last_hidden"]).argmax(-1)
    where = step_masks(features["loss_mask"], features["attention_mask"], draft.steps)[-1]
    corrects, denoms = acceptance_counts(logits, labels, where)
    loss, terms = ttt_loss(draft, logits, features)
    return {
        "loss": loss / max(terms, 1),
        "num_tokens": terms,
        "acc_corrects": corrects,
        "acc_denoms": denoms,
    }
