"""`dataflow mooncake-keeper` lends the memory, and Mooncake's own log stays quiet.

A real ``mooncake_master`` of its own (so that only the keeper lends memory), the
keeper as a real process, puts and gets in other real processes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import urllib.parse

import pytest

from stores import open_store
from stores.mooncake_master import MooncakeMaster
from tests import _zygote

pytestmark = pytest.mark.mooncake

_GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ", re.MULTILINE)

_PUT_GET = """
    import sys, torch
    from stores import open_store
    store = open_store(sys.argv[1])
    ref = store.put("s", {"x": torch.arange(10)})
    assert int(store.get(ref)["x"].sum()) == 45
    store.delete(ref)
    store.close()
    print("ok", flush=True)
"""


@pytest.fixture(scope="module")
def master(mooncake_installed):
    with MooncakeMaster(lease_ttl_ms=200) as started:
        yield started


def _put_get(master: MooncakeMaster, **env: str) -> subprocess.CompletedProcess[str]:
    uri = f"{master.store_uri(namespace='keeper')}&segment_size=0"
    environ = {k: v for k, v in os.environ.items() if k != "DATAFLOW_MOONCAKE_LOG"}
    if "DATAFLOW_SET_MC_LOG_LEVEL" not in environ:  # a level set by hand, not by dataflow
        environ.pop("MC_LOG_LEVEL", None)
    # Forked from the test zygote, which has not loaded Mooncake's client: its log level
    # is still read from this child's environment, when the store loads it.
    return _zygote.run(
        [sys.executable, "-c", textwrap.dedent(_PUT_GET), uri],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_keeper_lends_memory_until_sigterm_and_exits_0(master):
    lent = master.store_uri(namespace="keeper") + f"&segment_size={urllib.parse.quote('64M')}"
    keeper = _zygote.Popen(
        [sys.executable, "-m", "dataflow", "mooncake-keeper", "--store", lent],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert keeper.stdout is not None
        assert keeper.stdout.readline().startswith("lending 64 MiB to mooncake://")
        done = _put_get(master)  # a process that lends no memory: the keeper's holds it
        assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
        keeper.send_signal(signal.SIGTERM)
        out, err = keeper.communicate(timeout=30)
        assert keeper.returncode == 0, err
        assert "stopped" in out
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait()


def test_the_keeper_refuses_a_store_that_lends_nothing(master):
    lends_none = f"{master.store_uri(namespace='keeper')}&segment_size=0"
    done = _zygote.run(
        [sys.executable, "-m", "dataflow", "mooncake-keeper", "--store", lends_none],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "lends no memory (segment_size=0)" in done.stderr


def test_mooncakes_own_log_is_quiet_unless_asked_for(master, monkeypatch):
    for name in ("DATAFLOW_MOONCAKE_LOG", "MC_LOG_LEVEL", "DATAFLOW_SET_MC_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)  # and what the store sets goes at the end
    lender = open_store(f"{master.store_uri(namespace='keeper')}&segment_size=64M")  # the memory
    try:
        # This process is quiet too; its children inherit the level it set, marked as its.
        assert os.environ["MC_LOG_LEVEL"] == "ERROR"
        quiet = _put_get(master)
        assert quiet.returncode == 0, quiet.stderr
        assert not _GLOG_LINE.search(quiet.stderr), quiet.stderr
        assert "Logging before InitGoogleLogging" not in quiet.stderr
        loud = _put_get(master, DATAFLOW_MOONCAKE_LOG="1")
        assert loud.returncode == 0, loud.stderr
        assert len(_GLOG_LINE.findall(loud.stderr)) > 5, loud.stderr
    finally:
        lender.close()
