"""The model stands alone: it imports no layer above it, reads refs from any RefSource,
and its renamed names keep their deprecated aliases."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import dataflow.model
from dataflow import Kind, SampleRef
from dataflow.model._fold import RefSource, RunState
from dataflow.model._snapshot import decode, encode

MODEL = Path(dataflow.model.__file__).parent


def test_the_model_imports_nothing_above_it_not_even_for_type_checking() -> None:
    for path in MODEL.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                assert not name.startswith("dataflow.") or name.startswith("dataflow.model"), (
                    f"{path.name} imports {name}"
                )


class _Source:
    """A RefSource that is no ledger: refs by (id, revision)."""

    def __init__(self, refs: Mapping[str, str]) -> None:
        self.refs = refs
        self.asked: list[dict[str, int]] = []

    def commit_payloads(self, run_id: str, revisions: Mapping[str, int]) -> dict[str, str]:
        self.asked.append(dict(revisions))
        return {sid: self.refs[sid] for sid in revisions}

    def unseen_rows(self, run_id: str) -> Iterable[tuple[int, str, str | None]]:
        return [(-1, Kind.ACK, "a")]


def test_a_run_state_reads_forgotten_refs_from_any_ref_source() -> None:
    ref = SampleRef("a", "mem://s", 0).to_json()
    source = _Source({"a": ref})
    _typed: RefSource = source  # structural: no base class needed
    rows = [
        (1, Kind.COMMIT, "a", 0, 0, None, "p", ref, 0.0),
        (2, Kind.RESUME, None, None, 1, None, "c", '{"world_size":1}', 0.0),
        (3, Kind.LEASE, "a", None, 1, None, "c", None, 0.0),
        (4, Kind.ACK, "a", None, 1, 1, "c", None, 0.0),  # trained: its JSON is dropped
    ]
    state = RunState("r", ref_source=source).apply_rows(rows)
    assert state.ref("a") == SampleRef("a", "mem://s", 0) and source.asked == [{"a": 0}]
    assert any("seq -1: ack event of 'a' has a seq below 1" in p for p in state.verify())
    restored = decode("r", encode(state), ref_source=source)
    assert restored.ref("a") == SampleRef("a", "mem://s", 0)


def test_snapshot_is_a_deprecated_alias_of_observable() -> None:
    state = RunState("r")
    with pytest.warns(DeprecationWarning, match=r"use RunState\.observable\(\)"):
        assert state.snapshot() == state.observable()
