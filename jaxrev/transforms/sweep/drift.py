"""Drift checks of `reversible`'s backward run (docs/design.md §3.8).

A rebuilt trajectory drifts from the one the forward run computed: rounding, amplified by the
backward dynamics (a contracting loop run backwards expands it without bound). Every rebuilt
value that has a true counterpart is compared with it: the inputs of a `reversible` call (the
caller holds them) and the start of every checkpointed segment of a loop (`dial.segment_checks`).

A backward run's comparisons go to its `Log`, which its walk context carries
(`WalkContext.drift`; a planning walk has none). A walk collects them in a `scope`: one number
per comparison, the drift divided by
its tolerance (a *ratio*, NaN counted as infinite), and a *site* (which comparison: an index
into the `Log` of the top-level backward run). A loop's body walk is traced inside a
`lax.scan` or `while_loop`, so its scope's worst `(ratio, site)` pair leaves the loop in the
loop's carry (`combine`) and is noted in the enclosing scope. `Log.finish` acts on the worst
one: raise (eagerly, or under `jit` when the program runs), warn, NaN, or nothing.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._batching import where
from jaxrev._compat import is_concrete, user_source
from jaxrev._errors import DriftError
from jaxrev.transforms.knowledge.checks import check_at_run_time

__all__ = [
    "DriftWarning",
    "no_drift",
    "leaf_drift",
    "values_tol",
    "ratio",
    "combine",
    "Site",
    "Log",
    "log_for",
    "site",
    "note",
    "scope",
    "describe_loops",
    "finite",
    "budget_dtype",
    "Budget",
    "LoopRepair",
    "RepairReport",
    "tally",
    "send_report",
]


class DriftWarning(UserWarning):
    """A rebuilt value missed its true counterpart (`reversible(..., on_drift="warn")`); the
    gradient is still returned.

    **Arguments:**

    - `message`: the warning's text (that of the `jr.DriftError` ``on_drift="raise"`` would
      raise: the loop or call, and the measured drift).

    **Example:**

        >>> import warnings, jax, jax.numpy as jnp, jaxrev as jr
        >>> from jax import lax
        >>> halve = lambda y: lax.fori_loop(0, 60, lambda i, y: 0.5 * y + 0.1, y)  # x2 backwards
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     f = jr.reversible(halve, on_drift="warn", checkpoint_every=None)
        ...     g = jax.grad(lambda y: f(y).sum())(jnp.ones(2))
        >>> [type(w.message).__name__ for w in caught]
        ['DriftWarning']
    """


def budget_dtype() -> Any:
    """The dtype of a segmented backward run's gradient budget (`dial.grad_ratio`): float64
    under x64, as the budget spans many magnitudes."""
    return jnp.result_type(float)


class Budget(NamedTuple):
    """A segmented backward run's gradient budget (`grad_ratio`), carried through its loops
    (a pytree): what rounding and what the kept segments' drift move the gradient by."""

    rounding: Any  # B: the forward run's own rounding, summed over the iterations swept
    drift: Any  # E: the drift of the segments kept (not repaired), summed


def finite(values: Sequence[Any]) -> Any:
    """Whether every floating element of `values` (None entries skipped) is finite."""
    ok = jnp.ones((), bool)
    for val in values:
        if val is not None and jnp.issubdtype(jnp.result_type(val), jnp.inexact):
            # (one reduction, into which XLA fuses the `abs`: the maximum is NaN where any
            # element is, infinite where any is; `all(isfinite(x))` makes XLA:CPU write a
            # mask the size of x first, for a parameter's cotangent checked once a call)
            ok = ok & jnp.isfinite(jnp.max(jnp.abs(val), initial=0))
    return ok


def no_drift() -> tuple[Any, Any]:
    """The `(ratio, site)` pair of no comparison: a loop's starting worst."""
    return jnp.zeros((), jnp.float32), jnp.full((), -1, jnp.int32)


