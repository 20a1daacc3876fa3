"""Families of masked-step programs, k steps each, for the tracing-cost guarantee of issue 28:
every family traces in time linear in k, for every transform (docs/design.md §3.5;
`tests/test_tracing_cost.py` counts rule applications, `benchmarks/tracing.py` times them).

Each step is a coupling `a2 = a + tanh(P b); b2 = b + sin(Q a2)` masked as diffrax masks its
steps, ``a, b = where(keep, a2, a), where(keep, b2, b)``; the families differ in what moves
elements between the halves (`P`, `Q`: nothing, a reversal, a roll, a gather by a fixed
permutation) and in where `keep` comes from (one predicate shared by every step, a predicate
per step from a scalar parameter, a predicate per step computed from a time array as diffrax
computes `t < t1`, or the steps run by `lax.scan`). None of the predicates depends on the
state, so no walk needs to split on them.

`family(name, k, n)` returns ``(f, state, params)`` with ``f(state, params) -> state``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FAMILIES = ("shared", "per_step", "reversal", "roll", "permutation", "time_array", "scan")


def _moves(kind: str, n: int) -> tuple[Callable, Callable]:
    """(P, Q) of the coupling: how elements move between the halves."""
    if kind == "reversal":
        return (lambda v: v[::-1]), (lambda v: v[::-1])
    if kind == "roll":
        return (lambda v: jnp.roll(v, 1)), (lambda v: jnp.roll(v, -2))
    if kind == "permutation":
        perm = np.random.default_rng(0).permutation(n)
        return (lambda v: v[perm]), (lambda v: v[np.argsort(perm)])
    return (lambda v: v), (lambda v: v)


def _step(a, b, keep, P, Q):
    a2 = a + jnp.tanh(P(b))
    b2 = b + jnp.sin(Q(a2))
    return jnp.where(keep, a2, a), jnp.where(keep, b2, b)


def family(name: str, k: int, n: int = 16) -> tuple[Callable, tuple, dict]:
    state = (jnp.linspace(-1.0, 1.0, n), jnp.linspace(0.3, 1.2, n))
    moves = {
        "shared": "none",
        "per_step": "none",
        "time_array": "reversal",
        "scan": "reversal",
    }.get(name, name)
    P, Q = _moves(moves, n)
    # a time that stops the masked steps two thirds of the way (some steps kept, some not)
    stop = 2.0 * k / 3.0 + 0.5
    if name == "shared":  # one predicate array for every step (issue 15's program)
        params = {"t": jnp.linspace(0.0, 1.0, n)}

        def f(s, p):
            a, b = s
            keep = p["t"] > 0.5
            for _ in range(k):
                a, b = _step(a, b, keep, P, Q)
            return a, b
    elif name == "time_array":  # diffrax: t_i = t0 + sum(dt), step i kept while t_i < t1
        params = {"dt": jnp.full((k,), 1.0), "t1": jnp.asarray(stop)}

        def f(s, p):
            a, b = s
            ts = jnp.cumsum(p["dt"])
            for i in range(k):
                a, b = _step(a, b, ts[i] < p["t1"], P, Q)
            return a, b
    elif name == "scan":  # the same, the steps run by lax.scan
        params = {"dt": jnp.full((k,), 1.0), "t1": jnp.asarray(stop)}

        def f(s, p):
            def body(c, t):
                a, b = c
                return _step(a, b, t < p["t1"], P, Q), None

            return lax.scan(body, s, jnp.cumsum(p["dt"]))[0]
    else:  # a predicate per step from a scalar parameter
        params = {"t": jnp.asarray(stop)}

        def f(s, p):
            a, b = s
            for i in range(k):
                a, b = _step(a, b, p["t"] > i + 1.0, P, Q)
            return a, b

    return f, state, params


def loss(f: Callable) -> Callable:
    """A scalar of the program's output, to differentiate."""
    return lambda s, p: sum(
        jnp.sum(jnp.sin(v) * (j + 1.0)) for j, v in enumerate(jax.tree_util.tree_leaves(f(s, p)))
    )
