"""Metrics of eval: simulated_acceptance_length and the single-process Evaluator."""

import itertools
import math
import subprocess
import sys
import warnings
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import eval
from eval import EvalError, Evaluator, simulated_acceptance_length
from eval._evaluator import _accumulate, communication_device


def batch(corrects, denoms, *, loss=1.0, num_tokens=1):
    return {"loss": loss, "num_tokens": num_tokens, "acc_corrects": corrects, "acc_denoms": denoms}


def test_public_names():
    assert eval.__all__ == sorted(eval.__all__)
    assert set(eval.__all__) == {
        "EvalCache",
        "EvalConfig",
        "EvalError",
        "Evaluator",
        "simulated_acceptance_length",
    }
    assert issubclass(EvalError, ValueError)


def test_eval_imports_only_torch_and_the_standard_library():
    code = (
        "import sys, eval; "
        "print(sorted(m for m in ('dataflow', 'stores', 'training') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


# -- the worked example -------------------------------------------------------------


WORKED_EXAMPLE = [
    batch(torch.tensor([3, 2]), torch.tensor([4, 4]), loss=2.0, num_tokens=4),
    batch(torch.tensor([1, 0]), torch.tensor([1, 1]), loss=1.0, num_tokens=1),
]


def test_worked_example_sums_counts_before_dividing():
    # a = (4/5, 2/5): 0.8 + 0.8 * 0.4 = 1.12
    assert simulated_acceptance_length([4, 2], [5, 5]) == pytest.approx(1.12)
    metrics = Evaluator().run(WORKED_EXAMPLE)
    assert metrics == pytest.approx(
        {
            "eval/avg_loss": (2.0 * 4 + 1.0 * 1) / 5,
            "eval/avg_acc": 0.8,
            "eval/simulated_acc_len": 1.12,
            "eval/tokens_per_step": 2.12,
            "eval/acceptance_rate_0": 0.8,
            "eval/acceptance_rate_1": 0.4,
        }
    )
    per_batch = [
        simulated_acceptance_length(b["acc_corrects"], b["acc_denoms"]) for b in WORKED_EXAMPLE
    ]
    naive = sum(per_batch) / len(per_batch)
    assert naive == pytest.approx(1.0625)
    assert metrics["eval/simulated_acc_len"] != pytest.approx(naive)


def test_single_accuracy_is_weighted_by_its_denominator():
    outputs = [
        {"loss": 1.0, "num_tokens": 10, "accuracy_correct": 9, "accuracy_denom": 10},
        {"loss": 3.0, "num_tokens": 30, "accuracy_correct": torch.tensor(3), "accuracy_denom": 30},
    ]
    metrics = Evaluator().run(outputs)
    assert metrics == pytest.approx(
        {
            "eval/avg_loss": 2.5,
            "eval/avg_acc": 0.3,
            "eval/simulated_acc_len": 0.3,
            "eval/tokens_per_step": 1.3,
            "eval/acceptance_rate_0": 0.3,
        }
    )


def test_batches_with_fewer_positions_count_as_zero_denominators_there():
    short = batch([2], [4])
    long = batch([1, 1, 1], [2, 2, 1])
    padded = batch([2, 0, 0], [4, 0, 0])
    assert Evaluator().run([short, long]) == Evaluator().run([padded, long])
    assert Evaluator().run([short, long])["eval/acceptance_rate_2"] == 1.0


def test_a_position_nobody_tried_has_rate_zero():
    assert simulated_acceptance_length([2, 0, 0], [2, 0, 5]) == 1.0
    assert simulated_acceptance_length([], []) == 0.0


def test_no_batches_gives_no_metrics():
    assert Evaluator().run([]) == {}
    assert Evaluator().run(iter(())) == {}
    assert Evaluator().evaluate(lambda b: b, []) == {}


def test_loss_is_token_weighted_and_ignores_empty_batches():
    outputs = [
        batch([1], [2], loss=torch.tensor(4.0), num_tokens=torch.tensor(3)),
        batch([0], [0], loss=torch.tensor(float("nan")), num_tokens=0),
        batch([1], [2], loss=torch.tensor(1.0), num_tokens=1),
    ]
    assert Evaluator().run(outputs)["eval/avg_loss"] == pytest.approx(13 / 4)


def test_no_tokens_means_no_loss_metric():
    metrics = Evaluator().run([batch([1], [2], loss=float("nan"), num_tokens=0)])
    assert "eval/avg_loss" not in metrics
    assert metrics["eval/avg_acc"] == 0.5


def test_evaluate_calls_the_model_without_grad():
    weight = torch.ones((), requires_grad=True)
    seen = []

    def model_fn(item):
        seen.append(torch.is_grad_enabled())
        return batch(item, [4, 4], loss=weight * 2, num_tokens=2)

    metrics = Evaluator().evaluate(model_fn, [[3, 2], [1, 1]])
    assert seen == [False, False]
    assert metrics["eval/acceptance_rate_0"] == 0.5
    assert metrics["eval/avg_loss"] == 2.0


@pytest.mark.parametrize("num_batches", [1, 40])
def test_one_host_sync_per_pass(monkeypatch, num_batches):
    syncs = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name):
            syncs.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    outputs = [
        batch(torch.tensor([3, 1]), torch.tensor([4, 4]), loss=torch.tensor(0.5), num_tokens=8)
        for _ in range(num_batches)
    ]
    metrics = Evaluator().run(outputs)
    assert syncs == ["tolist"]
    assert metrics["eval/simulated_acc_len"] == pytest.approx(0.75 + 0.75 * 0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CI machines have no GPU)")