def leaf_drift(rebuilt: Any, true: Any, atol: float = 0.0) -> Any:
    """max|rebuilt − true| / (max|true| + atol): a leaf's normwise relative error; a leaf that
    is all zeros is measured absolutely (so x = 0 does not blow it up). Infinite where a NaN
    or an infinity differs from the true value."""
    rebuilt = jnp.asarray(rebuilt)
    true = jnp.asarray(true, rebuilt.dtype)
    if rebuilt.dtype == jnp.bool_:  # a flag rebuilt wrong is off by one, relative to one
        rebuilt, true = rebuilt.astype(jnp.int32), true.astype(jnp.int32)
    if rebuilt.size == 0:
        return jnp.zeros((), jnp.float32)
    # equal values (an infinity the program holds, rebuilt as that infinity) do not drift;
    # a NaN or an infinity where the true value differs is infinitely far
    same = (rebuilt == true) | (jnp.isnan(rebuilt) & jnp.isnan(true))
    err = where(same, 0.0, jnp.abs(rebuilt - true))
    scale = jnp.max(where(jnp.isfinite(true), jnp.abs(true), 0.0))
    den = where(scale > 0, scale, 1.0) + atol
    drift = jnp.max(err) / den
    return where(jnp.isnan(drift), jnp.inf, drift).astype(jnp.float32)


def values_tol(dial: Any, dtypes: Sequence[Any], steps: int = 1) -> float:
    """The tolerance for values compared together, rebuilt over `steps` equations: the
    loosest of their floating dtypes' (a float64 carry that reads a float32 one is rebuilt no
    better than float32)."""
    floats = [dtype for dtype in dtypes if jnp.issubdtype(dtype, jnp.inexact)]
    return max((dial.tol(dtype, steps) for dtype in floats), default=0.0)


def ratio(dial: Any, rebuilt: Sequence[Any], true: Sequence[Any], steps: int = 1) -> Any:
    """The largest drift / tolerance over the floating leaves (infinite where a NaN or an
    infinity appeared)."""
    tol = values_tol(dial, [jnp.result_type(leaf) for leaf in true], steps)
    worst = jnp.zeros((), jnp.float32)
    for rebuilt_leaf, true_leaf in zip(rebuilt, true):
        if not jnp.issubdtype(jnp.result_type(true_leaf), jnp.inexact):
            continue
        worst = jnp.maximum(worst, leaf_drift(rebuilt_leaf, true_leaf) / tol)
    return worst


def combine(a: tuple[Any, Any] | None, b: tuple[Any, Any] | None) -> tuple[Any, Any] | None:
    """The worse of two `(ratio, site)` pairs; None (no comparison: a body whose walk compares
    nothing) leaves the other as it is, so that a loop of such bodies carries no per-iteration
    selects (XLA cannot fold them: a NaN ratio is not "less")."""
    if b is None:
        return a
    if a is None:
        return b
    ratio_a, site_a = a
    ratio_b, site_b = b
    take = jnp.asarray(ratio_b, jnp.float32) > jnp.asarray(ratio_a, jnp.float32)
    return (
        where(take, ratio_b, ratio_a).astype(jnp.float32),
        where(take, site_b, site_a).astype(jnp.int32),
    )


@dataclass
class Site:
    what: str  # the comparison, in words
    where: str  # the loop's (or call's) user line
    tol: float  # relative drift tolerated (without cotangents, or drift_rtol)
    inputs: bool = False  # the call's rebuilt inputs (the message lists the loops)
    gradient: bool = False  # its ratio is the gradient's (dial.grad_ratio), not tol's


class LoopRepair(NamedTuple):
    """What the backward run of one checkpointed loop did (`reversible(..., report=)`).

    **Fields:**

    - `where`: the loop's user line.
    - `iterations`: T, its length (a bounded `while_loop`'s: its bound, `max_steps`).
    - `segment_length`: K, the iterations between two checkpoints.
    - `segments`: ⌈T/K⌉.
    - `repaired`: the segments recomputed forward from their checkpoints (after a miss, every
      segment), under `on_drift="repair"`; 0 under the other dials.
    - `recomputed`: the iterations those segments hold (the extra forward work).

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> leap = lambda qp: jax.lax.fori_loop(
        ...     0, 900, lambda i, s: (s[0] + 0.01 * s[1], s[1] - 0.01 * (s[0] + 0.01 * s[1])), qp
        ... )
        >>> seen = []
        >>> f = jr.reversible(leap, report=seen.append)
        >>> g = jax.grad(lambda qp: f(qp)[0].sum())((jnp.ones(3), jnp.zeros(3)))
        >>> (loop,) = seen[-1].loops
        >>> loop.iterations, loop.segment_length, loop.segments, int(loop.repaired)
        (900, 30, 30, 0)
    """

    where: str
    iterations: int
    segment_length: int
    segments: int
    repaired: Any
    recomputed: Any


