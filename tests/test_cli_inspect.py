"""`dataflow replay` and friends: lineage, time travel, sample history, resume plans,
verify, plot, `status`, per-sample export, DATAFLOW_LEDGER and `python -m dataflow`.

Real SQLite ledgers written through Producer and Consumer; the commands run in-process
through `main` (and as real processes where the process is the point).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from _threads import errors_of_threads

from dataflow import Consumer, Ledger, Producer, replay
from dataflow.cli import main
from dataflow.tools._inspect import RunFold, status
from stores import LocalFeatureStore

ROOT = Path(__file__).resolve().parent.parent


def write_crashed_run(root: Path) -> str:
    """Run r1: two producers, a trainer that crashes after step 3, a resume from step 2.

    12 samples (s00..s05 by p0, s06..s11 by p1); epoch 1 acks two per step at steps 1-3
    with a checkpoint after each and dies holding two leases (s06, s07); epoch 2 resumes
    from step 2 and acks s06 at step 3. The files of checkpoint 1 are deleted afterwards.
    """
    url = f"sqlite:///{root}/ledger.db"
    with Ledger.open(url) as led:
        store = LocalFeatureStore()
        producers = [Producer(led, store, run_id="r1", producer_id=f"p{i}") for i in (0, 1)]
        for i in range(12):
            producers[i // 6].emit(f"s{i:02d}", {"x": torch.zeros(2)})
        first = Consumer(led, store, run_id="r1", consumer_id="rank0")
        first.resume()
        for step in (1, 2, 3):
            first.ack(first.lease(2), step=step)
            (root / f"ck{step}").mkdir()
            first.checkpoint(step=step, path=str(root / f"ck{step}"))
        first.lease(2)  # ... and the process dies with them
        second = Consumer(led, store, run_id="r1", consumer_id="rank0-restarted")
        second.resume(2)
        second.ack(second.lease(1), step=3)
        for producer in producers:
            producer.close()
    shutil.rmtree(root / "ck1")
    return url


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A read-only copy of the crashed run, shared by the tests that only read it."""
    return write_crashed_run(tmp_path_factory.mktemp("crashed"))


@pytest.fixture(autouse=True)
def _no_ledger_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATAFLOW_LEDGER", raising=False)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``dataflow ARGS`` in-process: (exit status, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def seqs_of(url: str, kind: str) -> list[int]:
    with Ledger.open(url, create=False) as led:
        return [e.seq for e in led.events("r1") if e.kind == kind]


# -- replay: the report ---------------------------------------------------------------


def test_replay_json_reports_lineage_checkpoints_counts_and_throughput(
    capsys: pytest.CaptureFixture[str], crashed: str
) -> None:
    report = cli_json(capsys, "replay", "--ledger", crashed, "--run", "r1")
    # The keys replay --json always had are still there.
    assert report["committed"] == 12 and report["trained"] == 5 and report["pending"] == 5
    assert report["regenerate"] == 2 and report["leased"] == 0 and report["violations"] == []
    assert report["released"] == 6 and report["producers_done"] is True
    assert [(c["step"], c["in_lineage"], c["on_disk"]) for c in report["checkpoints"]] == [
        (1, True, False),  # its files were deleted
        (2, True, True),
        (3, False, True),  # abandoned by the resume from step 2
    ]
    assert report["lineage"] == [1, 2]
    first, second = report["epochs"]
    assert (first["parent"], first["checkpoint_step"], first["by"]) == (None, None, "rank0")
    assert (second["parent"], second["checkpoint_step"], second["by"]) == (
        1,
        2,
        "rank0-restarted",
    )
    assert (second["requeued"], second["regenerate"]) == (6, 2)
    assert [m["kind"] for m in report["markers"]] == ["resume", "crash", "resume"]
    assert "2 samples leased" in report["markers"][1]["text"]
    spans = report["throughput"]
    assert sum(s["commits"] for s in spans) == 12 and sum(s["acks"] for s in spans) == 7
    assert spans[-1]["trained"] == 5 and spans[-1]["committed"] == 12


