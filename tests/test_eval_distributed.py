"""Evaluator across two real gloo ranks: uneven and empty shards, failures, no deadlock."""

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from _gloo import forkserver_context, free_port

from dataflow.live._collectives import join_loopback_gloo
from eval import EvalError, Evaluator

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT_S = 15
JOIN_TIMEOUT_S = 60


def batch(corrects, denoms, *, loss=1.0, num_tokens=1):
    return {
        "loss": torch.tensor(loss),
        "num_tokens": torch.tensor(num_tokens),
        "acc_corrects": torch.tensor(corrects),
        "acc_denoms": torch.tensor(denoms),
    }


def single(correct, denom, *, loss=1.0, num_tokens=1):
    return {
        "loss": loss,
        "num_tokens": num_tokens,
        "accuracy_correct": correct,
        "accuracy_denom": denom,
    }


def scenarios() -> dict[str, tuple[list, list]]:
    """Per scenario, the outputs of rank 0 and of rank 1 (every rank runs them all, in order)."""
    three = [batch([3, 2, 1], [4, 4, 2], loss=2.0, num_tokens=6), batch([1, 1, 0], [2, 1, 1])]
    two = [batch([5, 1], [5, 4], loss=0.5, num_tokens=9), batch([0, 0], [1, 0], num_tokens=2)]
    return {
        "empty_shard": (three, []),
        "shorter_positions": (three, two),
        "shorter_positions_reversed": (two, three),
        "all_empty": ([], []),
        "single_accuracy": ([single(3, 4), single(1, 6, num_tokens=5)], []),
        "mixed_kinds_across_ranks": (three, [single(1, 2)]),
        "malformed_on_one_rank": (three, [{"loss": 1.0, "num_tokens": 1}]),
        "bad_counts_on_one_rank": ([batch([3], [2])], two),
        "after_the_failures": (two, three),
    }


def run_scenarios(rank: int, port: int, out_dir: str) -> None:
    """One rank: run every scenario over the default group, then one over an explicit group."""
    join_loopback_gloo(rank, WORLD_SIZE, port, timeout_s=COLLECTIVE_TIMEOUT_S)
    results = {}
    try:
        cases = scenarios()
        for name, shards in cases.items():
            results[name] = outcome(Evaluator(), shards[rank])
        group = dist.new_group(list(range(WORLD_SIZE)))
        results["explicit_group"] = outcome(Evaluator(group=group), cases["empty_shard"][rank])
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def outcome(evaluator: Evaluator, outputs: list) -> dict:
    try:
        return {"metrics": evaluator.run(outputs)}
    except EvalError as exc:
        return {"error": str(exc)}


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    return run_ranks(run_scenarios, tmp_path_factory.mktemp("ranks"))