class RepairReport(NamedTuple):
    """What one backward run of `reversible(fun, report=callback)` repaired: `callback`
    receives it each time the gradient is computed (eagerly, or when a compiled program
    runs; under `vmap`, its counts carry the batch).

    **Fields:**

    - `function`: the name of the function `reversible` was given.
    - `loops`: a `LoopRepair` per checkpointed top-level `scan` or `fori_loop`, in program
      order (a loop nested in another's body has no checkpoints of its own under "auto"; a
      `while_loop` checkpointed under `max_steps` repairs per segment too, but is not
      counted here yet).

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> loop = lambda y: jax.lax.fori_loop(0, 400, lambda i, y: y + 0.5 * jnp.sin(y), y)
        >>> seen = []
        >>> f = jr.reversible(loop, report=seen.append, drift_rtol=1e-9)  # a strict tolerance
        >>> g = jax.grad(lambda y: f(y).sum())(jnp.array([0.3, 1.0], jnp.float32))
        >>> it = seen[-1].loops[0]
        >>> it.segments, int(it.repaired) > 0, int(it.recomputed) == 20 * int(it.repaired)
        (20, True, True)
    """

    function: str
    loops: tuple[LoopRepair, ...]


@dataclass
class Log:
    """The comparisons of one top-level backward run, and what a miss does; the repairs of
    its checkpointed top-level loops (`tallies`: a `LoopRepair` each, counts traced)."""

    dial: Any
    name: str
    loops: str = ""  # the program's loops, for the inputs' message
    sites: list[Site] = field(default_factory=list)
    scopes: list[list] = field(default_factory=lambda: [[]])
    tallies: list[LoopRepair] = field(default_factory=list)

    def worst(self) -> tuple[Any, Any]:
        return _Scope(self.scopes[0]).worst() or no_drift()

    def message(self, drift_ratio: float, index: int) -> str:
        """The message of comparison `index`'s miss by `drift_ratio` (drift / tolerance)."""
        in_log = 0 <= index < len(self.sites)
        compared = self.sites[index] if in_log else Site("a rebuilt value", "", 0.0)
        where = f" at {compared.where}" if compared.where else ""
        extra = f"\n{self.loops}" if compared.inputs and self.loops else ""
        if not math.isfinite(drift_ratio):
            miss = "is not finite (NaN or inf where the true value is finite)"
        elif compared.gradient:
            miss = (
                f"misses its true value by a drift that moves the gradient {drift_ratio:.3g} "
                "times as much as the forward run's own rounding does"
            )
        else:
            miss = (
                f"misses its true value by a relative drift of {drift_ratio * compared.tol:.3g} "
                f"(tolerance {compared.tol:.3g})"
            )
        if self.dial.on_drift == "repair":
            why = (
                "no checkpoint could repair it (it is rebuilt outside a checkpointed "
                "loop, or the loop's body cannot be recomputed)"
            )
            out = (
                "Ways out: jr.store(x) on a value inside the program (rebuilding resets "
                "there), a smaller checkpoint_every=K, a looser drift_rtol, or "
                "on_drift='warn' / 'ignore'."
            )
        else:
            why = (
                "the backward run amplifies rounding (a contracting loop run backwards expands it)"
            )
            out = (
                "Ways out: on_drift='repair' (the default: recompute the segments that "
                "miss), checkpoint_every=K (drift grows over K steps, not the loop), a "
                "looser drift_rtol, or on_drift='warn' / 'ignore'."
            )
        return (
            f"jaxrev.reversible({self.name}): {compared.what}{where} {miss}: {why}.{extra}\n{out}"
        )

    def error(self, drift_ratio: Any, index: Any) -> Exception | None:
        """The error of comparison `index` where `drift_ratio` is a miss (None otherwise, or
        after warning under on_drift="warn")."""
        drift_ratio, index = float(np.asarray(drift_ratio)), int(np.asarray(index))
        if not drift_ratio > 1.0 and not math.isnan(drift_ratio):
            return None
        msg = self.message(drift_ratio, index)
        if self.dial.on_drift == "warn":
            warnings.warn(msg, DriftWarning, stacklevel=2)
            return None
        compared = self.sites[index] if 0 <= index < len(self.sites) else None
        if compared is not None and compared.gradient:  # in the gradient's units
            return DriftError(msg, file=compared.where, drift=drift_ratio, tolerance=1.0)
        return DriftError(
            msg,
            file=compared.where if compared else None,
            drift=drift_ratio * (compared.tol if compared else 1.0),
            tolerance=compared.tol if compared else None,
        )

    def finish(self, worst: tuple[Any, Any], cts: list[Any]) -> list[Any]:
        """Act on the worst comparison: the cotangents `cts` come back unchanged, or NaN
        (`on_drift="nan"`) where it missed."""
        drift_ratio, index = worst
        mode = self.dial.on_drift
        if mode == "ignore":
            return cts
        if mode == "nan":
            bad = ~(drift_ratio <= 1.0)
            return [
                ct
                if ct is None or not jnp.issubdtype(jnp.result_type(ct), jnp.inexact)
                else where(bad, jnp.nan, ct)
                for ct in cts
            ]
        if is_concrete(drift_ratio) and is_concrete(index):
            err = self.error(drift_ratio, index)
            if err is not None:
                raise err
            return cts
        check_at_run_time(self.error, drift_ratio, index, bad=~(drift_ratio <= 1.0))
        return cts


