"""The test zygote (tests/_zygote.py) runs a child as ``python -c``/``-m`` would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _zygote

ROOT = Path(__file__).resolve().parent.parent


def test_a_child_has_its_own_process_cwd_environment_and_arguments(tmp_path: Path) -> None:
    code = (
        "import os, sys, torch\n"
        "print(os.getpid(), os.getppid(), os.getcwd(), os.environ['ONLY_HERE'], sys.argv)\n"
        "print(__name__, repr(sys.path[0]), sorted(os.listdir('/proc/self/fd'))[:3])\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(7)"
    )
    env = dict(os.environ, ONLY_HERE="yes")
    result = _zygote.run(
        [sys.executable, "-c", code, "a", "b"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 7, result.stderr
    first, second = result.stdout.splitlines()
    pid, parent, cwd, only_here, argv = first.split(" ", 4)
    assert os.getpid() not in (int(pid), int(parent))  # the zygote's child, not ours
    assert (cwd, only_here, argv) == (str(tmp_path), "yes", "['-c', 'a', 'b']")
    assert second == "__main__ '' ['0', '1', '2']"  # no descriptor of the zygote's left
    assert result.stderr == "to stderr\n"


def test_an_uncaught_exception_exits_1_with_the_codes_traceback_only() -> None:
    code = "def fail():\n    raise ValueError('no such sample')\n\nfail()\n"
    result = _zygote.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "Traceback (most recent call last):",
        '  File "<string>", line 4, in <module>',
        '  File "<string>", line 2, in fail',
        "ValueError: no such sample",
    ]
    message = _zygote.run(
        [sys.executable, "-c", "raise SystemExit('bad input')"], capture_output=True, text=True
    )
    assert (message.returncode, message.stderr) == (1, "bad input\n")


def test_a_module_runs_as_with_dash_m() -> None:
    result = _zygote.run(
        [sys.executable, "-m", "dataflow.cli", "replay"], capture_output=True, text=True
    )
    expected = subprocess.run(
        [sys.executable, "-m", "dataflow.cli", "replay"], capture_output=True, text=True
    )
    assert (result.returncode, result.stdout, result.stderr) == (
        expected.returncode,
        expected.stdout,
        expected.stderr,
    )


def test_exit_joins_threads_runs_atexit_and_finalizes_the_main_modules_objects(
    tmp_path: Path,
) -> None:
    code = (
        "import atexit, threading, time\n"
        "class Closed:\n"
        "    def __del__(self):\n"
        "        print('finalized', flush=True)\n"
        "kept = Closed()\n"
        "atexit.register(lambda: print('atexit', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
        "handle = open('unflushed.txt', 'w')\n"
        "handle.write('written')\n"
        "print('main')\n"
    )
    result = _zygote.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, "main\nthread\natexit\nfinalized\n")
    assert (tmp_path / "unflushed.txt").read_text() == "written"


def test_a_child_talks_over_pipes_and_dies_of_sigkill() -> None:
    code = "import sys\nfor line in sys.stdin:\n    print(line.upper(), end='', flush=True)\n"
    process = _zygote.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    with process:
        process.stdin.write("ref\n")
        assert process.stdout.readline() == "REF\n"
        assert process.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(0.1)
        process.kill()
        assert process.wait(30) == -signal.SIGKILL


def test_a_child_in_a_session_of_its_own_leads_it_as_soon_as_its_pid_is_known() -> None:
    # A killpg of the pid right away must reach the child: it leads its session before
    # the zygote hands out its pid (before the fix, it did so only once it ran).
    for _ in range(20):
        child = _zygote.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
        )
        os.killpg(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL


def test_what_a_zygote_cannot_run_as_asked_is_refused() -> None:
    for args, kwargs in [
        (["python", "-c", "pass"], {}),
        ([sys.executable, "script.py"], {}),
        ([sys.executable, "-c", "pass"], {"shell": True}),
        ([sys.executable, "-c", "pass"], {"preexec_fn": os.getpid}),
        ([sys.executable, "-c", "pass"], {"env": {**os.environ, "PYTHONWARNINGS": "error"}}),
    ]:
        with pytest.raises(ValueError, match=r"subprocess|zygote"):
            _zygote.run(args, **kwargs)


def test_a_child_whose_zygote_died_says_so_and_the_next_child_gets_a_new_one() -> None:
    process = _zygote.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        server = _zygote.zygote().server
        server.kill()
        server.wait()
        with pytest.raises(RuntimeError, match="went away before child"):
            process.wait(30)
        with pytest.raises(RuntimeError, match="went away before child"):
            process.poll()  # not None for ever
    finally:
        os.kill(process.pid, signal.SIGKILL)  # an orphan now: nobody else would
    again = _zygote.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True)
    assert (again.returncode, again.stdout) == (0, "ok\n")
