"""examples/eagle3: the quick job end to end (its report and `dataflow replay --verify`),
and the pieces of the draft that are logic of ours (the TTT unroll, its masks, the
acceptance counts)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests._cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "eagle3"
sys.path.insert(0, str(EXAMPLE))

import draft as eagle3  # noqa: E402  (examples/eagle3/draft.py)

from eval import simulated_acceptance_length  # noqa: E402
from training import PadCollate  # noqa: E402


@pytest.mark.slow
def test_quick_job_trains_every_sample_once_and_resumes_to_the_uninterrupted_weights(tmp_path):
    workdir = tmp_path / "eagle3"
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "run.py"), "--quick", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((workdir / "report.json").read_text())
    assert report["committed"] > 0
    assert report["lost"] == 0 and report["duplicated"] == 0
    # The ack rows read on their own name every trained sample once (duplicated counts them).
    assert report["acked"] == report["trained"]
    assert report["trained"] == report["committed"]
    assert report["resumes"] >= 1
    assert report["regenerated"] > 0  # the older checkpoint's released features came back
    assert report["acceptance_after"] > report["acceptance_before"]
    assert report["equal_to_uninterrupted"] is True
    for key in ("run_id", "ledger_url", "samples_per_s", "feature_bytes_per_sample", "wall_s"):
        assert key in report
    verify = run_cli(
        "replay", "--ledger", report["ledger_url"], "--run", report["run_id"], "--verify"
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.fixture
def target():
    return _target()


@functools.cache
def _example() -> ModuleType:
    """examples/eagle3/target.py, imported by the tests that use it: it imports
    transformers, a third of a second in each xdist worker's collection otherwise."""
    import target

    return target


def features(target: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    return _example().features(target, tokens)


@functools.cache
def _target() -> torch.nn.Module:
    return _example().build_target(_example().QUICK, 0)


@functools.cache
def _prompts() -> list[torch.Tensor]:
    return _example().make_prompts(_target(), _example().QUICK, 0, "eval")


def test_features_are_bf16_sequences_of_one_length_and_regenerate_bit_for_bit(target):
    assert len({len(p) for p in _prompts()}) > 1  # varied lengths
    for tokens in _prompts()[:3]:
        first, again = features(target, tokens), features(target, tokens)
        n, hidden = len(tokens), target.config.hidden_size
        assert first["hidden_states"].shape == (n, 3 * hidden)
        assert first["last_hidden"].shape == (n, hidden)
        assert first["input_ids"].shape == first["loss_mask"].shape == (n,)
        assert first["hidden_states"].dtype == target.dtype
        assert all(torch.equal(first[k], again[k]) for k in first)


def test_ttt_unroll_gives_one_logits_tensor_per_step_and_a_finite_loss(target):
    collate = PadCollate(pad=("input_ids", "hidden_states", "last_hidden", "loss_mask"))
    batch = collate([features(target, p) for p in _prompts()[:4]])
    draft = eagle3.Eagle3Draft(target, steps=3)
    logits = eagle3.draft_logits(draft, batch)
    b, n = batch["input_ids"].shape
    assert [t.shape for t in logits] == [(b, n, target.config.vocab_size)] * 3
    assert all(t.dtype == torch.float32 for t in logits)  # the draft trains in fp32
    loss, terms = eagle3.ttt_loss(draft, logits, batch)
    assert torch.isfinite(loss) and terms > 0
    loss.backward()
    assert draft.fc.weight.grad is not None
    assert not any(name in dict(draft.named_parameters()) for name in ("embed", "lm_head"))
    assert set(draft.state_dict()).isdisjoint({"embed", "lm_head"})  # frozen, not saved


def test_shifted_moves_left_and_fills_past_the_end():
    x = torch.tensor([[1, 2, 3, 4]])
    assert eagle3.shifted(x, 1).tolist() == [[2, 3, 4, 0]]
    assert eagle3.shifted(x, 3, 9).tolist() == [[4, 9, 9, 9]]
    assert eagle3.shifted(x, 5).tolist() == [[0, 0, 0, 0]]


def test_step_masks_need_every_label_inside_the_sample_and_on_the_trained_part():
    mask = torch.tensor([[True, True, True, True, False]])  # length 4, padded to 5
    loss_mask = torch.tensor([[False, True, True, True, False]])
    steps = eagle3.step_masks(loss_mask, mask, 3)
    # step k at t needs label t + 1 + k < 4
    assert steps[0].tolist() == [[False, True, True, False, False]]
    assert steps[1].tolist() == [[False, True, False, False, False]]
    assert steps[2].tolist() == [[False, False, False, False, False]]


def one_hot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor([tokens]), vocab).float()


def test_acceptance_counts_are_conditional_so_the_evaluator_gives_the_accepted_run_length():
    labels = torch.tensor([[0, 1, 2, 3, 4, 5]])
    where = torch.tensor([[True, True, True, False, False, False]])
    # position t proposes labels[t + 1 + k] at step k; 9 never matches (vocab 10).
    step0 = one_hot_logits([1, 2, 9, 0, 0, 0], 10)  # t=0,1 right; t=2 wrong
    step1 = one_hot_logits([2, 9, 4, 0, 0, 0], 10)  # t=0 right; t=1 wrong; t=2 right
    corrects, denoms = eagle3.acceptance_counts([step0, step1], labels, where)
    assert corrects.tolist() == [2, 1]  # t=2's right step 1 follows a rejected step 0
    assert denoms.tolist() == [3, 2]
    # accepted in a row at t=0, 1, 2: 2, 1, 0 -> mean 1
    assert simulated_acceptance_length(corrects, denoms) == pytest.approx(1.0)


def test_a_draft_that_copies_the_labels_accepts_every_step():
    labels = torch.randint(0, 8, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    steps = 3
    logits = [
        torch.nn.functional.one_hot(eagle3.shifted(labels, 1 + k), 8).float() for k in range(steps)
    ]
    where = eagle3.step_masks(mask, mask, steps)[-1]
    corrects, denoms = eagle3.acceptance_counts(logits, labels, where)
    assert torch.equal(corrects, denoms)
    assert simulated_acceptance_length(corrects, denoms) == pytest.approx(steps)
