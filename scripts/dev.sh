#!/usr/bin/env bash
# Set everything up from a clean clone, then run the demo or the whole test suite.
#
#   bash scripts/dev.sh demo            # the main job: `dataflow demo`
#   bash scripts/dev.sh test            # the whole test suite (what CI runs)
#   bash scripts/dev.sh test --quick    # the quick tier, for development (under 2 min)
#
# Extra arguments go to pytest (a file, -k, -x). The suite runs on 4 pytest-xdist
# workers: its tests wait on processes, sockets, timeouts and cut links about as much as
# they compute, and at most half the workers take the waiting ones (the simulated
# hosts' faults) at a time (tests/_schedule.py), so the others keep both cores busy.
# DATAFLOW_TEST_WORKERS=N sets another number, 0 runs it in-process.
# --quick (a pytest option of tests/conftest.py) leaves out the slow tests and keeps a
# real PostgreSQL server, a real mooncake_master and real processes.
#
# Creates .venv, installs torch first when none is importable (pip then takes
# the CPU build instead of pulling the multi-GB CUDA one), then the package with
# its test extras, and the system packages the real-component tests need
# (PostgreSQL server binaries; libibverbs1 and libnuma1 for Mooncake).
set -euo pipefail
cd "$(dirname "$0")/.."

job="${1:-}"
case "$job" in
  demo|test) shift ;;
  *)
    echo "usage: bash scripts/dev.sh demo [args...]" >&2
    echo "       bash scripts/dev.sh test [--quick] [pytest args...]" >&2
    exit 2 ;;
esac

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" "torch==2.13.0"
fi

have_pg() {
  command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}
have_lib() {
  ldconfig -p 2>/dev/null | grep -q "$1"
}
apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages: $*" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "warning: please install the system packages: $* (e.g. sudo apt-get install $*)" >&2
  fi
}

if [ "$job" = test ]; then
  "${pip[@]}" -e ".[test,examples]"   # examples: transformers, for tests/test_example_eagle3.py
  missing=()
  have_pg || missing+=(postgresql)
  have_lib libibverbs.so.1 || missing+=(libibverbs1)
  have_lib libnuma.so.1 || missing+=(libnuma1)
  command -v faketime >/dev/null 2>&1 || missing+=(faketime)  # tests/test_clocks.py, test_doctor.py
  if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
  workers="${DATAFLOW_TEST_WORKERS:-4}"
  exec .venv/bin/python -m pytest -n "$workers" "$@"
else
  "${pip[@]}" -e ".[plot]"   # plot: matplotlib, for the demo's timeline.png
  exec .venv/bin/dataflow demo "$@"
fi
