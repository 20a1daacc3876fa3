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
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._compat import debug_effect, is_concrete
from jaxrev._primitive import make_primitive

__all__ = ["ON_FAILURE", "NEWTON_STARTS", "counts", "settings", "setting", "raise_where",
           "check_p", "check_at_run_time"]

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


def snapshot() -> tuple:
    """The current settings, hashable: part of a cached call's key (they change its trace)."""
    return tuple(sorted(_settings[-1].items()))


NEWTON_STARTS = 4
"""How many single starting points `newton_start` picks from (0.5, then up to three values
the group reads, then 0), besides the default: the best of all, per element."""

counts = {"newton": 0}
"""How many groups Newton's method has solved so far (`choices` asks whether a branch used
it)."""


def raise_where(error: Callable[..., Exception | None], *flags: Any, bad: Any = None,
                always: bool = False) -> None:
    """Raise `error(*flags)` (None: nothing wrong) now on concrete values, else when the program
    runs; nothing under ``on_failure="nan"``, where the NaN left in the result is the answer,
    unless `always` (a failure that leaves no NaN behind: a loop stopped at its bound).

    `bad` (a boolean computed from the flags, any of whose elements says `error` will raise)
    makes the run-time check cheap: the host is called only when it holds, and under `vmap`
    once for the whole batch, with the first bad sample's flags (`check_p`)."""
    if _settings[-1]["on_failure"] == "nan" and not always:
        return
    if all(is_concrete(x) for x in flags):
        err = error(*[np.asarray(x) for x in flags])
        if err is not None:
            raise err
        return
    check_at_run_time(error, *flags, bad=bad)


def check_at_run_time(error: Callable[..., Exception | None], *flags: Any,
                      bad: Any = None) -> None:
    """Raise `error(*flags)` when the program runs, where `bad` (default: always ask the
    host) holds: one host call per batch under `vmap`, none when nothing is bad."""
    if bad is None:
        bad = jnp.ones((), bool)
    check_p.bind(jnp.asarray(bad), *flags, error=_Hashable(error), levels=0)


class _Hashable:
    """A callable as a primitive's param (compared by identity)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _check_impl(bad: Any, *flags: Any, error: Callable, levels: int) -> list:
    def on_host(bad, *flags):
        bad = np.asarray(bad)
        if not bad.any():
            return
        vals = [np.asarray(f) for f in flags]
        if levels:   # the first bad sample of the batch
            at = np.unravel_index(int(np.argmax(bad.reshape(-1))), bad.shape)
            vals = [v[at] for v in vals]
        err = error(*vals)
        if err is not None:
            raise err

    lax.cond(jnp.any(bad), lambda: jax.debug.callback(on_host, bad, *flags), lambda: None)
    return []


def _check_batch(args: Any, dims: Any, *, error: Callable, levels: int) -> tuple[list, list]:
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [jnp.moveaxis(a, d, 0) if d is not None else
             jnp.broadcast_to(a, (size,) + jnp.shape(a)) for a, d in zip(args, dims)]
    # (bad's own element axes beyond the batch are reduced: one flag per sample)
    bad = moved[0]
    bad = jnp.any(bad.reshape(bad.shape[:levels + 1] + (-1,)), axis=-1)
    check_p.bind(bad, *moved[1:], error=error, levels=levels + 1)
    return [], []


def _check_jvp(primals: Any, tangents: Any, **params: Any) -> tuple[list, list]:
    return check_p.bind(*primals, **params), []


check_p = make_primitive(
    "jaxrev_check", multiple_results=True, impl=_check_impl, effectful=True,
    abstract=lambda *avals, **_: ([], {debug_effect}), jvp=_check_jvp, batch=_check_batch)
"""``check_p(bad, *flags, error, levels)``: when the program runs, if any element of `bad`
holds, raise ``error(*flags)`` on the host. `levels` leading axes of every operand are vmap's
batch axes (the first bad sample's flags are passed). It has the debug effect, so it is never
removed as dead code, and it is lowered as a `cond`: no host call when nothing is bad."""