def log_for(dial: Any, name: str, loops: str = "") -> Log | None:
    """The log of one backward run's comparisons (None when the dial asks for none)."""
    return Log(dial, name, loops) if dial.checks else None


def site(
    log: Log | None, what: str, eqn: Any, tol: float, inputs: bool = False, gradient: bool = False
) -> int:
    """Register a comparison of the backward run whose log is `log`; its index (-1 when no
    run checks: a planning walk, on_drift="ignore")."""
    if log is None:
        return -1
    where = user_source(eqn)[2] if eqn is not None else ""
    log.sites.append(Site(what, where or "", tol, inputs, gradient))
    return len(log.sites) - 1


def tally(
    log: Log | None, eqn: Any, iterations: int, K: int, repaired: Any, recomputed: Any
) -> None:
    """Record what a checkpointed loop's backward run repaired, where the report can read
    it: a top-level loop's counts (a nested loop's are values of its outer loop's body)."""
    if log is None or log.dial.report is None or len(log.scopes) != 1:
        return
    where = user_source(eqn)[2] or ""
    segments = -(-iterations // K)
    log.tallies.append(LoopRepair(where, iterations, K, segments, repaired, recomputed))


def send_report(log: Log | None) -> None:
    """Hand the run's `RepairReport` to the dial's `report` callback when the program runs
    (a `jax.debug.callback`; eagerly at once)."""
    if log is None or log.dial.report is None:
        return
    loops, name, callback = tuple(log.tallies), log.dial.name, log.dial.report

    def on_host(counts):
        callback(
            RepairReport(
                name,
                tuple(
                    loop._replace(repaired=np.asarray(r), recomputed=np.asarray(c))
                    for loop, (r, c) in zip(loops, counts)
                ),
            )
        )

    jax.debug.callback(on_host, [(loop.repaired, loop.recomputed) for loop in loops])


def note(log: Log | None, pair: tuple[Any, Any]) -> None:
    """Add a `(ratio, site)` pair to the innermost scope of `log` (nothing when None)."""
    if log is not None:
        log.scopes[-1].append(pair)


class _Scope:
    def __init__(self, entries: list) -> None:
        self.entries = entries

    def worst(self) -> tuple[Any, Any] | None:
        """The worst pair noted, None where nothing was compared."""
        worst = None
        for pair in self.entries:
            worst = combine(worst, pair)
        return worst


@contextlib.contextmanager
def scope(log: Log | None) -> Iterator[_Scope]:
    """Collect the pairs noted inside (a loop body's walk, traced inside the loop): their worst
    leaves the loop in its carry."""
    entries: list = []
    if log is not None:
        log.scopes.append(entries)
    try:
        yield _Scope(entries)
    finally:
        if log is not None:
            log.scopes.pop()


def describe_loops(eqns: Sequence[Any], is_loop: Any) -> str:
    """The program's loops, for the message about its rebuilt inputs."""
    out = []
    for eqn in eqns:
        if is_loop(eqn):
            out.append(f"`{eqn.primitive.name}` at {user_source(eqn)[2]}")
    if not out:
        return ""
    return (
        "Its loops (a while loop is checkpointed with max_steps=N): "
        + "; ".join(out[:4])
        + ("; ..." if len(out) > 4 else "")
    )


# --------------------------------------------------------------------------- segments
