"""Which branches of a group's choices can hold together (docs/design.md §3.5): intervals of one
value.

A branch of a choice between a value and a static scalar holds on an interval of the value
(relu's zero where x < 0; the true case of a select on ``(x >= a) & (x <= b)`` where
a ≤ x ≤ b). Combinations whose intervals for one value do not meet are never taken, so
`choices` neither tries nor refuses them: flowjax's spline clips `x` to its interval and then
selects on ``in_bounds``, and under the in-bounds case the clip's saturated branches are
unreachable. Intervals are carried back through additions of static scalars and copies.

A `max`/`min` with a constant holds both branches at the tie, where they give the same value;
the constant's branch is given the open interval, so that a combination reachable only at the
tie is left to the value's branch (which is invertible there).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrev._compat import JaxprEqn, prims
from jaxrev._env import Env
from jaxrev._graph import is_var

__all__ = ["constraints", "reachable", "decided_on", "int_range"]

Interval = tuple[float, bool, float, bool]
"""(lo, lo_closed, hi, hi_closed)."""

_CMP = MappingProxyType({"gt": (1, False), "ge": (1, True), "lt": (-1, False), "le": (-1, True)})
_INF = np.inf


def constraints(
    e: JaxprEqn, k: int, producer: dict, env: Env, combo: dict | None = None
) -> list[tuple[Any, Interval]]:
    """``[(value, interval), ...]`` that hold where choice `e` takes branch `k`, each value
    carried back to the variable it shifts, or through the branches `combo` assumes (a clip's
    `min` of a `max`), to a static scalar (value None, the interval then holding it or
    empty); empty where nothing is known."""
    p = e.primitive
    raw: list[tuple[Any, Interval]] = []
    if p is prims.abs:
        raw = [(e.invars[0], (0.0, True, _INF, False) if k == 0 else (-_INF, False, 0.0, False))]
    elif p is prims.sign:
        raw = [
            (
                e.invars[0],
                ((-_INF, False, 0.0, False), (0.0, True, 0.0, True), (0.0, False, _INF, False))[k],
            )
        ]
    elif p in (prims.max, prims.min):
        got = _minmax(e, k, env)
        raw = [got] if got is not None else []
    elif p is prims.select_n and len(e.invars) == 3 and is_var(e.invars[0]):
        raw = _truth(e.invars[0], k == 1, producer, env, 8)
    return [_shifted(v, iv, producer, env, combo or {}) for v, iv in raw]


def _minmax(e: JaxprEqn, k: int, env: Env) -> tuple[Any, Interval] | None:
    a, b = e.invars
    c, first = _scalar(b, env), True
    if c is None:
        c, first = _scalar(a, env), False
        if c is None:
            return None
        a = b
    value_branch = k == (0 if first else 1)
    above = (e.primitive is prims.max) == value_branch  # where the value lies against c
    # (the value's branch holds at the tie, closed; the constant's branch is open there)
    return a, ((c, value_branch, _INF, False) if above else (-_INF, False, c, value_branch))


def _truth(v: Any, truth: bool, producer: dict, env: Env, depth: int) -> list[tuple[Any, Interval]]:
    """Intervals that hold where the boolean `v` is `truth` (comparisons with static scalars,
    through `and`/`or`/`not` and casts to bool)."""
    e = producer.get(v)
    if e is None or depth == 0:
        return []
    name = e.primitive.name
    if (
        name == "convert_element_type"
        and len(e.invars) == 1
        and is_var(e.invars[0])
        and e.invars[0].aval.dtype == np.bool_
    ):
        return _truth(e.invars[0], truth, producer, env, depth - 1)
    if name == "not":
        return (
            _truth(e.invars[0], not truth, producer, env, depth - 1) if is_var(e.invars[0]) else []
        )
    if (name == "and" and truth) or (name == "or" and not truth):
        return [
            c for u in e.invars if is_var(u) for c in _truth(u, truth, producer, env, depth - 1)
        ]
    if name not in _CMP:
        return []
    a, b = e.invars
    sign, closed = _CMP[name]
    c = _scalar(b, env)
    if c is None:
        a, c, sign = b, _scalar(a, env), -sign
        if c is None or not is_var(a):
            return []
    if not truth:  # the comparison is false
        sign, closed = -sign, not closed
    return [(a, (c, closed, _INF, False) if sign > 0 else (-_INF, False, c, closed))]


def _scalar(v: Any, env: Env) -> float | None:
    s = env.info.static(v)
    if s is None or np.size(s) != 1:
        return None
    return float(np.asarray(s).reshape(()))


def _shifted(v: Any, iv: Interval, producer: dict, env: Env, combo: dict) -> tuple[Any, Interval]:
    """The interval carried back through additions and products of static scalars, negation,
    copies and the branches `combo` assumes."""
    lo, lc, hi, hc = iv
    for _ in range(16):
        e = producer.get(v)
        if e is None:
            break
        if e in combo and e.primitive in (prims.max, prims.min):
            u = e.invars[combo[e][1]]
            c = _scalar(u, env)
            if c is not None:  # the branch is a constant: in the interval, or never
                inside = (lo < c or (lo == c and lc)) and (c < hi or (c == hi and hc))
                return None, ((c, True, c, True) if inside else (1.0, False, 0.0, False))
            v = u
            continue
        if e.primitive in (prims.max, prims.min) and len(e.invars) == 2:
            # not assumed: where its constant is outside the interval, the value is inside
            got = _const_and_value(e, env)
            if got is not None:
                c, u = got
                inside = (lo < c or (lo == c and lc)) and (c < hi or (c == hi and hc))
                if not inside:
                    v = u
                    continue
        if e.primitive in (prims.copy, prims.convert_element_type) and len(e.invars) == 1:
            v = e.invars[0]
            continue
        if e.primitive in (prims.mul, prims.div) and len(e.invars) == 2:
            # v = u * c (or u / c, c * u) with a static non-zero scalar c
            c = _scalar(e.invars[1], env)
            u = e.invars[0]
            if c is None and e.primitive is prims.mul:
                c, u = _scalar(e.invars[0], env), e.invars[1]
            if c is not None and c != 0 and is_var(u):
                f = c if e.primitive is prims.mul else 1.0 / c
                a, b = lo / f, hi / f
                lo, lc, hi, hc = (a, lc, b, hc) if f > 0 else (b, hc, a, lc)
                v = u
                continue
        if e.primitive is prims.neg:
            lo, lc, hi, hc, v = -hi, hc, -lo, lc, e.invars[0]
            continue
        if e.primitive in (prims.add, prims.sub) and len(e.invars) == 2:
            c = _scalar(e.invars[1], env)
            if c is not None and is_var(e.invars[0]):
                d = c if e.primitive is prims.add else -c  # v = u + d
                lo, hi, v = lo - d, hi - d, e.invars[0]
                continue
        break
    return v, (lo, lc, hi, hc)


def _const_and_value(e: JaxprEqn, env: Env) -> tuple[float, Any] | None:
    a, b = e.invars
    c = _scalar(b, env)
    if c is not None and is_var(a):
        return c, a
    c = _scalar(a, env)
    return (c, b) if c is not None and is_var(b) else None


def reachable(combo: dict, producer: dict, env: Env) -> bool:
    """Whether the (partial) combination ``{eqn: (choice, k)}`` can hold: the intervals its
    branches put on each value meet."""
    bounds: dict = {}
    for e, (c, k) in combo.items():
        if c.value is not None:
            continue
        for v, (nlo, nlc, nhi, nhc) in constraints(e, k, producer, env, combo):
            if v is None and (nlo > nhi or (nlo == nhi and not (nlc and nhc))):
                return False
            if v is None:
                continue
            lo, lc, hi, hc = bounds.get(v, (-_INF, False, _INF, False))
            if nlo > lo or (nlo == lo and not nlc):
                lo, lc = nlo, nlc
            if nhi < hi or (nhi == hi and not nhc):
                hi, hc = nhi, nhc
            if lo > hi or (lo == hi and not (lc and hc)):
                return False
            bounds[v] = (lo, lc, hi, hc)
    return True


def decided_on(e: JaxprEqn, k: int, producer: dict, env: Env, values: set, combo: dict) -> bool:
    """Whether branch `k` of `e` is taken on an interval of one of `values` (the group's
    unknown inputs: the state itself), so that inputs surely take it."""
    return any(v in values for v, _ in constraints(e, k, producer, env, combo))


# --------------------------------------------------------------------------- integers


def int_range(v: Any, producer: dict, env: Env, memo: dict) -> tuple[float, float] | None:
    """The values an integer may take, by interval arithmetic over the group's equations
    (`producer`; None: any): a bin index the state computes takes a few."""
    if v in memo:
        return memo[v]
    memo[v] = None
    s = env.info.static(v)
    if s is not None:
        out = (float(np.min(s)), float(np.max(s))) if np.size(s) else None
    elif v.aval.dtype == jnp.bool_:
        out = (0.0, 1.0)
    else:
        out = _range_of_eqn(producer.get(v), producer, env, memo)
    memo[v] = out
    return out


def _range_of_eqn(
    e: JaxprEqn | None, producer: dict, env: Env, memo: dict
) -> tuple[float, float] | None:
    if e is None:
        return None
    p = e.primitive

    def r(k: int) -> tuple[float, float]:
        got = (
            int_range(e.invars[k], producer, env, memo)
            if is_var(e.invars[k])
            else (float(np.asarray(e.invars[k].val)),) * 2
        )
        return got if got is not None else (-np.inf, np.inf)

    if p is prims.convert_element_type:
        return r(0)
    if p in (prims.max, prims.min):
        (a0, a1), (b0, b1) = r(0), r(1)
        f = max if p is prims.max else min
        return (f(a0, b0), f(a1, b1))
    if p in (prims.add, prims.sub):
        (a0, a1), (b0, b1) = r(0), r(1)
        return (a0 + b0, a1 + b1) if p is prims.add else (a0 - b1, a1 - b0)
    if p is prims.select_n:
        rs = [r(k) for k in range(1, len(e.invars))]
        return (min(x[0] for x in rs), max(x[1] for x in rs))
    if p.name == "clamp":
        return (max(r(0)[0], r(1)[0]), min(r(2)[1], r(1)[1]))
    if p.name in ("argmax", "argmin"):
        return (0.0, float(e.invars[0].aval.shape[e.params["axes"][0]] - 1))
    if p is prims.reduce_sum:
        n = int(np.prod([e.invars[0].aval.shape[a] for a in e.params["axes"]]))
        lo, hi = r(0)
        return (min(n * lo, lo), max(n * hi, hi))
    return None
