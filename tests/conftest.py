"""pytest's configuration of jaxrev's tests, loaded before any test module.

- float64 is on for every test (the tolerances are float64's; a test that wants float32 asks
  for it by dtype).
- XLA compiles without its backend's expensive optimizations (``jax_disable_most_optimizations``:
  LLVM's level 0; the HLO passes, buffer assignment and so the memory figures tests assert on,
  are unchanged): a test runs each program once or twice, so compiling dominates, and this cuts
  the default tier's time by about a fifth. Subprocess tests and the benchmarks compile as a
  user does.
- This folder is on ``sys.path`` (in pytest's default ``prepend`` import mode, the folder of
  a ``conftest.py`` outside any package goes first), so tests import what they share by name:
  ``from helpers import rel_error`` (errors between results, `tests/helpers.py`),
  ``from programs.elements import ...`` (the shared programs, `tests/programs/`).
- The tiers are markers, set in ``pyproject.toml``: the default run deselects ``slow``;
  ``pytest -m slow`` runs the long matrices and subprocess checks (the README's "Set up" section).
"""

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_disable_most_optimizations", True)
