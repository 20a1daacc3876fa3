"""Lump structure: find a linear lump's sparsity, get its entries by coloured JVPs, and solve it
with the cheapest structure it admits (DESIGN.md §3.4).

A lump is a group of equations invertible only together; inside `reverse` (and so inside the
tangent programs that `inverse_jvp` inverts) an affine lump ``F(u) = A u + c`` is solved for
`u`. Elementwise lumps are solved per element by `reverse` itself. For the others this module:

1. finds the band of `A` by JVPs of the lump with the unit vectors, a block at a time, on
   concrete stand-ins (the known values themselves where they are concrete, random numbers for
   traced floats), at trace time. Integer or boolean values that are only known at run time
   (an index, a predicate) could change the pattern, so the lump stays dense then;
2. if `A` is banded and triangular (lower or upper, after no reordering), gets its entries from
   `bandwidth + 1` JVPs with coloured seeds and solves by substitution in O(n · bandwidth),
   checking every pivot;
3. if `A` is banded otherwise, gets its entries from ``lower + upper + 1`` coloured JVPs and
   solves by banded Gaussian elimination with partial pivoting, O(n · bandwidth²), returning
   the pivots and the growth factor;
4. otherwise leaves it to the dense solve (n JVPs and a pivoted LU): one lump of size n.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["probe_band", "band_entries", "banded_triangular_solve", "banded_solve",
           "MIN_STRUCTURED_SIZE"]

MIN_STRUCTURED_SIZE = 64
"""Below this size a dense solve is as cheap as finding structure."""

MAX_PROBE_SIZE = 32768
"""Above this size the pattern probe (n JVPs of the lump, O(n²) work at trace time) is too
costly; the lump stays dense."""

_PROBE_BLOCK = 512
"""Columns probed at once: the probe holds n x _PROBE_BLOCK numbers, never the n x n pattern."""


def probe_band(F_probe: Callable[[Any], Any], n: int, dtype: Any) -> tuple[int, int] | None:
    """(lower, upper) bandwidth of the affine map `F_probe` (all of whose captured values are
    concrete), from JVPs with the unit vectors, a block of columns at a time; None when it
    cannot be evaluated concretely or is too big."""
    if n > MAX_PROBE_SIZE:
        return None
    zero = jnp.zeros(n, dtype)
    cols = min(n, _PROBE_BLOCK)

    # one compiled program for every block: op-by-op evaluation would compile each op
    @jax.jit
    def block(start):
        basis = (jnp.arange(n)[None, :] == start + jnp.arange(cols)[:, None]).astype(dtype)
        return jax.vmap(lambda e: jax.jvp(F_probe, (zero,), (e,))[1])(basis)
    lo = up = 0
    try:
        with jax.ensure_compile_time_eval():
            for start in range(0, n, cols):
                Y = np.asarray(block(start)) != 0   # Y[c, i] = A[i, start + c]
                c, i = np.nonzero(Y)
                if c.size:
                    d = i - (start + c)
                    lo, up = max(lo, int(d.max())), max(up, int((-d).max()))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None
    return lo, up


def band_entries(F: Callable[[Any], Any], n: int, lo: int, up: int, dtype: Any) -> Any:
    """The band of the matrix `A` of the affine `F` (``A v = F(v) - F(0)``), with `lo` sub-
    and `up` superdiagonals, from ``lo + up + 1`` JVPs with coloured seeds:
    ``band[i, c] = A[i, i - lo + c]`` (0 outside the matrix)."""
    w = lo + up + 1
    cols = np.arange(n)
    seeds = jnp.asarray(np.stack([(cols % w == c) for c in range(w)]).astype(np.dtype(dtype)))
    f0 = F(jnp.zeros(n, dtype))
    # columns of one colour are w apart, so within a row of bandwidth < w at most one of them
    # is non-zero: Y[c, i] = A[i, j] for the j in row i's band with j % w == c
    Y = jax.vmap(lambda s: F(s) - f0)(seeds)
    js = cols[:, None] - lo + np.arange(w)[None, :]
    valid = (js >= 0) & (js < n)
    return jnp.where(jnp.asarray(valid), Y[np.mod(js, w), cols[:, None]], 0.0)


# the kernels are jitted: run eagerly (concrete values), op-by-op dispatch of an associative
# scan or an n-step elimination would compile hundreds of tiny programs
@partial(jax.jit, static_argnames=("lower",))
def _substitute(band: Any, r: Any, lower: bool) -> Any:
    """Solve a triangular banded system: `band[i, k]` is ``A[i, i - k]`` (lower) or
    ``A[i, i + k]`` (upper), k = 0..b."""
    n, w = band.shape
    b, dtype = w - 1, band.dtype
    if not lower:  # substitute from the last row up: flip to a lower-triangular system
        band, r = band[::-1], r[::-1]
    piv = band[:, 0]
    if b == 0:
        u = r / piv
    else:
        # u_i = (r_i - sum_k band[i, k] u_{i-k}) / band[i, 0] is a linear recurrence on the
        # window s_i = (u_i, ..., u_{i-b+1}): s_i = M_i s_{i-1} + c_i e_1. Affine maps compose
        # associatively, so a parallel prefix (log n depth) replaces n sequential steps.
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
    return u if lower else u[::-1]


def banded_triangular_solve(F: Callable[[Any], Any], n: int, b: int, lower: bool, r: Any,
                            dtype: Any) -> tuple[Any, Any]:
    """Solve ``A u = r`` for a triangular `A` of bandwidth `b` given as the linear part of the
    affine `F` (``A v = F(v) - F(0)``). Returns (u, diagonal of A: the pivots)."""
    band = band_entries(F, n, b if lower else 0, 0 if lower else b, dtype)
    if lower:  # band[i, c] = A[i, i - b + c]: reverse the columns to count k = i - j
        band = band[:, ::-1]
    return _substitute(band, r, lower), band[:, 0]


def banded_solve(F: Callable[[Any], Any], n: int, lo: int, up: int, r: Any,
                 dtype: Any) -> tuple[Any, Any, Any]:
    """Solve ``A u = r`` for a banded `A` (`lo` sub-, `up` superdiagonals) given as the linear
    part of the affine `F`: entries by ``lo + up + 1`` coloured JVPs, then Gaussian
    elimination with partial pivoting inside the band (LAPACK's ``gbsv`` scheme: row swaps
    widen U to ``lo + up`` superdiagonals) and banded back substitution. O(n (lo + up) lo).

    Returns (u, the pivots (U's diagonal), the growth factor max|U| / max|A|)."""
    band = band_entries(F, n, lo, up, dtype)
    U, y = _eliminate(band, jnp.asarray(r, dtype), lo)
    growth = jnp.max(jnp.abs(U)) / jnp.max(jnp.abs(band))
    # U[k, c] = U_full[k, k + c]: upper triangular with lo + up superdiagonals
    return _substitute(U, y, False), U[:, 0], growth


@partial(jax.jit, static_argnames=("lo",))
def _eliminate(band: Any, r: Any, lo: int) -> tuple[Any, Any]:
    """Banded LU with partial pivoting applied to `r`: (U's band rows, L⁻¹Pr)."""
    n, w = band.shape
    dtype = band.dtype
    # the active window at step k: rows k..k+lo, columns k..k+lo+up. Row i enters the window
    # when its first band column i-lo becomes the window's first column, so band rows slot in
    # unshifted; the first lo+1 rows are placed by hand.
    rows0 = np.arange(lo + 1)[:, None]
    cs = np.arange(w)[None, :] - rows0 + lo                 # band column of window column
    ok = (cs >= 0) & (cs < w) & (rows0 < n)
    W0 = jnp.where(jnp.asarray(ok), band[np.minimum(rows0, n - 1), np.clip(cs, 0, w - 1)], 0.0)
    r0 = jnp.where(jnp.asarray(np.arange(lo + 1) < n), r[np.minimum(np.arange(lo + 1), n - 1)],
                   0.0)
    nxt_rows = jnp.concatenate([band, jnp.zeros((lo + 1, w), dtype)])[lo + 1:lo + 1 + n]
    nxt_r = jnp.concatenate([r, jnp.zeros(lo + 1, dtype)])[lo + 1:lo + 1 + n]

    def step(carry, nxt):
        W, rw = carry
        row_in, r_in = nxt
        if lo:
            p = jnp.argmax(jnp.abs(W[:, 0]))
            perm = jnp.arange(lo + 1).at[0].set(p).at[p].set(0)
            W, rw = W[perm], rw[perm]
            mult = W[1:, 0] / W[0, 0]
            W = W.at[1:].add(-mult[:, None] * W[0][None, :])
            rw = rw.at[1:].add(-mult * rw[0])
        out = (W[0], rw[0])
        W = jnp.concatenate([jnp.pad(W[1:, 1:], ((0, 0), (0, 1))), row_in[None]], 0)
        rw = jnp.concatenate([rw[1:], r_in[None]])
        return (W, rw), out

    _, (U, y) = lax.scan(step, (W0, r0), (nxt_rows, nxt_r))
    return U, y