def test_replay_text_shows_lineage_markers_and_which_checkpoints_remain(
    capsys: pytest.CaptureFixture[str], crashed: str
) -> None:
    code, out, _ = cli(capsys, "replay", "--ledger", crashed, "--run", "r1")
    assert code == 0
    root = Path(crashed.removeprefix("sqlite:///")).parent
    assert f"checkpoint: step 1 (epoch 1) {root}/ck1 [not on disk]\n" in out
    assert f"checkpoint: step 3 (epoch 1) {root}/ck3 [off the lineage]\n" in out
    assert "lineage: epoch 1 -> epoch 2\n" in out
    assert "epoch 2: from step 2 (epoch 1), by rank0-restarted" in out
    assert "crash: " in out and "epoch 1 ended with 2 samples leased" in out
    assert "throughput: start" in out and out.endswith("verify: clean\n")


# -- time travel ----------------------------------------------------------------------


def test_at_step_goes_to_the_lineages_checkpoint_or_its_last_ack(
    capsys: pytest.CaptureFixture[str], crashed: str
) -> None:
    checkpoint_seqs, ack_seqs = seqs_of(crashed, "checkpoint"), seqs_of(crashed, "ack")
    at_1 = cli_json(capsys, "replay", "--ledger", crashed, "--run", "r1", "--at-step", "1")
    assert at_1["head_seq"] == checkpoint_seqs[0] and at_1["trained"] == 2
    # Step 3 of the current lineage is epoch 2's ack, not the abandoned checkpoint at 3.
    at_3 = cli_json(capsys, "replay", "--ledger", crashed, "--run", "r1", "--at-step", "3")
    assert at_3["head_seq"] == ack_seqs[-1] and at_3["epoch"] == 2 and at_3["trained"] == 5
    third = str(seqs_of(crashed, "commit")[2])
    upto = cli_json(capsys, "replay", "--ledger", crashed, "--run", "r1", "--upto", third)
    assert upto["head_seq"] == int(third) and upto["committed"] == 3 and upto["epoch"] == 0


def test_at_time_takes_iso_8601_or_unix_seconds(
    capsys: pytest.CaptureFixture[str], crashed: str
) -> None:
    with Ledger.open(crashed, create=False) as led:
        events = list(led.events("r1"))
    resume = next(e for e in events if e.kind == "resume")
    after = events[events.index(resume) + 1]
    # ISO 8601 keeps microseconds: a time between the resume and the next event.
    iso = datetime.fromtimestamp((resume.ts + after.ts) / 2, tz=UTC).isoformat()
    for when in (iso, repr(resume.ts)):
        report = cli_json(capsys, "replay", "--ledger", crashed, "--run", "r1", "--at", when)
        assert report["head_seq"] == resume.seq and report["epoch"] == 1


# -- one sample -----------------------------------------------------------------------


def test_sample_history_spans_producers_ranks_and_epochs(
    capsys: pytest.CaptureFixture[str], crashed: str
) -> None:
    history = cli_json(capsys, "replay", "--ledger", crashed, "--run", "r1", "--sample", "s06")
    steps = [(e["kind"], e["actor"]) for e in history["events"]]
    assert steps == [
        ("commit", "p1"),
        ("resume", "rank0"),
        ("lease", "rank0"),
        ("resume", "rank0-restarted"),
        ("lease", "rank0-restarted"),
        ("ack", "rank0-restarted"),
    ]
    assert history["events"][3]["detail"] == "resume from the checkpoint at step 2: requeued"
    assert history["current"]["state"] == "trained" and history["current"]["trained_step"] == 3
    code, out, _ = cli(capsys, "replay", "--ledger", crashed, "--run", "r1", "--sample", "s04")
    assert code == 0
    assert out.startswith("sample 's04' of run 'r1': regenerate (revision 0, 0 failed")
    assert "to regenerate (its features are gone)" in out


# -- a resume's plan, without writing -------------------------------------------------


