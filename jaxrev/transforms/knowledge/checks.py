"""Checks that a transform makes of values known only when the program runs, and what a
failed one does.

A rule that can only decide when the program runs (a pivot that may vanish, a Newton group that
may miss its tolerance, a select whose consistent case may not be unique, a gather whose
indices may not be a permutation) builds a NaN into its result where it fails and calls
`raise_where` with its walk's `on_error` and the flags: under "raise" the error is raised
eagerly at once, under `jit` when the program runs (a `jax.debug.callback`); under "warn" it is
a `FailureWarning` instead, at the same moments; under "nan" nothing happens, the NaN being the
answer the caller asked for. A check failing in a compiled program reaches the caller of
`jax.jit` as JAX's runtime error; `jr.jit` and `jr.raise_runtime_errors()` (`jaxrev._runtime`)
raise the check's own error instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._compat import at_call_site, call_site, is_concrete, keep_in_dce
from jaxrev._errors import FailureWarning, in_sample
from jaxrev._primitive import make_primitive
from jaxrev._runtime import note_check, raise_at_run_time
from jaxrev.transforms.knowledge.context import ON_ERROR

__all__ = ["ON_ERROR", "NEWTON_STARTS", "raise_where", "check_p", "check_at_run_time"]

NEWTON_STARTS = 4
"""How many single starting points a walk's `newton_start` picks from (0.5, then up to three
values the group reads, then 0), besides the default: the best of all, per element."""


def raise_where(
    on_error: str,
    error: Callable[..., Exception | None],
    *flags: Any,
    bad: Any = None,
    always: bool = False,
) -> None:
    """Raise `error(*flags)` (None: nothing wrong) now on concrete values, else when the program
    runs; under ``on_error="warn"`` warn with its message instead; nothing under "nan", where
    the NaN left in the result is the answer, unless `always` (a failure that leaves no NaN
    behind: a loop stopped at its bound: it raises under every policy, since a result cut
    short is wrong without a NaN to show it).

    `bad` (a boolean computed from the flags, any of whose elements says `error` will raise)
    makes the run-time check cheap: the host is called only when it holds, and under `vmap`
    once for the whole batch, with the first bad sample's flags (`check_p`)."""
    if on_error == "nan" and not always:
        return
    if on_error == "warn" and not always:
        error = _Warning(error)
    if all(is_concrete(x) for x in flags):
        err = error(*[np.asarray(x) for x in flags])
        if err is not None:
            raise err
        return
    check_at_run_time(error, *flags, bad=bad)


class _Warning:
    """`error` turned into a warning (``on_error="warn"``): it warns and returns None."""

    def __init__(self, error: Callable[..., Exception | None]) -> None:
        self.error = error

    def __call__(self, *flags: Any) -> None:
        err = self.error(*flags)
        if err is not None:
            warnings.warn(str(err), FailureWarning, stacklevel=2)
        return None


def check_at_run_time(error: Callable[..., Exception | None], *flags: Any, bad: Any = None) -> None:
    """Raise `error(*flags)` when the program runs, where `bad` (default: always ask the
    host) holds: one host call per batch under `vmap`, none when nothing is bad."""
    if bad is None:
        bad = jnp.ones((), bool)
    note_check()
    check_p.bind(jnp.asarray(bad), *flags, error=_StagedError(error, call_site()), levels=0)


class _StagedError:
    """A callable as a primitive's param (compared by identity). It builds its error under the
    user's call site found when the check was staged (`site`): on the host, where the check
    runs, the Python stack is the callback's."""

    def __init__(self, fn: Callable, site: Any = None) -> None:
        self.fn, self.site = fn, site

    def __call__(self, *args: Any) -> Any:
        with at_call_site(self.site):
            return self.fn(*args)


def _first_bad(bad: Any, flags: Any, levels: int) -> tuple[list, tuple | None] | None:
    """The flags of the first bad sample on the host and that sample's index under `vmap`
    (None: not batched); None when nothing is bad."""
    bad = np.asarray(bad)
    if not bad.any():
        return None
    vals = [np.asarray(f) for f in flags]
    if not levels:
        return vals, None
    at = np.unravel_index(int(np.argmax(bad.reshape(-1))), bad.shape)
    return [v[at] for v in vals], tuple(int(i) for i in at)


def _error_at(error: Callable, bad_sample: tuple[list, tuple | None]) -> Any:
    """`error` of the first bad sample's flags, its elements named within that sample."""
    vals, sample = bad_sample
    with in_sample(sample):
        return error(*vals)


def _check_eager(bad: Any, *flags: Any, error: Callable, levels: int) -> list:
    """Eagerly (concrete operands), the check runs here: `error` raises as it is."""
    bad_sample = _first_bad(bad, flags, levels)
    err = None if bad_sample is None else _error_at(error, bad_sample)
    if err is not None:
        raise err
    return []


def _check_lowered(bad: Any, *flags: Any, error: Callable, levels: int) -> list:
    """In a compiled program, a host callback under a `cond`: the error it raises is stashed
    for `jr.jit` / `jr.raise_runtime_errors()` to re-raise as its own type
    (`_runtime.raise_at_run_time`)."""
    note_check()

    def on_host(bad, *flags):
        bad_sample = _first_bad(bad, flags, levels)
        if bad_sample is None:
            return
        try:
            err = _error_at(error, bad_sample)
        except Exception as e:  # an `error` that raises (`fail`) rather than returns
            err = e
        if err is not None:
            raise_at_run_time(err)

    lax.cond(jnp.any(bad), lambda: jax.debug.callback(on_host, bad, *flags), lambda: None)
    return []


def _check_batch(args: Any, dims: Any, *, error: Callable, levels: int) -> tuple[list, list]:
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [
        jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + jnp.shape(a))
        for a, d in zip(args, dims)
    ]
    # (bad's own element axes beyond the batch are reduced: one flag per sample)
    bad = moved[0]
    bad = jnp.any(bad.reshape(bad.shape[: levels + 1] + (-1,)), axis=-1)
    check_p.bind(bad, *moved[1:], error=error, levels=levels + 1)
    return [], []


def _check_jvp(primals: Any, tangents: Any, **params: Any) -> tuple[list, list]:
    return check_p.bind(*primals, **params), []


check_p = make_primitive(
    "jaxrev_check",
    multiple_results=True,
    impl=_check_eager,
    lowering=_check_lowered,
    abstract=lambda *avals, **_: [],
    jvp=_check_jvp,
    batch=_check_batch,
)
keep_in_dce(check_p)
"""``check_p(bad, *flags, error, levels)``: when the program runs, if any element of `bad`
holds, raise ``error(*flags)`` on the host. `levels` leading axes of every operand are vmap's
batch axes (the first bad sample's flags are passed). It has no effect (an effect would turn
off JAX's fast dispatch of the user's whole `jit` function) but JAX's dead-code elimination
keeps it (`_compat.keep_in_dce`), and it is lowered as a `cond` calling the host (a call XLA
keeps: it has a side effect) only when something is bad. Eagerly
it raises at once; in a compiled program its error reaches the caller as JAX's runtime error,
which `jr.jit` and `jr.raise_runtime_errors()` turn back into the error itself."""
