"""Every ```python block in README.md and docs/*.md runs as written.

Each example runs as ``python -c CODE`` in a process of its own (its own cwd, environment
and output, ``__name__ == "__main__"``, exit status checked), forked from the test zygote
(``tests/_zygote.py``), which imported torch, dataflow, stores, training and eval once:
46 fresh interpreters imported torch 41 times, over a minute of CPU. An example that
needs a fresh interpreter says so in :data:`FRESH_INTERPRETER`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import _zygote

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

#: The examples that run in a fresh interpreter, not forked from the zygote: (page, a line
#: of the example) -> why. An example belongs here when what it shows depends on a fresh
#: process: what importing a module costs or pulls in, an import-time setting read from
#: the environment, or multiprocessing's "spawn" of a function in a main *file*. None does
#: now (the multi-rank examples fork their ranks from the example's own process).
FRESH_INTERPRETER: dict[tuple[str, str], str] = {}


def _blocks() -> list[pytest.param]:
    params = []
    for page in PAGES:
        if not page.exists():
            continue
        for n, match in enumerate(_BLOCK.finditer(page.read_text())):
            line = page.read_text()[: match.start()].count("\n") + 1
            code = match.group(1)
            fresh = [
                why
                for (name, text), why in FRESH_INTERPRETER.items()
                if name == page.name and text in code.splitlines()
            ]
            params.append(pytest.param(code, bool(fresh), id=f"{page.name}:{line}:{n}"))
    return params


@pytest.mark.parametrize(("code", "fresh"), _blocks())
def test_doc_example_runs(
    code: str, fresh: bool, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # TMPDIR: an example's own temporary directories (tempfile.mkdtemp, left for the
    # reader to look at) go into one removed after it; traversable by all, since an
    # example's PostgresServer runs its server as the postgres account.
    scratch = Path(tempfile.mkdtemp(prefix="doc-example-"))
    scratch.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(scratch))
    result = (subprocess.run if fresh else _zygote.run)(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_every_fresh_interpreter_entry_names_one_example() -> None:
    for (page, text), why in FRESH_INTERPRETER.items():
        path = {p.name: p for p in PAGES}[page]
        blocks = [m.group(1) for m in _BLOCK.finditer(path.read_text())]
        found = [code for code in blocks if text in code.splitlines()]
        assert len(found) == 1, f"{page}: {text!r} ({why}) is in {len(found)} examples, not 1"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"