@pytest.mark.parametrize("which", ["1", "latest", "none"])
def test_plan_resume_is_what_a_real_resume_then_does_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, which: str
) -> None:
    url = write_crashed_run(tmp_path)
    db = Path(url.removeprefix("sqlite:///"))
    with Ledger.open(url, create=False) as led:
        head = led.head_seq("r1")
    plan = cli_json(capsys, "replay", "--ledger", url, "--run", "r1", "--plan-resume", which)
    with Ledger.open(url, create=False) as led:
        assert led.head_seq("r1") == head  # nothing written
        real = Consumer(led, LocalFeatureStore(), run_id="r1", consumer_id="again").resume(
            {"1": 1, "latest": "latest", "none": None}[which]
        )
        after = replay(led, "r1")
    assert plan["epoch"] == real.epoch == 3
    assert plan["requeued"] == list(real.requeued)
    assert plan["regenerate"] == list(real.regenerate)
    assert plan["released"] == list(real.released)
    assert plan["trained"] == len(real.trained)
    assert plan["untrained"] == [
        s for s in ("s00", "s01", "s02", "s03", "s06") if s not in real.trained
    ]
    assert (plan["checkpoint"] or {}).get("step") == real.checkpoint_step
    assert after.verify() == [] and db.exists()


def test_plan_resume_text_names_the_checkpoint_and_the_ids(
    capsys: pytest.CaptureFixture[str], crashed: str
) -> None:
    code, out, _ = cli(capsys, "replay", "--ledger", crashed, "--run", "r1", "--plan-resume", "1")
    assert code == 0
    assert "from the checkpoint at step 1 (epoch 1" in out and "[NOT on disk]" in out
    assert "it would start epoch 3 with world size 1 and release policy on_checkpoint" in out
    assert "     regenerate: 4      s02, s03, s04, s05\n" in out
    assert "    train again: 3      s02, s03, s06\n" in out


# -- verify ---------------------------------------------------------------------------


def test_verify_lists_every_violation_and_exits_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = write_crashed_run(tmp_path)
    code, out, err = cli(capsys, "replay", "--ledger", url, "--run", "r1", "--verify")
    assert code == 0 and out.endswith("verify: clean\n") and err == ""
    assert "checked: nothing trained twice in the lineage" in out
    with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:  # forge two bad rows
        conn.executemany(
            "INSERT INTO dataflow_events (run_id, kind, sample_id, epoch, step, actor, ts)"
            " VALUES ('r1', ?, ?, 2, 9, 'zombie', 0)",
            [("ack", "s09"), ("release", "s10")],
        )
    code, out, err = cli(capsys, "replay", "--ledger", url, "--run", "r1", "--verify")
    assert code == 1
    assert "verify: 2 violations" in out
    assert "ack of 's09' by 'zombie', which did not lease it" in out
    assert "release of 's10' by 'zombie': the sample is not trained in this lineage" in out
    assert err.count("\n") == 1 and "fails verification: 2 violations" in err
    report = json.loads(
        cli(capsys, "replay", "--ledger", url, "--run", "r1", "--verify", "--json")[1]
    )
    assert len(report["violations"]) == 2 and report["events"] == report["head_seq"]


# -- plot -----------------------------------------------------------------------------


def test_plot_draws_a_png(capsys: pytest.CaptureFixture[str], crashed: str, tmp_path: Path) -> None:
    png = tmp_path / "run.png"
    code, out, _ = cli(capsys, "replay", "--ledger", crashed, "--run", "r1", "--plot", str(png))
    assert code == 0 and f"plot: {png}\n" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_matplotlib_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str],
    crashed: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    png = tmp_path / "run.png"
    code, _, err = cli(capsys, "replay", "--ledger", crashed, "--run", "r1", "--plot", str(png))
    assert code == 1 and not png.exists()
    assert err == (
        "dataflow: error: --plot needs matplotlib, which is not installed: "
        "pip install 'dataflow[plot]' (or pip install matplotlib)\n"
    )


