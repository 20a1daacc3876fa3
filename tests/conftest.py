"""pytest's configuration of jaxrev's tests, loaded before any test module.

- float64 is on for every test (the tolerances are float64's; a test that wants float32 asks
  for it by dtype).
- XLA compiles without its backend's expensive optimizations (``jax_disable_most_optimizations``:
  LLVM's level 0; the HLO passes, buffer assignment and so the memory figures tests assert on,
  are unchanged): a test runs each program once or twice, so compiling dominates, and this cuts
  the default tier's time by about a fifth. The subprocesses tests start (the examples, the
  sharded and multi-process workers) inherit it through ``JAX_DISABLE_MOST_OPTIMIZATIONS``
  (a fifth of the slow tier's examples); the benchmarks compile as a user does.
- This folder is on ``sys.path`` (in pytest's default ``prepend`` import mode, the folder of
  a ``conftest.py`` outside any package goes first), so tests import what they share by name:
  ``from helpers import rel_error`` (errors between results, `tests/helpers.py`),
  ``from programs.elements import ...`` (the shared programs, `tests/programs/`).
- The tiers are markers, set in ``pyproject.toml``: the default run deselects ``slow``;
  ``pytest -m slow`` runs the long matrices and subprocess checks (the README's "Set up"
  section). Besides the tests marked in their files, `tests/slow_cases.txt` lists by node id
  the default tier's costliest tests as measured (`tools/slow_cases.py` writes it), which
  are marked ``slow`` here; ``JAXREV_SLOW_CASES=0`` ignores the list (to measure them again).
"""

import os
from pathlib import Path

import jax
import pytest

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_disable_most_optimizations", True)
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")  # (for subprocesses)


SLOW_CASES = Path(__file__).with_name("slow_cases.txt")


def _slow_cases() -> set[str]:
    if os.environ.get("JAXREV_SLOW_CASES", "1") == "0":
        return set()
    ids = set()
    for line in SLOW_CASES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            ids.add(line.partition(" # ")[0].strip())  # an id may hold spaces
    return ids


def pytest_collection_modifyitems(config, items):
    listed = _slow_cases()
    seen = set()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
            seen.add(item.nodeid)
    # a stale entry (a renamed test) would leave its costly twin in the default tier: checked
    # when the whole suite is collected (no paths or -k on the command line)
    whole = not config.args or config.args == list(config.getini("testpaths"))
    if whole and not config.option.keyword and listed - seen:
        missing = "\n  ".join(sorted(listed - seen))
        raise pytest.UsageError(f"tests/slow_cases.txt lists tests that do not exist:\n  {missing}")
