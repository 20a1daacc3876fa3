"""Checks that a transform makes of values known only when the program runs, and the settings
that say what a failed one does.

A rule that can only decide when the program runs (a pivot that may vanish, a Newton group that
may miss its tolerance, a select whose consistent case may not be unique, a gather whose
indices may not be a permutation) builds a NaN into its result where it fails and calls
`raise_where` with the flags: eagerly the error is raised at once, under `jit` when the program
runs (a `jax.debug.callback`), and under ``on_failure="nan"`` not at all, the NaN being the
answer the caller asked for.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import jax
import numpy as np

from jaxrev._compat import is_concrete

__all__ = ["ON_FAILURE", "NEWTON_STARTS", "counts", "settings", "setting", "raise_where"]

ON_FAILURE = ("raise", "nan")

_settings: list[dict] = [dict(on_failure="raise", newton=True, newton_start=None)]


@contextlib.contextmanager
def settings(**changes: Any) -> Iterator[None]:
    """Settings while a transform traces (nested calls inherit the rest): `on_failure`, what a
    failed run-time check does ("raise": eagerly an error, under `jit` a runtime error;
    "nan"), `newton`, whether Newton's method is used at all (the inverse transforms need
    only Jacobians, which linear lumps give exactly), and `newton_start`: None (Newton starts,
    per element, from the candidate start with the smallest residual) or k (from start k
    only: where the map has several preimages, `choices` tries each start's)."""
    if changes.get("on_failure", "raise") not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {ON_FAILURE}, got "
                         f"{changes['on_failure']!r}")
    _settings.append({**_settings[-1], **changes})
    try:
        yield
    finally:
        _settings.pop()


def setting(name: str) -> Any:
    return _settings[-1][name]


NEWTON_STARTS = 4
"""How many single starting points `newton_start` picks from (0.5, then up to three values
the group reads, then 0), besides the default: the best of all, per element."""

counts = {"newton": 0}
"""How many groups Newton's method has solved so far (`choices` asks whether a branch used
it)."""


def raise_where(error: Callable[..., Exception | None], *flags: Any) -> None:
    """Raise `error(*flags)` (None: nothing wrong) now on concrete values, else when the program
    runs; nothing under ``on_failure="nan"``, where the NaN left in the result is the answer."""
    if _settings[-1]["on_failure"] == "nan":
        return
    if all(is_concrete(x) for x in flags):
        err = error(*[np.asarray(x) for x in flags])
        if err is not None:
            raise err
        return

    def at_run_time(*vals: Any) -> None:
        err = error(*vals)
        if err is not None:
            raise err

    jax.debug.callback(at_run_time, *flags)
