"""Python children forked from a warm server instead of started afresh.

A test that runs ``python -c CODE`` or ``python -m MODULE`` as a child pays for the
child's imports every time: torch alone is 1.1-1.4 s of CPU, and the suite starts a few
hundred such children. :func:`Popen` and :func:`run` take the same arguments as
:mod:`subprocess`'s and return the same objects, but the child is forked from a *zygote*:
one server per test process (per xdist worker) that imported torch, dataflow, stores,
training and eval once. The child is still a process of its own, with its own pid, cwd,
environment and standard streams (the caller's pipes, passed over a Unix socket), so it
can be SIGKILLed, crash, or hang like any other; it then runs the code as the interpreter
would: ``__name__ == "__main__"``, ``sys.argv`` and ``sys.path[0]`` as for ``-c`` or
``-m``, and a normal interpreter exit (threads joined, atexit handlers run, exit status as
``python`` gives it: 1 and the traceback on stderr for an uncaught exception; only the
teardown of the preloaded modules is left out, see :func:`_exit`).

What differs from a fresh interpreter, and so stays on :mod:`subprocess`:

* the preloaded modules are imported already, with the import-time environment of the
  zygote (the test process's): a test about what a fresh process imports, how long it
  takes to start, or an import-time setting from the environment needs a fresh one;
* the child is the zygote's child, not the test's (``os.waitpid`` and
  ``multiprocessing.active_children`` do not see it; :class:`ForkedPopen` does), and its
  ``/proc/PID/cmdline`` is the zygote's: find it by its pid, not by its command line;
* only ``[sys.executable, "-c", CODE, *ARGS]`` and ``[sys.executable, "-m", MODULE,
  *ARGS]`` (each optionally with ``-u``) are served, and only with the zygote's
  interpreter settings (``PYTHON*`` variables but PYTHONPATH and PYTHONUNBUFFERED);
  anything else is refused with ``ValueError`` rather than run differently.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: What the zygote imports before it serves: what the suite's python children import.
PRELOAD = (
    "torch",
    "dataflow",
    "dataflow.cli",
    "stores",
    "stores._local",
    "stores._shared_dir",
    "training",
    "eval",
)

_HEADER = struct.Struct("!I")  # the length of the request that follows
# The zygote's environment: the suite's, as it was when the tests were collected, not that
# of whichever test first asks for a child (a monkeypatched variable would otherwise stay
# in what the preloaded modules read at import for the rest of the session). Each child
# gets its own environment from the request.
_ENVIRON = dict(os.environ)
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); from tests import _zygote; "
    "del sys.path[0]; _zygote._child_main(_zygote._serve())"
)


# ---------------------------------------------------------------- the test's side


class Zygote:
    """One warm server and the connection to it; :func:`zygote` keeps one per process."""

    def __init__(self, preload: Sequence[str] = PRELOAD, *, prefix: Sequence[str] = ()) -> None:
        """``prefix``: what the server's command line starts with, e.g. ``ip netns exec NS``
        (it must exec the interpreter in place, keeping the listener's fd open)."""
        self.owner = os.getpid()
        self.address = f"\0dataflow-tests-zygote-{os.getpid()}-{id(self)}"  # abstract
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.address)
        listener.listen(64)
        env = dict(_ENVIRON, DATAFLOW_TESTS_ZYGOTE_PRELOAD=",".join(preload))
        try:
            # The listener is bound before the server starts, so a request made while it
            # still imports waits in the backlog. Its stdin is a pipe whose end (EOF) is
            # the server's signal to go, also when this process dies without a word.
            self.server = subprocess.Popen(
                [*prefix, sys.executable, "-c", _BOOT, str(ROOT), str(listener.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                env=env,
                pass_fds=[listener.fileno()],
            )
        finally:
            listener.close()

    def request(
        self, payload: dict[str, Any], fds: Sequence[int]
    ) -> tuple[socket.socket, int, bytes]:
        """Ask for a child with standard streams ``fds``: the connection that will report
        its end, its pid, and what came on the connection after the pid."""
        if os.getpid() != self.owner:
            raise RuntimeError("a forked copy of a test process cannot use its zygote")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.address)
            data = json.dumps(payload).encode()
            socket.send_fds(conn, [_HEADER.pack(len(data))], list(fds))
            conn.sendall(data)
            line, rest = _read_line(conn)
        except BaseException:
            conn.close()
            raise
        if line is None:
            conn.close()
            raise RuntimeError(
                f"the test zygote (pid {self.server.pid}) went away; its stderr says why"
            )
        reply = json.loads(line)
        if "error" in reply:
            conn.close()
            raise RuntimeError(f"the test zygote could not fork: {reply['error']}")
        return conn, reply["pid"], rest

    def close(self) -> None:
        """Stop the server (its children, if any, live on as orphans would)."""
        if self.server.poll() is None:
            self.server.stdin.close()
            try:
                self.server.wait(30)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started on first use, stopped when the process exits."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.owner != os.getpid() or _zygote.server.poll() is not None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote


def _read_line(conn: socket.socket) -> tuple[bytes | None, bytes]:
    """The first line from ``conn`` (blocking; None at EOF), and what came after it."""
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return None, b""
        data += chunk
    line, rest = data.split(b"\n", 1)
    return line, rest


def _parse(args: Sequence[str]) -> dict[str, Any]:
    """The request for ``args``: ``[sys.executable, [-u], -c|-m, CODE|MODULE, *ARGS]``."""
    if isinstance(args, (str, bytes)) or not args:
        raise ValueError(f"a zygote runs an argument list, not {args!r}")
    args = [os.fspath(a) for a in args]
    if args[0] != sys.executable:
        raise ValueError(f"a zygote runs {sys.executable}, not {args[0]!r}: use subprocess")
    unbuffered = args[1:2] == ["-u"]
    rest = args[2:] if unbuffered else args[1:]
    if len(rest) < 2 or rest[0] not in ("-c", "-m"):
        raise ValueError(f"a zygote runs `python -c CODE` or `python -m MODULE`, not {args!r}")
    return {"mode": rest[0], "target": rest[1], "argv": rest[2:], "unbuffered": unbuffered}


def _check_startup_settings(environ: dict[str, str]) -> None:
    """Refuse an interpreter setting that only a fresh start reads (PYTHONWARNINGS,
    PYTHONHASHSEED, PYTHONDEVMODE ...) when the child's differs from the zygote's: the
    child would run with the zygote's. PYTHONPATH and PYTHONUNBUFFERED are applied."""
    names = {n for n in (*environ, *_ENVIRON) if n.startswith("PYTHON")}
    differ = sorted(
        n for n in names - {"PYTHONPATH", "PYTHONUNBUFFERED"} if environ.get(n) != _ENVIRON.get(n)
    )
    if differ:
        raise ValueError(
            f"a zygote child cannot take its own {', '.join(differ)} (read when an "
            "interpreter starts): use subprocess"
        )


class ForkedPopen(subprocess.Popen):
    """:class:`subprocess.Popen` whose child is forked from the zygote (see the module's
    docstring for what it runs and what it refuses). Pipes, ``communicate``, ``wait``
    with a timeout, ``kill`` and ``send_signal`` work as in :mod:`subprocess`.
    ``zygote``: the server to fork from (default: this process's, :func:`zygote`)."""

    def __init__(self, args: Any, *, zygote: Zygote | None = None, **kwargs: Any) -> None:
        self._server = zygote
        super().__init__(args, **kwargs)

    def _execute_child(
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: bool,
        pass_fds: Sequence[int],
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: int,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        restore_signals: bool,
        gid: Any,
        gids: Any,
        uid: Any,
        umask: int,
        start_new_session: bool,
        process_group: Any = None,
    ) -> None:
        try:
            unsupported = {
                "shell": shell,
                "executable": executable,
                "preexec_fn": preexec_fn,
                "pass_fds": pass_fds,
                "user": uid,
                "group": gid,
                "extra_groups": gids,
                "process_group": process_group not in (None, -1),
                "umask": umask != -1,
            }
            refused = [name for name, value in unsupported.items() if value]
            if refused:
                raise ValueError(f"a zygote child takes no {', '.join(refused)}: use subprocess")
            payload = _parse(args)
            environ = {
                os.fsdecode(k): os.fsdecode(v)
                for k, v in (os.environ if env is None else env).items()
            }
            _check_startup_settings(environ)
            payload.update(
                cwd=os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
                env=environ,
                new_session=bool(start_new_session),
            )
            fds = [
                p2cread if p2cread != -1 else 0,
                c2pwrite if c2pwrite != -1 else 1,
                errwrite if errwrite != -1 else 2,
            ]
            server = self._server or zygote()
            self._zygote_conn, pid, self._zygote_buffer = server.request(payload, fds)
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._child_created = True
        self.pid = pid

    def _zygote_status(self, timeout: float | None) -> bool:
        """Read the child's end from the zygote within ``timeout`` s (None: wait); whether
        it came. The caller holds ``_waitpid_lock``."""
        conn = self._zygote_conn
        lost = f"the test zygote went away before child {self.pid} ended: its end is unknown"
        if conn.fileno() == -1:
            raise RuntimeError(lost)
        conn.settimeout(timeout)
        try:
            while not self._zygote_buffer.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    conn.close()
                    raise RuntimeError(lost)
                self._zygote_buffer += chunk
        except (TimeoutError, BlockingIOError):
            return False
        conn.close()
        self._handle_exitstatus(json.loads(self._zygote_buffer)["status"])
        return True

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    self._zygote_status(0)
            except (OSError, RuntimeError):
                if _deadstate is None:
                    raise  # a poll() loop would otherwise wait for ever
                self.returncode = _deadstate  # from __del__: nobody waits any more
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is not None:
            return self.returncode
        with self._waitpid_lock:
            if self.returncode is None and not self._zygote_status(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def Popen(args: Sequence[str], **kwargs: Any) -> ForkedPopen:
    """:class:`subprocess.Popen` for ``[sys.executable, "-c"|"-m", ...]``, forked warm."""
    return ForkedPopen(args, **kwargs)


def run(
    args: Sequence[str],
    *,
    input: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run` for ``[sys.executable, "-c"|"-m", ...]``, forked warm."""
    if input is not None:
        if kwargs.get("stdin") is not None:
            raise ValueError("stdin and input arguments may not both be used.")
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        if kwargs.get("stdout") is not None or kwargs.get("stderr") is not None:
            raise ValueError("stdout and stderr arguments may not be used with capture_output.")
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with ForkedPopen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
    if check and code:
        raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, code, stdout, stderr)


def run_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """:func:`tests._cli.run_cli` forked warm: ``python -m dataflow.cli ARGS``, its output
    captured; without ``env``, the test's environment less ``DATAFLOW_LEDGER``."""
    from tests import _cli

    return _cli.run_cli(*args, cwd=cwd, env=env, timeout=timeout, runner=run)


# ---------------------------------------------------------------- the zygote's side


def _serve() -> tuple[dict[str, Any], list[int]]:
    """The zygote: import, then fork a child per request and report each child's end
    on the request's connection. Returns only in a child (its request and streams);
    the server itself exits when its stdin ends."""
    for name in filter(None, os.environ.pop("DATAFLOW_TESTS_ZYGOTE_PRELOAD", "").split(",")):
        importlib.import_module(name)
    gc.freeze()  # so that a child's collections do not visit, and copy, the zygote's objects
    listener = socket.socket(fileno=int(sys.argv[2]))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the fd is written
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "ended")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "stop")
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "stop" and not os.read(sys.stdin.fileno(), 4096):
                os._exit(0)  # the test process closed our stdin, or died
            if key.data == "ended":
                os.read(wake_r, 4096)
                _report_ended(children)
            if key.data != "request":
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
                sys.stdout.flush()
                sys.stderr.flush()
                started_r, started_w = os.pipe()
                pid = os.fork()
            except OSError as error:
                _reply(conn, {"error": str(error)})
                conn.close()
                continue
            if pid == 0:  # the child: drop everything of the server's
                os.close(started_r)
                if request["new_session"]:
                    os.setsid()
                os.close(started_w)  # the end of the pipe: the session is set
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                selector.close()
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for other in (listener, conn, *children.values()):
                    other.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            # The pid goes out once the child leads its own session (when asked): a
            # killpg of that pid must reach it, however soon it comes.
            os.close(started_w)
            os.read(started_r, 1)
            os.close(started_r)
            children[pid] = conn
            _reply(conn, {"pid": pid})
            _report_ended(children)  # SIGCHLD of a quick child may have come already


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    (size,) = _HEADER.unpack(header)
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("the test process hung up mid-request")
        data += chunk
    return json.loads(data), fds


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # a test that gave up on its child needs no word
        conn.sendall(json.dumps(message).encode() + b"\n")


def _report_ended(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _reply(conn, {"status": status})
            conn.close()


def _child_main(started: tuple[dict[str, Any], list[int]]) -> None:
    """Become the child the request asked for, run its code as ``python`` would, and
    exit as the interpreter does (see :func:`_exit`)."""
    request, fds = started
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    zygote_path = os.environ.get("PYTHONPATH", "")
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # the zygote's, if an import asked for it: TMPDIR may differ
    _set_path(request["mode"], zygote_path)
    _set_streams(unbuffered=request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.argv = [request["mode"], *request["argv"]]
    try:
        if request["mode"] == "-c":
            main = types.ModuleType("__main__")
            main.__builtins__ = builtins
            sys.modules["__main__"] = main
            exec(compile(request["target"], "<string>", "exec"), main.__dict__)
        else:
            import runpy

            runpy._run_module_as_main(request["target"])  # what `python -m` calls
    except SystemExit as exit:
        _exit(_exit_status(exit))
    except BaseException as error:  # as the interpreter reports it, less this frame
        error = error.with_traceback(error.__traceback__.tb_next)  # the code's frames only
        sys.excepthook(type(error), error, error.__traceback__)
        _exit(1, interrupted=isinstance(error, KeyboardInterrupt))
    _exit(0)


def _exit_status(exit: SystemExit) -> int:
    """The exit status the interpreter gives for ``exit``, its message written as it does."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)
    return 1


def _exit(status: int, *, interrupted: bool = False) -> None:
    """End the child as the interpreter ends: non-daemon threads joined, atexit handlers
    run, the main module's objects finalized, the streams flushed; an interrupted one by
    SIGINT. What it leaves out is the teardown of every module the zygote imported: that
    writes to all of the zygote's pages, so that copying them on write cost a forked child
    0.5-1 s of CPU, half of what it saved."""
    threading._shutdown()
    atexit._run_exitfuncs()
    main = sys.modules.get("__main__")
    if main is not None:
        main.__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 120  # as the interpreter: output it could not write
    ctypes.CDLL(None).fflush(None)  # C libraries' own stdio buffers
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status & 0xFF)


def _set_path(mode: str, zygote_pythonpath: str) -> None:
    """``sys.path`` as ``python -c``/``-m`` would set it with the child's PYTHONPATH:
    the current directory first ('' for -c, its path for -m), then PYTHONPATH's entries."""
    old = [p for p in zygote_pythonpath.split(os.pathsep) if p]
    new = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = sys.path[1:]
    if rest[: len(old)] == old:
        rest = rest[len(old) :]
    sys.path[:] = ["" if mode == "-c" else os.getcwd(), *new, *rest]


def _set_streams(*, unbuffered: bool) -> None:
    """New ``sys.stdin``/``stdout``/``stderr`` on fds 0-2, buffered as the interpreter
    buffers them (stdout by line on a terminal only, stderr by line; ``-u``: neither)."""
    streams = []
    for fd, old in enumerate((sys.stdin, sys.stdout, sys.stderr)):
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        if fd == 0:
            buffer: Any = io.BufferedReader(raw)
        elif unbuffered:
            buffer = raw
        else:
            buffer = io.BufferedWriter(raw)
        streams.append(
            io.TextIOWrapper(
                buffer,
                encoding=old.encoding,
                errors=old.errors,
                line_buffering=fd == 2 or (fd == 1 and not unbuffered and raw.isatty()),
                write_through=unbuffered and fd != 0,
            )
        )
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams
