"""Every ```python block in README.md and docs/*.md runs as written.

Each example runs as ``python -c CODE`` in a process of its own (its own cwd, environment
and output, ``__name__ == "__main__"``, exit status checked), forked from the test zygote
(``tests/_zygote.py``), which imported torch, dataflow, stores, training and eval once:
46 fresh interpreters would import torch 41 times, over a minute of CPU.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests import _zygote

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[pytest.param]:
    params = []
    for page in PAGES:
        if not page.exists():
            continue
        for n, match in enumerate(_BLOCK.finditer(page.read_text())):
            line = page.read_text()[: match.start()].count("\n") + 1
            params.append(pytest.param(match.group(1), id=f"{page.name}:{line}:{n}"))
    return params


@pytest.mark.parametrize("code", _blocks())
def test_doc_example_runs(code: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = _zygote.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"
