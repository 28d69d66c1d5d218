"""The target model and its data: what the producers run, and what a rank regenerates with.

The target is a ``transformers`` causal LM: a Llama built from a small config with random
weights (nothing is downloaded), or a local checkpoint (``--model PATH``). The prompt set
is the target's own greedy continuations of short random prefixes, of varied lengths, as
EAGLE-3 trains on responses the target generated: then the tokens a draft is fed during
training are the tokens the target would emit, and a teacher-forced unroll measures what
speculative decoding would accept. The features of a sample are a pure function of its
prompt and the target's weights, so rank 0 regenerates released features with
:func:`features`, the producers' own code path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers  # the `examples` extra

PREFIX = 4  # random tokens the target continues; not trained on (loss_mask 0)


@dataclass(frozen=True)
class Sizes:
    """The sizes of one job: the target's config and the prompt set."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    samples: int  # training prompts
    eval_samples: int  # held-out prompts
    min_len: int
    max_len: int


QUICK = Sizes(
    vocab=1024, hidden=64, layers=4, heads=4, samples=192, eval_samples=32, min_len=32, max_len=96
)
FULL = Sizes(  # a sample of 512 tokens is 2 MiB of features
    vocab=4096,
    hidden=512,
    layers=4,
    heads=8,
    samples=512,
    eval_samples=64,
    min_len=32,
    max_len=512,
)


def build_target(sizes: Sizes, seed: int, model_path: str | None = None) -> torch.nn.Module:
    """The frozen target: a local checkpoint, or a Llama of ``sizes`` with random weights
    (seeded: every process builds the same one). bfloat16 where the CPU computes in it."""
    torch.manual_seed(seed)
    if model_path is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path)
    else:
        config = transformers.LlamaConfig(
            vocab_size=sizes.vocab,
            hidden_size=sizes.hidden,
            intermediate_size=2 * sizes.hidden,
            num_hidden_layers=sizes.layers,
            num_attention_heads=sizes.heads,
            num_key_value_heads=max(1, sizes.heads // 2),
            max_position_embeddings=max(1024, sizes.max_len),
            # A wider init than the default 0.02: the greedy continuations of a random
            # model with the default fall into one- or two-token loops at once.
            initializer_range=0.1,
        )
        model = transformers.LlamaForCausalLM(config)
    model = model.to(compute_dtype()).eval()
    model.requires_grad_(False)
    return model


def compute_dtype() -> torch.dtype:
    """bfloat16 where this CPU multiplies in it, else float32."""
    try:
        torch.ones(2, 2, dtype=torch.bfloat16) @ torch.ones(2, 2, dtype=torch.bfloat16)
    except RuntimeError:
        return torch.float32
    return torch.bfloat16


def feature_layers(model: torch.nn.Module) -> tuple[int, int, int]:
    """The indices into ``hidden_states`` (0 is the embeddings) of the low, middle and high
    layer EAGLE-3 reads."""
    n = model.config.num_hidden_layers
    return 2, max(2, n // 2), max(2, n - 1)


def make_prompts(model: torch.nn.Module, sizes: Sizes, seed: int, split: str) -> list[torch.Tensor]:
    """The prompt set of ``split`` ("train" or "eval"): greedy continuations of random
    prefixes, cut to lengths drawn in ``[min_len, max_len]``. Generated in batches."""
    count = sizes.samples if split == "train" else sizes.eval_samples
    generator = torch.Generator().manual_seed(seed * 1_000_003 + (0 if split == "train" else 7))
    vocab = model.config.vocab_size
    prefixes = torch.randint(0, vocab, (count, PREFIX), generator=generator)
    lengths = torch.randint(sizes.min_len, sizes.max_len + 1, (count,), generator=generator)
    prompts: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, count, 64):
            chunk = prefixes[start : start + 64]
            new = sizes.max_len - PREFIX
            out = model.generate(
                chunk,
                attention_mask=torch.ones_like(chunk),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            prompts += [row[: int(n)].clone() for row, n in zip(out, lengths[start:], strict=False)]
    return prompts


def save_prompts(path: Path, prompts: list[torch.Tensor]) -> None:
    """The prompt set as one .npz (tokens and offsets; no pickle)."""
    tokens = torch.cat(prompts).to(torch.int32).numpy()
    offsets = np.cumsum([0] + [len(p) for p in prompts])
    np.savez(path, tokens=tokens, offsets=offsets)


def load_prompts(path: Path) -> list[torch.Tensor]:
    data = np.load(path, allow_pickle=False)
    tokens, offsets = torch.from_numpy(data["tokens"]).long(), data["offsets"]
    return [tokens[a:b] for a, b in itertools.pairwise(offsets)]


def sample_id(index: int) -> str:
    return f"prompt-{index:06d}"


def sample_index(sample_id: str) -> int:
    return int(sample_id.rsplit("-", 1)[1])


@torch.no_grad()
def features(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """One sample's features, from one forward of the target over its ``L`` tokens:

    - ``input_ids`` ``[L]`` int64;
    - ``hidden_states`` ``[L, 3 * H]``: the low, middle and high layers, concatenated;
    - ``last_hidden`` ``[L, H]``: the final (normed) hidden state, whose LM head gives the
      target's next-token distribution at every position (the training labels: smaller
      than logits, ``H`` against ``vocab`` values a position);
    - ``loss_mask`` ``[L]`` bool: the positions a draft trains on (not the random prefix).

    In the target's dtype (bfloat16 where the CPU computes in it). One sample a forward,
    so a regenerated sample is bit for bit the one the producer made.
    """
    out = model(tokens[None], output_hidden_states=True)
    hidden = out.hidden_states
    low, middle, high = feature_layers(model)
    loss_mask = torch.arange(len(tokens)) >= PREFIX - 1
    return {
        "input_ids": tokens.clone(),
        "hidden_states": torch.cat([hidden[low], hidden[middle], hidden[high]], -1)[0],
        "last_hidden": hidden[-1][0].clone(),
        "loss_mask": loss_mask,
    }
