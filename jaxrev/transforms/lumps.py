"""Lump structure: find a linear lump's sparsity, get its entries by coloured JVPs, and solve it
with the cheapest structure it admits (DESIGN.md §3.4).

A lump is a group of equations invertible only together; inside `reverse` (and so inside the
tangent programs that `inverse_jvp` inverts) an affine lump ``F(u) = A u + c`` is solved for
`u`. Elementwise lumps are solved per element by `reverse` itself. For the others this module:

1. finds the sparsity pattern of `A` by evaluating the lump once on concrete stand-ins (the
   known values themselves where they are concrete, random numbers for traced floats), at
   trace time. Integer or boolean values that are only known at run time (an index, a
   predicate) could change the pattern, so the lump stays dense then;
2. if `A` is banded and triangular (lower or upper, after no reordering), gets its entries from
   `bandwidth + 1` JVPs with coloured seeds and solves by substitution in O(n · bandwidth),
   checking every pivot;
3. otherwise leaves it to the dense solve (n JVPs and an LU): one lump of size n.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["band_of", "probe_pattern", "banded_triangular_solve", "MIN_STRUCTURED_SIZE"]

MIN_STRUCTURED_SIZE = 64
"""Below this size a dense solve is as cheap as finding structure."""

MAX_PROBE_SIZE = 8192
"""Above this size the pattern probe (an n x n evaluation) is too big; the lump stays dense."""


def probe_pattern(F_probe: Callable[[Any], Any], n: int, dtype: Any) -> np.ndarray | None:
    """Boolean n x n pattern of the affine map `F_probe` (all of whose captured values are
    concrete), or None when it cannot be evaluated concretely."""
    if n > MAX_PROBE_SIZE:
        return None
    try:
        with jax.ensure_compile_time_eval():
            J = jax.jacfwd(F_probe)(jnp.zeros(n, dtype))
            J = np.asarray(J)
    except jax.errors.ConcretizationTypeError:
        return None
    return J != 0


def band_of(pattern: np.ndarray) -> tuple[int, int]:
    """(lower, upper) bandwidth of a square boolean pattern."""
    i, j = np.nonzero(pattern)
    if i.size == 0:
        return 0, 0
    d = i - j
    return int(max(d.max(), 0)), int(max((-d).max(), 0))


def banded_triangular_solve(F: Callable[[Any], Any], n: int, b: int, lower: bool, r: Any,
                            dtype: Any) -> tuple[Any, Any]:
    """Solve ``A u = r`` for a triangular `A` of bandwidth `b` given as the linear part of the
    affine `F` (``A v = F(v) - F(0)``). Returns (u, diagonal of A: the pivots)."""
    w = b + 1
    cols = np.arange(n)
    seeds = jnp.asarray(np.stack([(cols % w == c) for c in range(w)]).astype(np.dtype(dtype)))
    f0 = F(jnp.zeros(n, dtype))
    Y = jax.vmap(lambda s: F(s) - f0)(seeds)  # (w, n): Y[c, i] = sum_{j % w == c} A[i, j]
    rows = np.arange(n)
    # band[i, k] = A[i, i - k] (lower) or A[i, i + k] (upper), k = 0..b; out of range -> 0
    ks = np.arange(w)
    js = rows[:, None] - ks[None, :] if lower else rows[:, None] + ks[None, :]
    valid = (js >= 0) & (js < n)
    band = jnp.where(jnp.asarray(valid), Y[np.mod(js, w), rows[:, None]], 0.0)
    diag = band[:, 0]
    if not lower:  # substitute from the last row up: flip to a lower-triangular system
        band, r = band[::-1], r[::-1]

    # u_i = (r_i - sum_k band[i, k] u_{i-k}) / band[i, 0] is a linear recurrence on the window
    # s_i = (u_i, ..., u_{i-b+1}): s_i = M_i s_{i-1} + c_i e_1. Affine maps compose
    # associatively, so a parallel prefix (log n depth) replaces n sequential steps.
    if b == 0:
        u = r / band[:, 0]
    else:
        piv = band[:, 0]
        top = -band[:, 1:] / piv[:, None]                      # (n, b): first row of M_i
        shift = jnp.broadcast_to(jnp.eye(b, b, -1, dtype=dtype), (n, b, b))
        M = shift.at[:, 0, :].set(top)
        c = jnp.zeros((n, b), dtype).at[:, 0].set(r / piv)

        def compose(a, z):  # z after a
            Ma, ca = a
            Mz, cz = z
            return Mz @ Ma, jnp.einsum("...ij,...j->...i", Mz, ca) + cz

        _, s = lax.associative_scan(compose, (M, c))
        u = s[:, 0]
    return (u if lower else u[::-1]), diag