def run_ranks(target, out_dir) -> list[dict]:
    """Run ``target(rank, port, out_dir)`` on every rank, each in its own process; what
    each wrote to ``out_dir/rank<N>.json``."""
    context = forkserver_context(__name__)
    port = free_port()
    processes = [
        context.Process(target=target, args=(rank, port, str(out_dir)))
        for rank in range(WORLD_SIZE)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    assert not hung, "a rank hung: the ranks issued different collectives"
    assert [p.exitcode for p in processes] == [0] * WORLD_SIZE
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize(
    "name",
    [
        "empty_shard",
        "shorter_positions",
        "shorter_positions_reversed",
        "single_accuracy",
        "after_the_failures",
    ],
)
def test_every_rank_gets_the_metrics_of_the_union(rank_results, name):
    shards = scenarios()[name]
    union = Evaluator().run([*shards[0], *shards[1]])
    assert union
    for results in rank_results:
        assert results[name]["metrics"] == pytest.approx(union, rel=1e-12)


def test_an_explicit_group_is_used(rank_results):
    shards = scenarios()["empty_shard"]
    union = Evaluator().run([*shards[0], *shards[1]])
    for results in rank_results:
        assert results["explicit_group"]["metrics"] == pytest.approx(union, rel=1e-12)


def test_an_eval_without_batches_anywhere_is_empty_on_every_rank(rank_results):
    assert [results["all_empty"] for results in rank_results] == [{"metrics": {}}] * WORLD_SIZE


@pytest.mark.parametrize(
    ("name", "rank0_error", "rank1_error"),
    [
        ("mixed_kinds_across_ranks", "some ranks returned acc_corrects", "some ranks returned"),
        ("malformed_on_one_rank", "another rank found a malformed", "batch 0 output lacks acc"),
        ("bad_counts_on_one_rank", "greater than.*batch 0 of this rank", "on another rank"),
    ],
)
def test_an_error_on_one_rank_raises_on_every_rank(rank_results, name, rank0_error, rank1_error):
    errors = [results[name].get("error", "") for results in rank_results]
    assert re.search(rank0_error, errors[0]), errors[0]
    assert re.search(rank1_error, errors[1]), errors[1]


# -- evaluate() with models that run collectives of their own ---------------------------


def local_model(calls: list[int]):
    """A model each rank runs on its own: no collectives."""

    def model_fn(index: int) -> dict:
        calls.append(index)
        return batch([1], [2])

    return model_fn


def sharded_model(rank: int, calls: list[int], *, malformed: int | None = None):
    """A model split across the ranks (as tensor parallelism or FSDP split one): every
    forward runs an all_reduce, so every rank must run as many forwards as its peers.
    Its loss is the number of ranks that joined that all_reduce; batch ``malformed``
    lacks the counts on rank 1."""

    def model_fn(index: int) -> dict:
        calls.append(index)
        joined = torch.ones(1)
        dist.all_reduce(joined)
        if rank == 1 and index == malformed:
            return {"loss": 1.0, "num_tokens": 1}
        return batch([1], [2], loss=joined.item())

    return model_fn


def run_model_scenarios(rank: int, port: int, out_dir: str) -> None:
    """One rank: evaluate() calls that fail on rank 1 only, then a healthy one."""
    join_loopback_gloo(rank, WORLD_SIZE, port, timeout_s=COLLECTIVE_TIMEOUT_S)
    results = {}
    try:
        calls: list[int] = []
        batches = [0, 1] if rank == 0 else None
        results["batches_not_iterable"] = evaluated(local_model(calls), batches, calls)
        for name, malformed in (("sharded_model_malformed", 0), ("sharded_model_after", None)):
            calls = []
            model_fn = sharded_model(rank, calls, malformed=malformed)
            results[name] = evaluated(model_fn, range(3), calls)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def evaluated(model_fn, batches, calls: list[int]) -> dict:
    # Any exception, not only EvalError: a regression shows up as what it raised.
    try:
        return {"metrics": Evaluator().evaluate(model_fn, batches), "calls": calls}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "calls": calls}


@pytest.fixture(scope="module")
def model_results(tmp_path_factory) -> list[dict]:
    return run_ranks(run_model_scenarios, tmp_path_factory.mktemp("model_ranks"))


def test_batches_that_are_not_iterable_raise_on_every_rank(model_results):
    errors = [results["batches_not_iterable"].get("error", "") for results in model_results]
    assert errors[0].startswith("EvalError: another rank found a malformed"), errors[0]
    assert errors[1].startswith("EvalError: batches is a NoneType, not iterable"), errors[1]
    assert [results["batches_not_iterable"]["calls"] for results in model_results] == [[0, 1], []]


def test_a_rank_with_a_malformed_output_keeps_running_the_model_then_every_rank_raises(
    model_results,
):
    rank0, rank1 = (results["sharded_model_malformed"] for results in model_results)
    assert rank0["error"].startswith("EvalError: another rank found a malformed"), rank0
    assert rank1["error"].startswith("EvalError: batch 0 output lacks acc_corrects"), rank1
    # Rank 1 ran the forwards (and their all_reduces) of the batches after the bad one.
    assert rank0["calls"] == rank1["calls"] == [0, 1, 2]


def test_the_model_collectives_are_still_in_step_after_a_failure(model_results):
    rank0, rank1 = (results["sharded_model_after"] for results in model_results)
    assert rank0["metrics"] == rank1["metrics"]
    # Each forward's all_reduce was joined by both ranks: its loss is 2 on every batch.
    assert rank0["metrics"]["eval/avg_loss"] == WORLD_SIZE
    assert rank0["metrics"]["eval/avg_acc"] == 0.5