# -- status ---------------------------------------------------------------------------


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[tuple[str, Ledger, Producer, Consumer]]:
    """A run in progress: p0 open with 6 commits, rank0 holding 2 leases after acking 1."""
    url = f"sqlite:///{tmp_path}/ledger.db"
    led = Ledger.open(url)
    store = LocalFeatureStore()
    prod = Producer(led, store, run_id="r1", producer_id="p0")
    for i in range(6):
        prod.emit(f"s{i}", {"x": torch.zeros(1)})
    Producer(led, store, run_id="r1", producer_id="p1").close()
    cons = Consumer(led, store, run_id="r1", consumer_id="rank0")
    cons.resume()
    cons.ack(cons.lease(1), step=1)
    cons.lease(2)
    yield url, led, prod, cons
    led.close()


def test_status_shows_in_flight_work_per_consumer_and_producer(
    capsys: pytest.CaptureFixture[str], live_run: tuple[str, Ledger, Producer, Consumer]
) -> None:
    url = live_run[0]
    report = cli_json(capsys, "status", "--ledger", url, "--run", "r1")
    assert (report["committed"], report["pending"], report["leased"], report["trained"]) == (
        6,
        3,
        2,
        1,
    )
    assert report["lag"] == 5 and report["producers_done"] is False
    assert report["producers"] == {
        "p0": {
            "committed": 6,
            "closed": False,
            "epoch": 1,  # its producer epoch: the first process to claim "p0"
            "commits_per_s": report["rates"]["commits_per_s"],
        },
        "p1": {"committed": 0, "closed": True, "epoch": 1, "commits_per_s": 0.0},
    }
    assert report["stores"] == [live_run[2].store.uri]
    assert report["consumers"]["rank0"] == {
        "leased": 2,
        "acked": 1,
        "last_step": 1,
        "acks_per_s": report["rates"]["acks_per_s"],
    }
    assert report["rates"]["commits_per_s"] == pytest.approx(6 / 60, abs=1e-3)
    assert report["pending_per_rank"] == [3]
    code, out, _ = cli(capsys, "status", "--ledger", url, "--run", "r1")
    assert code == 0
    assert "lag 5 (committed, not trained)" in out
    assert "  rank0                       2 leased         1 acked  step 1" in out
    assert "  p1                          0 committed  closed" in out


