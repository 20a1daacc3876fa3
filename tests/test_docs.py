"""Every ```python block of the README and of the docs pages listed here runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(
    os.path.join("docs", "rules", f)
    for f in os.listdir(os.path.join(ROOT, "docs", "rules"))
    if f.endswith(".md")
) + [os.path.join("docs", "optim.md"), os.path.join("docs", "primitives.md"), "README.md"]


def _blocks(page):
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


CASES = [(page, k) for page in PAGES for k in range(len(_blocks(page)))]


@pytest.mark.parametrize("page,k", CASES, ids=[f"{p}#{k}" for p, k in CASES])
def test_docs_block_runs(page, k):
    code = _blocks(page)[k]
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, f"{page} block {k} failed:\n{code}\n{proc.stderr[-3000:]}"
