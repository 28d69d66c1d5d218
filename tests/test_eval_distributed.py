"""Evaluator across two real gloo ranks: uneven and empty shards, no deadlock."""

import json
import multiprocessing
import os
import re
import socket

import pytest
import torch
import torch.distributed as dist

from dataflow._dist import join_loopback_gloo
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ranks")
    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=run_scenarios, args=(rank, port, str(out_dir)))
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
