"""How the backward run adds a value's cotangents: one at a time where they are large.

A weight that a loop body reads in k places (a Runge–Kutta step's 2 x 6 evaluations of an MLP
field) gets k cotangents per iteration. Written as a chain of additions, XLA:CPU fuses the
chain into one loop over all k terms, which holds every term at once: 12 x 32 KB of a 64 x 64
float64 weight in the reversible ODE solve, whose whole scratch was 0.71 MB (0.37 MB with the
terms added one at a time). An `optimization_barrier` does not stop the fusion (XLA:CPU
removes barriers before it fuses); a conditional does. `summed_apart` is that sum; the fused
backward step adds with it (`backward.acc`), and the repairing dial's VJP of the body
(`segments.body_redo`) is evaluated with JAX's own sums (`add_any`) replaced by it
(`pulled_back`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import JaxprEqn, prims, trace_to_closed
from jaxrev._evaluate import eval_closed

__all__ = ["APART_BYTES", "add", "pulled_back", "summed_apart"]

APART_BYTES = 4096
"""Cotangents this large are added to their running sum one at a time (`summed_apart`);
smaller ones in XLA's fused sums, which cost less than a conditional each."""


def summed_apart(total: Any, term: Any) -> Any:
    """``total + term``, kept out of XLA:CPU's fusions: under a conditional whose two branches
    both add (in either order: the same sum, NaN included), so that the predicate, which XLA
    cannot fold, changes nothing. CPU only: elsewhere a conditional may wait for its
    predicate on the host, and the plain sum is kept.

    Example:
        >>> import jax.numpy as jnp
        >>> summed_apart(jnp.ones(3), jnp.ones(3)).tolist()
        [2.0, 2.0, 2.0]
    """

    def on_cpu(total: Any, term: Any) -> Any:
        first = jnp.ravel(term)[0]
        return jax.lax.cond(first == first, jnp.add, lambda a, b: b + a, total, term)

    return jax.lax.platform_dependent(total, term, cpu=on_cpu, default=jnp.add)


def add(total: Any, term: Any, nth: int) -> Any:
    """``total + term``, where `term` is the `nth` term of the sum (the first is 1):
    `summed_apart` from the third term on where the term holds `APART_BYTES` or more (two
    terms are held at once whichever way they are added)."""
    if nth >= 3 and np.size(term) * np.dtype(jnp.result_type(term)).itemsize >= APART_BYTES:
        return summed_apart(total, term)
    return total + term


def pulled_back(vjp: Callable, cts: Sequence[Any]) -> Any:
    """``vjp(cts)`` (a pullback of `jax.vjp`), its sums of large cotangents (JAX's `add_any`)
    added one at a time from their third term on (`add`)."""
    closed, consts, out_tree = trace_to_closed(vjp, cts)
    # (a sum whose operand is itself a sum adds a third term at least)
    sums = {o for e in closed.jaxpr.eqns if e.primitive is prims.add_any for o in e.outvars}

    def add_any_apart(i: int, eqn: JaxprEqn, ins: list) -> list | None:
        if eqn.primitive is not prims.add_any:
            return None
        return [add(*ins, nth=3 if any(v in sums for v in eqn.invars) else 2)]

    flat = eval_closed(closed, *consts, *jax.tree_util.tree_leaves(cts), rule=add_any_apart)
    return jax.tree_util.tree_unflatten(out_tree, flat)
