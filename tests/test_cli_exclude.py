"""``dataflow exclude`` / ``dataflow include`` and ``replay --plan-resume``'s list, run as an
operator runs them: a real process on a real SQLite ledger."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dataflow import Consumer, Ledger, Producer, replay
from dataflow.cli import main
from stores import LocalFeatureStore
from tests._zygote import run_cli  # forked warm: the imports cost more than a command


@pytest.fixture
def recorded(tmp_path: Path) -> str:
    """A run of 8 samples trained two a step for 3 steps, checkpointed at step 1; its URL."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with LocalFeatureStore() as store:
        ledger = Ledger.open(url)
        producer = Producer(ledger, store, run_id="r")
        producer.emit_many((f"s{i}", {"x": torch.zeros(1)}) for i in range(8))
        producer.close()
        consumer = Consumer(ledger, store, run_id="r", consumer_id="t", release_policy="never")
        consumer.resume(None)
        for step in (1, 2, 3):
            consumer.ack([r.sample_id for r in consumer.lease(2)], step=step)
            if step == 1:
                consumer.record_checkpoint(1, "s3://bucket/step-1")
        ledger.close()
    return url


def test_exclude_and_include_by_id_with_json(recorded: str) -> None:
    done = run_cli("exclude", "--ledger", recorded, "--run", "r", "--sample", "s6", "s7",
                   "--reason", "bad labels", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["changed"] == ["s6", "s7"] and report["action"] == "exclude"
    assert report["epoch"] == 1  # the run's current epoch: the live ranks are not fenced
    done = run_cli("include", "--ledger", recorded, "--run", "r", "--sample", "s7",
                   "--reason", "checked")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "included 1 samples" in done.stdout
    ledger = Ledger.open(recorded)
    assert replay(ledger, "r").excluded == {"s6": "bad labels"}
    ledger.close()
    shown = run_cli("replay", "--ledger", recorded, "--run", "r", "--json")
    assert json.loads(shown.stdout)["excluded"] == 1


def test_exclude_from_a_file(recorded: str, tmp_path: Path) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_text("# found by the data team\ns6\n\ns7  # also\n")
    done = run_cli("exclude", "--ledger", recorded, "--run", "r", "--from-file", str(ids),
                   "--reason", "dupes")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "excluded 2 samples" in done.stdout


def test_the_rewind_and_skip_line_excludes_what_the_abandoned_steps_trained(
    recorded: str,
) -> None:
    plan = run_cli("replay", "--ledger", recorded, "--run", "r", "--plan-resume", "1", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["trained_after"] == ["s2", "s3", "s4", "s5"]
    text = run_cli("replay", "--ledger", recorded, "--run", "r", "--plan-resume", "1")
    assert "trained after: 4" in text.stdout and "--trained-after 1" in text.stdout
    done = run_cli("exclude", "--ledger", recorded, "--run", "r", "--trained-after", "1",
                   "--through", "2", "--reason", "loss spike", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["changed"] == ["s2", "s3"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["exclude", "--sample", "nope", "--reason", "x"], 1, "'nope'.*never committed"),
        (["include", "--sample", "s1", "--reason", "x"], 1, "'s1'.*not excluded"),
        (["exclude", "--sample", "s1", "--reason", ""], 2, "must say why"),
        (["exclude", "--sample", "a/../b", "--reason", "x"], 2, "must not contain"),
        (["exclude", "--sample", "s1"], 2, "--reason"),
        (["exclude", "--reason", "x"], 2, "one of the arguments"),
        (["exclude", "--sample", "s1", "--through", "3", "--reason", "x"], 2, "--through goes"),
        (["exclude", "--trained-after", "3", "--reason", "x"], 1, "trained nothing after"),
        (["include", "--trained-after", "1", "--reason", "x"], 2, "--sample --from-file is"),
        (["exclude", "--from-file", "/nonexistent/ids", "--reason", "x"], 1, "No such file"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    recorded: str, args: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process (``dataflow.cli.main``): the same parser and handlers, without a process
    start per case."""
    ledger = Ledger.open(recorded)
    head = ledger.head_seq("r")
    command, *rest = args
    try:
        done = main([command, "--ledger", recorded, "--run", "r", *rest])
    except SystemExit as exc:  # a usage error, from the parser
        done = exc.code
    stderr = capsys.readouterr().err
    assert done == code, stderr
    assert re.search(message, stderr), stderr
    assert len(stderr.strip().splitlines()) == 1
    assert ledger.head_seq("r") == head
    ledger.close()


def test_an_unknown_run_or_a_missing_ledger_is_refused(recorded: str, tmp_path: Path) -> None:
    done = run_cli("exclude", "--ledger", recorded, "--run", "other", "--sample", "s1",
                   "--reason", "x")  # fmt: skip
    assert done.returncode == 1 and "no events" in done.stderr
    missing = f"sqlite:///{tmp_path / 'none.db'}"
    done = run_cli("exclude", "--ledger", missing, "--run", "r", "--sample", "s1", "--reason", "x")
    assert done.returncode == 1 and not (tmp_path / "none.db").exists()
