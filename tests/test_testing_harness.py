"""The property harness itself (dataflow.testing): it fails stores that return wrong
features, passes a correct one, and refuses bad arguments with dataflow's errors."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import Phase

from dataflow import ArgumentTypeError, DataflowError, InvalidArgumentError, Ledger
from dataflow.testing import LedgerMachine, PostgresServer, machine_settings, run_ledger_machine
from dataflow.testing._postgres import create_database, drop_database
from stores import LocalFeatureStore

# A failing store fails on its first lease; no shrinking, no example database.
FAST: dict[str, Any] = {
    "max_examples": 10,
    "check_snapshots": False,
    "database": None,
    "phases": (Phase.explicit, Phase.generate),
}


@pytest.fixture
def ledger(sqlite_url: str) -> Iterator[Ledger]:
    led = Ledger.open(sqlite_url, durability="normal")
    try:
        yield led
    finally:
        led.close()


class WrongDtypeAndShapeStore(LocalFeatureStore):
    """Returns int8 zeros of shape (7,) for every feature, whatever was put."""

    def get(self, ref: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        real = super().get(ref, *args, **kwargs)
        return {name: torch.zeros(7, dtype=torch.int8) for name in real}


class WrongValuesStore(LocalFeatureStore):
    """Returns tensors of the right dtype and shape, but every element off by one."""

    def get(self, ref: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        real = super().get(ref, *args, **kwargs)
        return {name: tensor + 1 for name, tensor in real.items()}


class FirstPutStore(LocalFeatureStore):
    """Returns the features of a sample's first put forever: stale after a regeneration."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first: dict[str, dict[str, torch.Tensor]] = {}

    def put(self, sample_id: str, features: Any, *args: Any, **kwargs: Any) -> Any:
        ref = super().put(sample_id, features, *args, **kwargs)
        self.first.setdefault(sample_id, {k: v.clone() for k, v in features.items()})
        return ref

    def put_many(self, samples: Any) -> Any:  # what Producer.emit_many puts through
        samples = list(samples)
        refs = super().put_many(samples)
        for sample_id, features, *_ in samples:
            self.first.setdefault(sample_id, {k: v.clone() for k, v in features.items()})
        return refs

    def get(self, ref: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        super().get(ref, *args, **kwargs)  # the ref must still be readable
        return {k: v.clone() for k, v in self.first[ref.sample_id].items()}


# -- the value check ------------------------------------------------------------------


def test_a_correct_local_store_passes(ledger: Ledger) -> None:
    run_ledger_machine(ledger, LocalFeatureStore, **FAST)


# A lease is what reads features back: these drive the machine to one, not hypothesis
# (ten random examples may hold none).
def test_a_store_returning_wrong_dtype_and_shape_fails(ledger: Ledger) -> None:
    machine = _machine(ledger, WrongDtypeAndShapeStore)
    try:
        machine.emit([0, 1], seed=3)
        with pytest.raises(
            AssertionError, match=r"as torch\.int8 \(7,\), but torch\.\w+ .* emitted"
        ):
            machine.lease(0, 2)
    finally:
        machine.teardown()


def test_a_store_returning_wrong_values_fails(ledger: Ledger) -> None:
    machine = _machine(ledger, WrongValuesStore)
    try:
        machine.emit([0], seed=3)
        with pytest.raises(AssertionError, match=r"with values .* but .* was emitted"):
            machine.lease(0, 1)
    finally:
        machine.teardown()


def _machine(ledger: Ledger, make_store: Any) -> LedgerMachine:
    machine_class = type(
        "Machine",
        (LedgerMachine,),
        {"ledger": ledger, "make_store": staticmethod(make_store), "check_snapshots": False},
    )
    machine = machine_class()
    machine.configure(policy="on_ack", world_size=1, max_attempts=3)
    return machine


def _lose_and_regenerate(machine: LedgerMachine) -> None:
    machine.emit([0], seed=1)
    machine.lease(0, 1)  # the first generation reads back as emitted
    machine.lose_features(0)
    machine.regenerate(seed=2)


def test_a_regenerated_sample_is_checked_against_its_new_features(ledger: Ledger) -> None:
    machine = _machine(ledger, LocalFeatureStore)
    try:
        _lose_and_regenerate(machine)
        machine.lease(0, 1)
        (ref,) = machine.leased[0]
        assert ref.sample_id == "s00/x"
        assert machine.payload_seeds[(ref.sample_id, ref.generation)] == 2
        machine.ledger_agrees_with_the_model()
    finally:
        machine.teardown()


def test_a_store_returning_the_features_from_before_a_regeneration_fails(
    ledger: Ledger,
) -> None:
    machine = _machine(ledger, FirstPutStore)
    try:
        _lose_and_regenerate(machine)
        with pytest.raises(AssertionError, match=r"'s00/x'.*was emitted"):
            machine.lease(0, 1)
    finally:
        machine.teardown()


# -- bad arguments ----------------------------------------------------------------------


def test_machine_settings_refuses_an_unknown_profile() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'fast'.*pass one of them"):
        machine_settings("fast")


def test_machine_settings_refuses_a_profile_that_is_not_a_str() -> None:
    with pytest.raises(ArgumentTypeError, match=r"profile must be a str.*\['normal'\]"):
        machine_settings(["normal"])  # type: ignore[arg-type]


def test_run_ledger_machine_refuses_an_unknown_profile(ledger: Ledger) -> None:
    with pytest.raises(InvalidArgumentError, match=r"'Normal'"):
        run_ledger_machine(ledger, LocalFeatureStore, profile="Normal")


def test_run_ledger_machine_refuses_a_store_instead_of_a_factory(ledger: Ledger) -> None:
    store = LocalFeatureStore()
    try:
        with pytest.raises(
            ArgumentTypeError,
            match=r"make_store .*\(LocalFeatureStore, not LocalFeatureStore\(\)\)",
        ):
            run_ledger_machine(ledger, store, max_examples=1)  # type: ignore[arg-type]
    finally:
        store.close()


def test_run_ledger_machine_refuses_a_factory_that_returns_no_store(ledger: Ledger) -> None:
    with pytest.raises(ArgumentTypeError, match=r"make_store\(\) returned 'oops' \(str\)"):
        run_ledger_machine(ledger, lambda: "oops", **FAST)  # type: ignore[arg-type,return-value]


def test_run_ledger_machine_refuses_a_url_instead_of_a_ledger(sqlite_url: str) -> None:
    with pytest.raises(ArgumentTypeError, match=r"ledger must be a dataflow\.Ledger.*Ledger\.open"):
        run_ledger_machine(sqlite_url, LocalFeatureStore, max_examples=1)  # type: ignore[arg-type]


def test_run_ledger_machine_refuses_a_non_bool_check_snapshots(ledger: Ledger) -> None:
    with pytest.raises(ArgumentTypeError, match=r"check_snapshots .*'no'"):
        run_ledger_machine(ledger, LocalFeatureStore, check_snapshots="no")  # type: ignore[arg-type]


def test_run_ledger_machine_refuses_bad_hypothesis_overrides(ledger: Ledger) -> None:
    with pytest.raises(ArgumentTypeError, match=r"\{'max_examples': -1\}"):
        run_ledger_machine(ledger, LocalFeatureStore, max_examples=-1)


@pytest.mark.parametrize("timeout", [-1, 0, -0.5, math.nan, math.inf])
def test_postgres_server_refuses_a_timeout_that_is_not_finite_and_positive(
    timeout: float,
) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"finite .* > 0, got {timeout!r}"):
        PostgresServer(startup_timeout=timeout)


@pytest.mark.parametrize("timeout", [True, "60", None])
def test_postgres_server_refuses_a_timeout_that_is_not_a_number(timeout: object) -> None:
    with pytest.raises(ArgumentTypeError, match=rf"startup_timeout .*got {timeout!r}"):
        PostgresServer(startup_timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["has-dash", "1digit", "x" * 64, None])
def test_database_names_are_refused_with_dataflow_errors(name: object) -> None:
    unreachable = "postgresql+psycopg://nobody@127.0.0.1:1/postgres"
    for call in (create_database, drop_database):
        refused = pytest.raises(InvalidArgumentError, match=r"database name .*choose such a name")
        with refused as info:
            call(unreachable, name)  # type: ignore[arg-type]
        assert isinstance(info.value, DataflowError)
        assert repr(name) in str(info.value)