def test_status_follow_ends_on_ctrl_c_with_exit_0(
    capsys: pytest.CaptureFixture[str],
    live_run: tuple[str, Ledger, Producer, Consumer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("dataflow.cli.time.sleep", interrupted)
    code, out, err = cli(capsys, "status", "--ledger", live_run[0], "--run", "r1", "--follow")
    assert (code, err) == (0, "") and out.count("producers:") == 1


def test_status_follow_refreshes_count_times_and_sees_new_events(
    capsys: pytest.CaptureFixture[str], live_run: tuple[str, Ledger, Producer, Consumer]
) -> None:
    url, led, prod, cons = live_run
    args = ("status", "--ledger", url, "--run", "r1", "--follow", "--count", "3")
    code, out, _ = cli(capsys, *args, "--interval", "0.01", "--json")
    assert code == 0
    assert [json.loads(line)["head_seq"] for line in out.splitlines()] == [led.head_seq("r1")] * 3
    fold = RunFold(led, "r1", window=60.0)  # what each refresh does: fold only what is new
    assert fold.update() == led.head_seq("r1")
    cons.ack(cons.lease(8), step=2)
    prod.close()
    assert fold.update() == 3  # a lease and an ack of the 3 pending (a batch row each), the close
    now = status(fold, fold.last_ts or 0.0)
    assert (now["trained"], now["leased"], now["producers_done"]) == (4, 2, True)
    assert now["consumers"]["rank0"]["last_step"] == 2


# -- export ---------------------------------------------------------------------------


def test_export_writes_per_sample_state_for_pandas_and_duckdb(
    capsys: pytest.CaptureFixture[str], crashed: str, tmp_path: Path
) -> None:
    import duckdb  # both in the `test` extra
    import pandas

    out = tmp_path / "r1.parquet"
    code, stdout, _ = cli(capsys, "export", "--ledger", crashed, "--run", "r1", str(out))
    samples = tmp_path / "r1.samples.parquet"
    assert code == 0 and stdout.splitlines()[1] == f"wrote the state of its 12 samples to {samples}"
    with Ledger.open(crashed, create=False) as led:
        events = list(led.events("r1"))
        assert len(events) == led.head_seq("r1")
    # One row per event of one sample: a batch row as the rows of one sample it stands for.
    assert pq.read_table(out).num_rows == sum(len(e.sample_ids) or 1 for e in events)
    frame = pandas.read_parquet(samples)
    assert list(frame.columns) == [
        "sample_id", "state", "revision", "attempts", "trained_step", "leased_by",
        "released", "reason", "commit_seq", "producer", "excluded",
    ]  # fmt: skip
    assert frame.set_index("sample_id").loc[
        "s06", ["state", "trained_step", "producer"]
    ].tolist() == ["trained", 3, "p1"]
    db = duckdb.connect()
    counts = db.execute(
        f"SELECT state, count(*) FROM read_parquet('{samples}') GROUP BY state ORDER BY state"
    ).fetchall()
    assert counts == [("pending", 5), ("regenerate", 2), ("trained", 5)]
    released = db.execute(f"SELECT count(*) FROM '{samples}' WHERE released").fetchone()
    assert released == (6,)


def test_export_no_samples_and_the_out_option(
    capsys: pytest.CaptureFixture[str], crashed: str, tmp_path: Path
) -> None:
    out = tmp_path / "events.parquet"
    code, _, _ = cli(
        capsys, "export", "--ledger", crashed, "--run", "r1", "--out", str(out), "--no-samples"
    )
    assert code == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["events.parquet"]


def test_export_never_replaces_a_file_that_is_no_earlier_export(
    capsys: pytest.CaptureFixture[str], crashed: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.db"
    shutil.copy(crashed.removeprefix("sqlite:///"), ledger)
    url, before = f"sqlite:///{ledger}", ledger.read_bytes()
    (tmp_path / "notes.txt").write_text("mine\n")
    for target in (ledger, tmp_path / "notes.txt"):
        code, _, err = cli(capsys, "export", "--ledger", url, "--run", "r1", str(target))
        assert code == 1 and "exists and is not a Parquet file" in err, err
    assert ledger.read_bytes() == before and (tmp_path / "notes.txt").read_text() == "mine\n"
    assert cli(capsys, "runs", "--ledger", url) == (0, "r1\n", "")
    out = tmp_path / "r1.parquet"
    for _ in range(2):  # an earlier export is replaced
        assert cli(capsys, "export", "--ledger", url, "--run", "r1", str(out))[0] == 0
    events = list(Ledger.open(url, create=False).events("r1"))
    assert pq.read_table(out).num_rows == sum(len(e.sample_ids) or 1 for e in events)


def test_export_refuses_one_file_for_events_and_samples(crashed: str, tmp_path: Path) -> None:
    from dataflow.tools._export import export_parquet

    target = tmp_path / "r1.parquet"
    with Ledger.open(crashed, create=False) as led, pytest.raises(FileExistsError, match="same"):
        export_parquet(led, "r1", target, samples_path=tmp_path / "." / "r1.parquet")
    assert list(tmp_path.iterdir()) == []


def test_events_follow_stops_at_upto(capsys: pytest.CaptureFixture[str], crashed: str) -> None:
    args = ("events", "--ledger", crashed, "--run", "r1", "--upto", "2", "--follow")
    code, out, _ = cli(capsys, *args, "--timeout", "30")  # stops at seq 2, not after 30 s
    assert code == 0 and [json.loads(line)["seq"] for line in out.splitlines()] == [1, 2]


# -- DATAFLOW_LEDGER and python -m dataflow --------------------------------------------


def test_the_ledger_comes_from_dataflow_ledger_unless_ledger_is_given(
    capsys: pytest.CaptureFixture[str],
    crashed: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DATAFLOW_LEDGER", crashed)
    assert cli(capsys, "runs") == (0, "r1\n", "")
    assert cli_json(capsys, "status", "--run", "r1")["committed"] == 12
    other = f"sqlite:///{tmp_path}/other.db"
    Ledger.open(other).close()
    assert cli(capsys, "runs", "--ledger", other)[2].startswith("dataflow: no runs in")


@pytest.mark.parametrize(
    ("env", "code", "message"),
    [
        pytest.param(
            "mysql://x/y",
            2,
            "dataflow runs: error: DATAFLOW_LEDGER: unsupported ledger URL",
            id="bad-url",
        ),
        pytest.param(
            "sqlite:///{tmp}/gone.db",
            1,
            "dataflow: error: no ledger at {tmp}/gone.db: the file does not exist (nothing was "
            "created); check the path (the URL came from $DATAFLOW_LEDGER)",
            id="missing",
        ),
        pytest.param(
            None,
            2,
            "dataflow runs: error: no ledger at ./dataflow.db (the default, in {tmp}): pass "
            "--ledger URL or set DATAFLOW_LEDGER",
            id="neither",
        ),
    ],
)
def test_a_ledger_that_cannot_be_found_names_where_it_was_looked_for(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: str | None,
    code: int,
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    if env is not None:
        monkeypatch.setenv("DATAFLOW_LEDGER", env.format(tmp=tmp_path))
    got, out, err = cli(capsys, "runs")
    assert (got, out) == (code, "")
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_python_m_dataflow_is_the_dataflow_command(crashed: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATAFLOW_LEDGER"}
    result = subprocess.run(
        [sys.executable, "-m", "dataflow", "replay", "--run", "r1", "--at-step", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env | {"DATAFLOW_LEDGER": crashed},
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["trained"] == 4
    usage = subprocess.run(
        [sys.executable, "-m", "dataflow", "replay", "--run", "r1", "--at", "yesterday"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert usage.returncode == 2 and usage.stderr.startswith(
        "dataflow replay: error: argument --at"
    )


def test_the_reading_commands_leave_heavy_packages_unimported(crashed: str) -> None:
    code = (
        "import sys\n"
        "from dataflow.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"for args in (['runs'], ['replay', '--run', 'r1'], ['status', '--run', 'r1'],\n"
        "             ['replay', '--run', 'r1', '--sample', 's06'],\n"
        "             ['replay', '--run', 'r1', '--plan-resume', '2', '--at-step', '3']):\n"
        f"    main(args + ['--ledger', {crashed!r}])\n"
        "heavy = ('torch', 'numpy', 'matplotlib', 'pandas', 'pyarrow', 'tqdm', 'duckdb')\n"
        "print('imported:', ','.join(m for m in heavy if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "imported: "


def test_a_long_replay_shows_a_progress_bar_on_a_terminal(
    capsys: pytest.CaptureFixture[str], crashed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["replay", "--ledger", crashed, "--run", "r1", "--json"]) == 0
    json.loads(capsys.readouterr().out)  # the bar stays off stdout
    assert "replay:" in terminal.getvalue() and "seq" in terminal.getvalue()


# -- every bad input: one line, its exit status ------------------------------------------

BAD_INPUTS = [
    ("run-unknown", ["replay", "--run", "nosuch"], 1, r"known runs: 'r1' \(check --run\)"),
    ("status-run-unknown", ["status", "--run", "nosuch"], 1, "known runs: 'r1'"),
    (
        "plan-unknown-step",
        ["replay", "--run", "r1", "--plan-resume", "7"],
        1,
        r"no checkpoint at step 7 to resume from; recorded steps: \[1, 2, 3\]",
    ),
    ("plan-not-a-step", ["replay", "--run", "r1", "--plan-resume", "x"], 2, "`latest` or `none`"),
    (
        "sample-unknown",
        ["replay", "--run", "r1", "--sample", "nope"],
        1,
        r"no event of run 'r1' names sample 'nope'; 12 samples are committed, e.g. 's00'",
    ),
    ("sample-invalid", ["replay", "--run", "r1", "--sample", "../x"], 2, "--sample: "),
    (
        "at-step-beyond",
        ["replay", "--run", "r1", "--at-step", "9"],
        2,
        "--at-step: the current lineage of run 'r1' goes from step 1 to step 3",
    ),
    ("at-garbage", ["replay", "--run", "r1", "--at", "noon"], 2, "--at: expected an ISO 8601"),
    ("at-before", ["replay", "--run", "r1", "--at", "1999-01-01"], 2, "pass a later time"),
    ("at-and-upto", ["replay", "--run", "r1", "--at-step", "1", "--upto", "3"], 2, "not allowed"),
    ("plot-suffix", ["replay", "--run", "r1", "--plot", "{tmp}/run.txt"], 2, "must end with .png"),
    (
        "plot-sample",
        ["replay", "--run", "r1", "--sample", "s01", "--plot", "{tmp}/run.png"],
        2,
        "--plot draws the run's timeline",
    ),
    ("count-alone", ["status", "--run", "r1", "--count", "2"], 2, "add --follow"),
    ("interval-zero", ["status", "--run", "r1", "--follow", "--interval", "0"], 2, "> 0"),
    (
        "interval-huge",
        ["status", "--run", "r1", "--follow", "--interval", "1e10"],
        2,
        "--interval: expected at most",
    ),
    ("export-no-file", ["export", "--run", "r1"], 2, "name the file to write once"),
    (
        "export-two-files",
        ["export", "--run", "r1", "{tmp}/a.parquet", "--out", "{tmp}/b.parquet"],
        2,
        "name the file to write once",
    ),
]


@pytest.mark.parametrize(
    ("args", "code", "match"), [pytest.param(*row[1:], id=row[0]) for row in BAD_INPUTS]
)
def test_every_bad_input_is_one_line_with_its_exit_status(
    capsys: pytest.CaptureFixture[str],
    crashed: str,
    tmp_path: Path,
    args: list[str],
    code: int,
    match: str,
) -> None:
    import re

    args = [a.format(tmp=tmp_path) for a in args] + ["--ledger", crashed]
    got, out, err = cli(capsys, *args)
    assert got == code, err
    assert out == "" and err.count("\n") == 1 and err.startswith("dataflow"), err
    assert re.search(match, err), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("checkpoint", [True, 1.0, "1"], ids=["bool", "float", "str"])
def test_plan_resume_refuses_what_resume_refuses(tmp_path: Path, checkpoint: object) -> None:
    from dataflow import ArgumentTypeError
    from dataflow.tools._inspect import plan_resume

    url = write_crashed_run(tmp_path)
    with Ledger.open(url, create=False) as led:
        with pytest.raises(ArgumentTypeError, match=r"checkpoint must be a step \(an int\)"):
            plan_resume(led, "r1", checkpoint)
        with pytest.raises(ArgumentTypeError):
            Consumer(led, LocalFeatureStore(), run_id="r1", consumer_id="x").resume(checkpoint)
        assert plan_resume(led, "r1", 1)["epoch"] == 3


def test_a_sample_the_run_never_names_is_a_dataflow_error(tmp_path: Path) -> None:
    from dataflow import DataflowError
    from dataflow.tools._inspect import NotInRunError, sample_history

    url = write_crashed_run(tmp_path)
    with Ledger.open(url, create=False) as led, pytest.raises(NotInRunError) as got:
        sample_history(led, "r1", "nope")
    assert isinstance(got.value, DataflowError) and isinstance(got.value, LookupError)


def test_exports_to_one_target_from_threads_at_once_each_write_a_whole_file(
    crashed: str, tmp_path: Path
) -> None:
    from dataflow.tools._export import export_parquet

    out = tmp_path / "r1.parquet"

    def export() -> None:
        with Ledger.open(crashed, create=False) as led:
            for _ in range(3):
                export_parquet(led, "r1", out, samples_path=tmp_path / "r1.samples.parquet")

    assert errors_of_threads(export, 4) == []
    with Ledger.open(crashed, create=False) as led:
        rows = sum(len(e.sample_ids) or 1 for e in led.events("r1"))
        assert pq.read_table(out).num_rows == rows
    assert pq.read_table(tmp_path / "r1.samples.parquet").num_rows == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r1.parquet", "r1.samples.parquet"]