def test_counts_stay_on_the_outputs_device_without_syncing():
    first = {key: torch.as_tensor(value).cuda() for key, value in WORKED_EXAMPLE[0].items()}
    outputs = [first, WORKED_EXAMPLE[1]]  # Python numbers and CPU tensors join the GPU
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        totals = _accumulate(outputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert totals.corrects is not None and totals.corrects.is_cuda
    assert totals.corrects.dtype == torch.float64
    assert Evaluator().run(outputs) == pytest.approx(Evaluator().run(WORKED_EXAMPLE))


@pytest.mark.parametrize(
    ("backend", "device"),
    [("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda"), ("mpi", "cpu")],
)
def test_communication_device_follows_the_backend(backend, device):
    assert communication_device(backend) == torch.device(device)


# -- batch-size invariance with a real draft model ------------------------------------

VOCAB, DIM, DRAFT_POSITIONS, SEQ_LEN, NUM_SAMPLES = 16, 24, 3, 14, 37


def successor(tokens: torch.Tensor) -> torch.Tensor:
    return (3 * tokens + 1) % VOCAB


class TinyDraft(nn.Module):
    """Embedding plus one linear head per draft position: head k predicts token t+1+k."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.heads = nn.ModuleList(nn.Linear(DIM, VOCAB) for _ in range(DRAFT_POSITIONS))
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            # Plant a noisy version of the data's rule so acceptance is far from zero.
            self.embed.weight[:, :VOCAB] += 3 * torch.eye(VOCAB)
            tokens = torch.arange(VOCAB)
            for head in self.heads:
                tokens = successor(tokens)
                head.weight[tokens, torch.arange(VOCAB)] += 4.0

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.embed(tokens))
        corrects, denoms = [], []
        for k, head in enumerate(self.heads):
            width = tokens.shape[1] - 1 - k
            logits = head(hidden[:, :width])
            targets = tokens[:, 1 + k :]
            valid = torch.arange(width)[None, :] + 1 + k < lengths[:, None]
            corrects.append(((logits.argmax(-1) == targets) & valid).sum())
            denoms.append(valid.sum())
            if k == 0:
                loss = nn.functional.cross_entropy(logits[valid], targets[valid])
                num_tokens = valid.sum()
        return {
            "loss": loss,
            "num_tokens": num_tokens,
            "acc_corrects": torch.stack(corrects),
            "acc_denoms": torch.stack(denoms),
        }


def synthetic_eval_set(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(NUM_SAMPLES, SEQ_LEN, dtype=torch.int64)
    tokens[:, 0] = torch.randint(VOCAB, (NUM_SAMPLES,), generator=generator)
    for t in range(1, SEQ_LEN):
        noise = torch.randint(VOCAB, (NUM_SAMPLES,), generator=generator)
        follow = torch.rand(NUM_SAMPLES, generator=generator) < 0.75
        tokens[:, t] = torch.where(follow, successor(tokens[:, t - 1]), noise)
    lengths = torch.randint(2, SEQ_LEN + 1, (NUM_SAMPLES,), generator=generator)
    return tokens, lengths


def micro_batches(data, size):
    tokens, lengths = data
    return [(tokens[i : i + size], lengths[i : i + size]) for i in range(0, len(tokens), size)]


def test_metrics_do_not_depend_on_the_micro_batch_size():
    model = TinyDraft(seed=0).eval()
    data = synthetic_eval_set(seed=1)
    results = {
        size: Evaluator().evaluate(lambda b: model(*b), micro_batches(data, size))
        for size in (1, 4, 16, NUM_SAMPLES)
    }
    reference = results[NUM_SAMPLES]
    assert set(reference) == {
        "eval/avg_loss",
        "eval/avg_acc",
        "eval/simulated_acc_len",
        "eval/tokens_per_step",
        *(f"eval/acceptance_rate_{i}" for i in range(DRAFT_POSITIONS)),
    }
    assert 0.4 < reference["eval/avg_acc"] < 1.0
    for size in (1, 4, 16):
        torch.testing.assert_close(results[size], reference, rtol=1e-5, atol=1e-9)

    with torch.no_grad():
        singles = [model(*b) for b in micro_batches(data, 1)]
    per_sample = [simulated_acceptance_length(o["acc_corrects"], o["acc_denoms"]) for o in singles]
    naive = sum(per_sample) / len(per_sample)
    assert abs(naive - reference["eval/simulated_acc_len"]) > 1e-3


# -- properties -----------------------------------------------------------------------


@st.composite
def per_sample_counts(draw):
    """(positions, samples): each sample has corrects, denoms, num_tokens and a mean loss."""
    positions = draw(st.integers(1, 4))
    samples = []
    for _ in range(draw(st.integers(1, 12))):
        denoms = draw(st.lists(st.integers(0, 6), min_size=positions, max_size=positions))
        corrects = [draw(st.integers(0, d)) for d in denoms]
        num_tokens = draw(st.integers(1, 5))
        loss = draw(st.floats(0, 10, allow_nan=False))
        samples.append((corrects, denoms, num_tokens, loss))
    return positions, samples


def as_batches(samples, cuts):
    """Merge consecutive samples between ``cuts`` into one output dict each."""
    bounds = [0, *sorted(cuts), len(samples)]
    outputs = []
    for start, stop in itertools.pairwise(bounds):
        chunk = samples[start:stop]
        tokens = sum(s[2] for s in chunk)
        outputs.append(
            batch(
                [sum(col) for col in zip(*(s[0] for s in chunk), strict=True)],
                [sum(col) for col in zip(*(s[1] for s in chunk), strict=True)],
                loss=sum(s[3] * s[2] for s in chunk) / tokens,
                num_tokens=tokens,
            )
        )
    return outputs


def closed_form(samples) -> Fraction:
    corrects = [sum(col) for col in zip(*(s[0] for s in samples), strict=True)]
    denoms = [sum(col) for col in zip(*(s[1] for s in samples), strict=True)]
    total, prefix = Fraction(0), Fraction(1)
    for correct, denom in zip(corrects, denoms, strict=True):
        prefix *= Fraction(correct, denom) if denom else 0
        total += prefix
    return total


@settings(max_examples=150, deadline=None)
@given(data=per_sample_counts(), draw=st.data())
def test_any_partition_into_batches_gives_the_same_metrics(data, draw):
    _, samples = data
    cuts = draw.draw(st.sets(st.integers(1, len(samples) - 1)) if len(samples) > 1 else st.just(()))
    metrics = Evaluator().run(as_batches(samples, cuts))
    one_batch = Evaluator().run(as_batches(samples, ()))
    assert metrics == pytest.approx(one_batch, rel=1e-12, abs=1e-12)
    exact = float(closed_form(samples))
    assert metrics["eval/simulated_acc_len"] == pytest.approx(exact, rel=1e-12)
    tokens = sum(s[2] for s in samples)
    loss = sum(s[3] * s[2] for s in samples) / tokens
    assert metrics["eval/avg_loss"] == pytest.approx(loss, rel=1e-9, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(data=per_sample_counts(), draw=st.data())
def test_order_of_batches_does_not_matter(data, draw):
    _, samples = data
    shuffled = draw.draw(st.permutations(samples))
    every_sample = range(1, len(samples))
    assert Evaluator().run(as_batches(shuffled, every_sample)) == pytest.approx(
        Evaluator().run(as_batches(samples, every_sample)), rel=1e-12, abs=1e-12
    )


@settings(max_examples=100, deadline=None)
@given(data=per_sample_counts())
def test_acceptance_length_is_bounded_by_the_number_of_positions(data):
    positions, samples = data
    metrics = Evaluator().run(as_batches(samples, ()))
    assert 0.0 <= metrics["eval/simulated_acc_len"] <= positions
    assert metrics["eval/tokens_per_step"] == 1.0 + metrics["eval/simulated_acc_len"]
    rates = [metrics[f"eval/acceptance_rate_{i}"] for i in range(positions)]
    assert all(0.0 <= rate <= 1.0 for rate in rates)
    assert metrics["eval/avg_acc"] == rates[0]


@settings(max_examples=100, deadline=None)
@given(
    positions=st.integers(1, 8),
    denom=st.integers(1, 1000),
    fraction=st.floats(0, 1),
    as_tensor=st.booleans(),
)
def test_constant_rate_matches_the_geometric_closed_form(positions, denom, fraction, as_tensor):
    correct = round(fraction * denom)
    rate = correct / denom
    corrects, denoms = [correct] * positions, [denom] * positions
    if as_tensor:
        corrects, denoms = torch.tensor(corrects), torch.tensor(denoms, dtype=torch.float32)
    expected = positions if rate == 1 else rate * (1 - rate**positions) / (1 - rate)
    assert simulated_acceptance_length(corrects, denoms) == pytest.approx(expected, rel=1e-12)


# -- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("corrects", "denoms", "match"),
    [
        ([1, 2], [3], "corrects has 2 positions but denoms has 1"),
        (torch.tensor([1, 2]), torch.tensor([3, 3, 3]), "2 positions but denoms has 3"),
        ([-1, 0], [2, 2], r"corrects\[0\] = -1.0"),
        ([1, 0], [2, -2], r"denoms\[1\] = -2.0"),
        ([3, 1], [2, 2], r"corrects\[0\] = 3.0 exceeds denoms\[0\] = 2.0"),
        ([float("nan")], [1], "finite"),
        ([1], [math.inf], "finite"),
        (torch.ones(2, 2), torch.ones(2, 2), r"shape \(2, 2\).*1-D"),
        (torch.tensor(1.0), torch.tensor(2.0), r"shape \(\).*1-D"),
        ([[1], [2]], [[2], [2]], r"corrects\[0\] is \[1\] \(list\)"),
        ("12", "34", "corrects is a str"),
        (None, [1], "corrects is a NoneType"),
        ([1], {"a": 1}, "denoms is a dict"),
        ([True], [1], r"corrects\[0\] is True \(bool\)"),
        ([1], ["2"], r"denoms\[0\] is '2' \(str\)"),
        (torch.tensor([True]), torch.tensor([1]), "dtype torch.bool"),
        (torch.tensor([1 + 1j]), torch.tensor([1]), "dtype torch.complex"),
    ],
)
def test_simulated_acceptance_length_rejects_bad_input(corrects, denoms, match):
    with pytest.raises(EvalError, match=match):
        simulated_acceptance_length(corrects, denoms)


GOOD = batch([1, 1], [2, 2])
SINGLE = {"loss": 1.0, "num_tokens": 1, "accuracy_correct": 1, "accuracy_denom": 2}


def without(output, key):
    return {k: v for k, v in output.items() if k != key}


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        ([GOOD, 7], "batch 1 output is a int"),
        ([without(GOOD, "loss")], "batch 0 output lacks loss"),
        ([without(GOOD, "num_tokens")], "lacks num_tokens"),
        ([without(GOOD, "acc_denoms")], "lacks acc_denoms"),
        ([without(SINGLE, "accuracy_denom")], "lacks accuracy_denom"),
        ([{"loss": 1.0, "num_tokens": 1}], "lacks acc_corrects, acc_denoms"),
        ([{**GOOD, "accuracy_correct": 1}], "batch 0 has both"),
        ([GOOD, SINGLE], "batch 1 has accuracy_correct/accuracy_denom but earlier"),
        ([SINGLE, GOOD], "batch 1 has acc_corrects/acc_denoms but earlier"),
        ([batch([1, 1], [2, 2, 2])], "batch 0 has 2 acc_corrects and 3 acc_denoms"),
        ([batch([], [])], "at least one"),
        ([batch(torch.ones(2, 1), torch.ones(2, 1))], r"batch 0 acc_corrects has shape \(2, 1\)"),
        ([batch([1], [2], loss=torch.ones(3))], r"batch 0 loss has shape \(3,\)"),
        ([batch([1], [2], loss="0.5")], "batch 0 loss is a str"),
        ([batch([1], [2], num_tokens=None)], "batch 0 num_tokens is a NoneType"),
        ([{**SINGLE, "accuracy_correct": [1, 2]}], "accuracy_correct is a list"),
        ([GOOD, batch([1, 1], [2, 2], num_tokens=-3)], "negative counts or num_tokens.*batch 1"),
        ([GOOD, GOOD, batch([1, -1], [2, 2])], "1 batch.*negative counts.*batch 2 of this rank"),
        ([batch([3, 1], [2, 2]), batch([3], [2])], "2 batch.*greater than acc_denoms.*batch 0"),
        ([batch([float("nan")], [2])], "non-finite counts"),
        ([batch([1], [2], loss=10**400)], "batch 0 loss is 1000.*beyond a float64"),
        ([batch([10**400], [2])], r"batch 0 acc_corrects\[0\] is 1000.*beyond a float64"),
        ([batch([1], [2], loss=torch.ones((), device="meta"))], "batch 0 loss is a meta tensor"),
        ([batch(torch.ones(1, device="meta"), [2])], "acc_corrects is a meta tensor"),
        ([{**SINGLE, "accuracy_correct": 3}], "greater than"),
        (GOOD, "outputs is a dict"),
        (3, "outputs is a int"),
    ],
)
def test_evaluator_rejects_malformed_outputs(outputs, match):
    with pytest.raises(EvalError, match=match):
        Evaluator().run(outputs)


def test_evaluate_rejects_a_model_that_is_not_callable():
    with pytest.raises(EvalError, match="model_fn is a str, not callable"):
        Evaluator().evaluate("model", [1])


def test_counts_given_as_python_numbers_keep_float64_precision():
    # 2**40 + 1 is exact in float64 and not in float32: a list must not pass through float32.
    out = Evaluator().run([{"loss": 1.0, "num_tokens": 1, "acc_corrects": [2**40 + 1],
                            "acc_denoms": [2**41]}])  # fmt: skip
    assert out["eval/avg_acc"] == (2**40 + 1) / 2**41


# Factories: building these warns (prototype, beta or deprecated APIs that still work),
# so they are built in the test, quietly, not at collection.
NOT_DENSE = {
    "sparse_coo": (lambda: torch.tensor([1.0, 0.0]).to_sparse(), r"torch.sparse_coo.*to_dense"),
    "sparse_csr": (
        lambda: torch.tensor([[1.0, 0.0]]).to_sparse_csr(),
        r"torch.sparse_csr.*to_dense",
    ),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.tensor([1.0, 0.0]), 1.0, 0, torch.qint8),
        r"quantized tensor \(torch.qint8\).*dequantize",
    ),
    "nested": (
        lambda: torch.nested.nested_tensor([torch.tensor([1.0, 0.0])]),
        "nested tensor; pass a dense one",
    ),
    "nested_jagged": (
        lambda: torch.nested.nested_tensor([torch.tensor([1.0, 0.0])], layout=torch.jagged),
        "nested tensor; pass a dense one",
    ),
}


def not_dense(kind: str) -> tuple[torch.Tensor, str]:
    make, match = NOT_DENSE[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make(), match


@pytest.mark.parametrize("kind", NOT_DENSE)
@pytest.mark.parametrize("key", ["acc_corrects", "acc_denoms", "loss", "num_tokens"])
def test_evaluator_refuses_tensors_that_are_not_dense(kind, key):
    tensor, match = not_dense(kind)
    output = {**batch([1, 0], [2, 2]), key: tensor}
    with pytest.raises(EvalError, match=f"batch 0 {key} is a {match}"):
        Evaluator().run([output])


@pytest.mark.parametrize("kind", NOT_DENSE)
def test_simulated_acceptance_length_refuses_tensors_that_are_not_dense(kind):
    tensor, match = not_dense(kind)
    with pytest.raises(EvalError, match=f"corrects is a {match}"):
        simulated_acceptance_length(tensor, [2, 2])
    with pytest.raises(EvalError, match=f"denoms is a {match}"):
        simulated_acceptance_length([1, 0], tensor)


@pytest.mark.parametrize(("batches", "kind"), [(None, "NoneType"), (3, "int")])
def test_evaluate_refuses_batches_that_are_not_iterable(batches, kind):
    calls = []
    with pytest.raises(EvalError, match=f"batches is a {kind}, not iterable"):
        Evaluator().evaluate(calls.append, batches)
    assert calls == []


@pytest.mark.parametrize(
    ("group", "match"),
    [("gloo", "group is 'gloo' \\(str\\)"), (0, "group is 0 \\(int\\)"), (object(), "object")],
)
def test_evaluator_refuses_a_group_that_is_not_a_process_group(group, match):
    with pytest.raises(EvalError, match=f"{match}.*pass a process group"):
        Evaluator(group=group)


def test_a_loss_too_long_to_print_is_described_by_its_size():
    with pytest.raises(EvalError, match="batch 0 loss is an int of 16610 bits, beyond a float64"):
        Evaluator().run([batch([1], [2], loss=10**5000)])
