"""Linear lumps: find them, find their structure, and solve them with the cheapest structure
they admit (docs/design.md §3.4).

A lump is a group of equations invertible only together; when the walker is stuck,
`lump_step` looks for the smallest trailing group of stuck equations that is square and affine
in its unknowns, ``F(u) = A u + c``, and solves it for `u` (inside `reverse`, and so inside the
tangent programs that `inverse_jvp` inverts). Elementwise lumps are solved per element, one
k x k block each. For the others this module:

1. finds the band of `A` by JVPs of the lump with the unit vectors, a block at a time, on
   concrete stand-ins (the known values themselves where they are concrete, random numbers for
   traced floats), at trace time. Integer or boolean values that are only known at run time
   (an index, a predicate) could change the pattern, so the lump stays dense then;
2. if `A` is banded and triangular (lower or upper, after no reordering), gets its entries from
   `bandwidth + 1` JVPs with coloured seeds and solves by substitution in O(n · bandwidth),
   checking every pivot;
3. if `A` is banded otherwise, gets its entries from ``lower + upper + 1`` coloured JVPs and
   solves by banded Gaussian elimination with partial pivoting, O(n · bandwidth²), returning
   the pivots and the growth factor; a tridiagonal `A` (a chained Rosenbrock's Hessian, a
   discretised Laplacian) by the same elimination in one LAPACK / cuSPARSE call;
4. otherwise leaves it to the dense solve (n JVPs and a pivoted LU): one lump of size n.

Before 2 and 3, the probe also finds whether `A`'s rows and columns fall into small
independent blocks once reordered (the connected components of its pattern): strided slices
read in and pads summed out make permutations of small coupled groups, whose band is as wide
as the lump. Their entries come from one JVP per position within a block, and a batched
elimination and a gather solve them in O(n · size²).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxrev._dense as dense
from jaxrev._compat import JaxprEqn, Var, compiled_eqns, is_concrete, prims, staged_constants
from jaxrev._env import Env
from jaxrev._errors import not_invertible
from jaxrev._evaluate import evaluate
from jaxrev._graph import real_outvars, size_of
from jaxrev.transforms.knowledge import records
from jaxrev.transforms.registry import BILINEAR, LINEAR, Unsupported, elementwise_in, is_kind

__all__ = [
    "lump_step",
    "Lump",
    "affine_eqn",
    "stand_ins",
    "singular_on_stand_ins",
    "probe_band",
    "probe_pattern",
    "Pattern",
    "Blocks",
    "block_solve",
    "blocks_slogdet",
    "permutation_sign",
    "band_entries",
    "banded_triangular_solve",
    "banded_solve",
    "tridiagonal_solve",
    "slogdet_of",
    "MIN_STRUCTURED_SIZE",
]

MIN_STRUCTURED_SIZE = 64
"""Below this size a dense solve is as cheap as finding structure."""

MAX_PROBE_SIZE = 32768
"""Above this size the pattern probe (n JVPs of the lump, O(n²) work at trace time) is too
costly; the lump stays dense."""

_PROBE_BLOCK = 512
"""Columns probed at once: the probe holds n x _PROBE_BLOCK numbers, never the n x n pattern."""


MAX_BLOCK = 16
"""The largest independent block a lump's matrix may fall into for `block_solve`."""


class Blocks(NamedTuple):
    """A matrix that is block diagonal once its rows and columns are reordered: block j
    couples rows ``rows[j, :m]`` with columns ``columns[j, :m]`` only (m its size; -1 pads a
    smaller block to the largest). Strided slices read in, pads summed out, concatenations
    and gathers (data movement) around small coupled groups make such matrices: the extended
    Rosenbrock's gradient interleaves its 2 x 2 blocks."""

    rows: np.ndarray  # (blocks, size), -1 past a block's own size
    columns: np.ndarray  # (blocks, size), -1 past a block's own size


class Pattern(NamedTuple):
    """The sparsity of an affine map's matrix `A`, found by `probe_pattern`."""

    lower: int  # sub-diagonals
    upper: int  # super-diagonals
    blocks: Blocks | None  # its independent blocks, when none is larger than MAX_BLOCK


def probe_pattern(F_probe: Callable[[Any], Any], n: int, dtype: Any) -> Pattern | None:
    """The band of the affine map `F_probe` (all of whose captured values are concrete), and
    its independent blocks, from JVPs with the unit vectors, a block of columns at a time;
    None when it cannot be evaluated concretely or is too big."""
    if n > MAX_PROBE_SIZE:
        return None
    zero = np.zeros(n, dtype)
    cols = min(n, _PROBE_BLOCK)

    # one compiled program for every block: op-by-op evaluation would compile each op
    @jax.jit
    def block(start):
        basis = (jnp.arange(n)[None, :] == start + jnp.arange(cols)[:, None]).astype(dtype)
        return jax.vmap(lambda e: jax.jvp(F_probe, (zero,), (e,))[1])(basis)

    lo = up = 0
    rows_seen: list[np.ndarray] = []
    columns_seen: list[np.ndarray] = []
    try:
        with jax.ensure_compile_time_eval():
            for start in range(0, n, cols):
                Y = np.asarray(block(start))[: n - start] != 0  # Y[c, i] = A[i, start + c]
                c, i = np.nonzero(Y)
                if c.size:
                    d = i - (start + c)
                    lo, up = max(lo, int(d.max())), max(up, int((-d).max()))
                    # (the entries are kept only while they can still form small blocks)
                    if rows_seen is not None and c.size <= MAX_BLOCK * n:
                        rows_seen.append(i)
                        columns_seen.append(start + c)
                    else:
                        rows_seen = None
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None
    blocks = None
    if rows_seen is not None and rows_seen:
        blocks = _independent_blocks(np.concatenate(rows_seen), np.concatenate(columns_seen), n)
    return Pattern(lo, up, blocks)


def _independent_blocks(rows: np.ndarray, columns: np.ndarray, n: int) -> Blocks | None:
    """The connected components of the bipartite graph of rows and columns joined by the
    entries, as `Blocks`; None when one is larger than `MAX_BLOCK` or not square (the matrix
    is then singular, left to the solve that names it)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    # nodes 0..n-1 are the rows, n..2n-1 the columns
    graph = coo_matrix((np.ones(rows.size, np.int8), (rows, n + columns)), shape=(2 * n, 2 * n))
    _, label = connected_components(graph, directed=False)
    row_label, column_label = label[:n], label[n:]
    order_r, order_c = np.argsort(row_label, kind="stable"), np.argsort(column_label, kind="stable")
    names, start_r, size_r = np.unique(row_label[order_r], return_index=True, return_counts=True)
    names_c, _, size_c = np.unique(column_label[order_c], return_index=True, return_counts=True)
    if not (np.array_equal(names, names_c) and np.array_equal(size_r, size_c)):
        return None
    size = int(size_r.max())
    if size > MAX_BLOCK:
        return None
    # the k-th row (column) of each block, -1 past its size
    within = np.arange(n) - np.repeat(start_r, size_r)
    block_of = np.repeat(np.arange(names.size), size_r)
    block_rows = np.full((names.size, size), -1, np.int64)
    block_columns = np.full((names.size, size), -1, np.int64)
    block_rows[block_of, within] = order_r
    block_columns[block_of, within] = order_c  # (the blocks' sizes agree: same positions)
    return Blocks(block_rows, block_columns)


def probe_band(F_probe: Callable[[Any], Any], n: int, dtype: Any) -> tuple[int, int] | None:
    """(lower, upper) bandwidth of the affine map `F_probe` (`probe_pattern`'s band)."""
    pattern = probe_pattern(F_probe, n, dtype)
    return None if pattern is None else (pattern.lower, pattern.upper)


def _linear_part(F: Callable[[Any], Any], seeds: Any, n: int, dtype: Any) -> Any:
    """``A s`` for each row `s` of `seeds`, `A` the matrix of the affine `F`: its JVP at 0,
    not ``F(s) - F(0)``, which rounds where F's constant part is large (a residual
    ``x + u t`` with a large ``u t``) and which XLA cannot fold where `A` is constant (the
    identity of a torn planar layer's affine part: its log-det is then a constant 0)."""
    zero = jnp.zeros(n, dtype)
    return jax.vmap(lambda s: jax.jvp(F, (zero,), (s,))[1])(seeds)


def block_entries(F: Callable[[Any], Any], n: int, blocks: Blocks, dtype: Any) -> Any:
    """The blocks of the matrix `A` of the affine `F` (``A v = F(v) - F(0)``), from one JVP
    per column position within a block (columns of different blocks share no row), padded
    with the identity past each block's size: ``B[j, a, b] = A[rows[j, a], columns[j, b]]``."""
    size = blocks.rows.shape[1]
    seeds = np.zeros((size, n), np.dtype(dtype))
    for b in range(size):
        live = blocks.columns[:, b] >= 0
        seeds[b, blocks.columns[live, b]] = 1.0
    Y = _linear_part(F, jnp.asarray(seeds), n, dtype)  # Y[b, i]: column b's entries
    live_rows = blocks.rows >= 0
    rows = np.where(live_rows, blocks.rows, 0)
    B = jnp.moveaxis(Y[:, rows], 0, -1)  # (blocks, a, b)
    live = live_rows[:, :, None] & live_rows[:, None, :]
    eye = np.eye(size, dtype=bool)[None]
    return jnp.where(jnp.asarray(live), B, jnp.asarray(eye, B.dtype))


def block_solve(
    F: Callable[[Any], Any], n: int, blocks: Blocks, r: Any, dtype: Any
) -> tuple[Any, Any]:
    """Solve ``A u = r`` for an `A` that falls into independent `blocks`: their entries by
    `block_entries`, one batched LU of the small blocks, then a scatter. O(n · size²).
    Returns (u, each block's pivots: zero where a block is singular)."""
    B = block_entries(F, n, blocks, dtype)
    live = blocks.rows >= 0
    rhs = jnp.where(jnp.asarray(live), jnp.asarray(r, dtype)[np.where(live, blocks.rows, 0)], 0.0)
    x, pivots = _small_solves(B, rhs)
    order = np.argsort(np.where(live, blocks.columns, n).ravel(), kind="stable")[:n]
    return jnp.ravel(x)[order], pivots.ravel()[order]


@jax.jit
def _small_solves(B: Any, r: Any) -> tuple[Any, Any]:
    """Solve the batch of small systems ``B[j] x[j] = r[j]`` by Gaussian elimination with
    partial pivoting, unrolled over the (static, at most `MAX_BLOCK`) size and vectorized
    over the batch: a batched LAPACK LU of 500 2 x 2 blocks took twice a tridiagonal solve
    of the same 1 000 unknowns. Returns (x, the pivots: U's diagonal)."""
    size = B.shape[-1]
    if jnp.issubdtype(B.dtype, jnp.floating) and jnp.finfo(B.dtype).bits < 32:
        x, pivots = _small_solves(B.astype(jnp.float32), r.astype(jnp.float32))
        return x.astype(B.dtype), pivots.astype(B.dtype)
    A = jnp.concatenate([B, r[..., None]], -1)  # the augmented systems
    rows = jnp.arange(size)
    for k in range(size - 1):
        p = k + jnp.argmax(jnp.abs(A[:, k:, k]), axis=-1)  # (batch,)
        swap = (rows[None, :] == k)[..., None] * A[jnp.arange(A.shape[0]), p][:, None, :]
        swap = swap + (rows[None, :] == p[:, None])[..., None] * A[:, k][:, None, :]
        keep = ((rows[None, :] != k) & (rows[None, :] != p[:, None]))[..., None]
        A = jnp.where(keep, A, swap)
        mult = jnp.where(rows[None, :] > k, A[:, :, k] / A[:, k, k][:, None], 0.0)
        A = A - mult[..., None] * A[:, k][:, None, :]
    pivots = jnp.diagonal(A[..., :size], axis1=-2, axis2=-1)
    x = jnp.zeros_like(r)
    for k in reversed(range(size)):
        done = jnp.sum(A[:, k, :size] * x, -1)
        x = x.at[:, k].set((A[:, k, size] - done) / pivots[:, k])
    return x, pivots


def permutation_sign(order: np.ndarray) -> int:
    """The sign (+1 or -1) of the permutation taking position i to ``order[i]``."""
    seen = np.zeros(order.size, bool)
    sign = 1
    for start in range(order.size):
        if seen[start]:
            continue
        length, j = 0, start
        while not seen[j]:
            seen[j], j, length = True, int(order[j]), length + 1
        sign *= -1 if length % 2 == 0 else 1
    return sign


def blocks_slogdet(F: Callable[[Any], Any], n: int, blocks: Blocks, dtype: Any) -> tuple[Any, Any]:
    """(sign, log|det|) of the matrix of the affine `F` that falls into `blocks`: the
    blocks' log-dets, and the signs of the row and column reorderings."""
    sign_b, logdet_b = dense.slogdet(block_entries(F, n, blocks, dtype))
    live = blocks.rows >= 0
    reorder = permutation_sign(blocks.rows[live]) * permutation_sign(blocks.columns[live])
    return reorder * jnp.prod(sign_b), jnp.sum(logdet_b)


def band_entries(F: Callable[[Any], Any], n: int, lo: int, up: int, dtype: Any) -> Any:
    """The band of the matrix `A` of the affine `F` (``A v = F(v) - F(0)``), with `lo` sub-
    and `up` superdiagonals, from ``lo + up + 1`` JVPs with coloured seeds:
    ``band[i, c] = A[i, i - lo + c]`` (0 outside the matrix)."""
    w = lo + up + 1
    cols = np.arange(n)
    seeds = jnp.asarray(np.stack([(cols % w == c) for c in range(w)]).astype(np.dtype(dtype)))
    # columns of one colour are w apart, so within a row of bandwidth < w at most one of them
    # is non-zero: Y[c, i] = A[i, j] for the j in row i's band with j % w == c
    Y = _linear_part(F, seeds, n, dtype)
    js = cols[:, None] - lo + np.arange(w)[None, :]
    valid = (js >= 0) & (js < n)
    return jnp.where(jnp.asarray(valid), Y[np.mod(js, w), cols[:, None]], 0.0)


def slogdet_of(
    F: Callable[[Any], Any],
    x0: Any,
    F_probe: Callable[[Any], Any] | None,
    dense_max: int,
    what: str,
) -> tuple[Any, Any]:
    """(sign, log|det|) of the Jacobian of `F` (vector to vector) at `x0`: dense up to
    `dense_max` unknowns; above, for an affine `F` whose stand-in `F_probe` shows a triangular
    band, the product of the band's diagonal (found by coloured JVPs). Raises
    `Unsupported` otherwise."""
    n = int(np.size(x0))
    dtype = jnp.result_type(x0)
    if n <= dense_max:
        return dense.slogdet(jax.jacfwd(F)(x0))
    with jax.ensure_compile_time_eval():  # the probe runs on concrete stand-ins
        pattern = None if F_probe is None else probe_pattern(F_probe, n, dtype)
    if pattern is not None and pattern.blocks is not None:
        return blocks_slogdet(F, n, pattern.blocks, dtype)
    band = None if pattern is None else (pattern.lower, pattern.upper)
    if band is None or min(band) != 0 or max(band) > max(8, n // 16):
        raise Unsupported(
            f"{what} of {n} unknowns with no triangular band and no small independent blocks"
        )
    lo, up = band
    diag = band_entries(F, n, lo, up, dtype)[:, lo]
    return jnp.prod(jnp.sign(diag)), jnp.sum(jnp.log(jnp.abs(diag)))


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
        top = -band[:, 1:] / piv[:, None]  # (n, b): first row of M_i
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


def banded_triangular_solve(
    F: Callable[[Any], Any], n: int, b: int, lower: bool, r: Any, dtype: Any
) -> tuple[Any, Any]:
    """Solve ``A u = r`` for a triangular `A` of bandwidth `b` given as the linear part of the
    affine `F` (``A v = F(v) - F(0)``). Returns (u, diagonal of A: the pivots)."""
    band = band_entries(F, n, b if lower else 0, 0 if lower else b, dtype)
    if lower:  # band[i, c] = A[i, i - b + c]: reverse the columns to count k = i - j
        band = band[:, ::-1]
    return _substitute(band, r, lower), band[:, 0]


def banded_solve(
    F: Callable[[Any], Any], n: int, lo: int, up: int, r: Any, dtype: Any
) -> tuple[Any, Any, Any]:
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


_PIVOTING_GTSV = ("cpu", "gpu")
"""Backends whose `lax.linalg.tridiagonal_solve` pivots (LAPACK's ``gtsv``, cuSPARSE's
``gtsv2``); elsewhere it is the Thomas algorithm, which fails where a row swap is needed."""


def tridiagonal_solve(F: Callable[[Any], Any], n: int, r: Any, dtype: Any) -> Any:
    """Solve ``A u = r`` for a tridiagonal `A` given as the linear part of the affine `F`:
    its diagonals by three coloured JVPs, then `banded_solve`'s elimination (partial
    pivoting) as one LAPACK ``gtsv`` call (cuSPARSE's ``gtsv2`` on GPUs). The n-step scan and
    the substitution took about 0.27 ms at n = 4000 on one CPU thread, ``gtsv`` 0.1 ms: most
    of a chained Rosenbrock's Newton direction. NaN where a pivot vanishes."""
    band = band_entries(F, n, 1, 1, dtype)
    r = jnp.asarray(r, dtype)
    if jax.default_backend() not in _PIVOTING_GTSV:
        U, y = _eliminate(band, r, 1)
        return _substitute(U, y, False)
    return dense.tridiagonal_solve(band[:, 0], band[:, 1], band[:, 2], r[:, None])[:, 0]


@partial(jax.jit, static_argnames=("lo",))
def _eliminate(band: Any, r: Any, lo: int) -> tuple[Any, Any]:
    """Banded LU with partial pivoting applied to `r`: (U's band rows, L⁻¹Pr)."""
    n, w = band.shape
    dtype = band.dtype
    # the active window at step k: rows k..k+lo, columns k..k+lo+up. Row i enters the window
    # when its first band column i-lo becomes the window's first column, so band rows slot in
    # unshifted; the first lo+1 rows are placed by hand.
    rows0 = np.arange(lo + 1)[:, None]
    cs = np.arange(w)[None, :] - rows0 + lo  # band column of window column
    ok = (cs >= 0) & (cs < w) & (rows0 < n)
    W0 = jnp.where(jnp.asarray(ok), band[np.minimum(rows0, n - 1), np.clip(cs, 0, w - 1)], 0.0)
    r0 = jnp.where(jnp.asarray(np.arange(lo + 1) < n), r[np.minimum(np.arange(lo + 1), n - 1)], 0.0)
    nxt_rows = jnp.concatenate([band, jnp.zeros((lo + 1, w), dtype)])[lo + 1 : lo + 1 + n]
    nxt_r = jnp.concatenate([r, jnp.zeros(lo + 1, dtype)])[lo + 1 : lo + 1 + n]

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


# --------------------------------------------------------------------------- lumps in the walker

MAX_LUMP_EQNS = 256
"""How far back from the last stuck equation a lump may start."""


def affine_eqn(eqn: JaxprEqn, act: Sequence[bool]) -> bool:
    """Whether `eqn`'s outputs are affine in its inputs marked `act` (the others fixed)."""
    p = eqn.primitive
    if is_kind(p, LINEAR):
        if p is prims.select_n and act[0]:
            return False
        if any(
            a and not jnp.issubdtype(v.aval.dtype, jnp.inexact) for a, v in zip(act, eqn.invars)
        ):
            return False  # an unknown index or integer operand
        return not (
            p is prims.convert_element_type
            and not jnp.issubdtype(eqn.params["new_dtype"], jnp.inexact)
        )
    if is_kind(p, BILINEAR):
        return sum(act) <= 1
    if p is prims.div:
        return not act[1]
    return False


def _is_affine(eqns: Sequence[JaxprEqn], active: set[Var]) -> bool:
    """Whether the lump's outputs are affine in the `active` variables."""
    active = set(active)
    for eqn in eqns:
        act = [isinstance(v, Var) and v in active for v in eqn.invars]
        if not any(act):
            continue
        if not affine_eqn(eqn, act):
            return False
        active.update(real_outvars(eqn))
    return True


def _degrees(avals: Any) -> int:
    """Real degrees of freedom: a complex element holds two."""
    return sum(int(np.prod(a.shape, dtype=np.int64)) * (2 if _is_complex(a) else 1) for a in avals)


def lump_step(
    eqns: Sequence[JaxprEqn],
    env: Env,
    pending: Sequence[int],
    cut: bool = False,
    dropping: frozenset[JaxprEqn] = frozenset(),
) -> bool:
    """Solve the smallest trailing group of stuck equations that is square (in real degrees of
    freedom) and affine (and, where equations before `eqns` are `cut` off, not singular on
    stand-ins). A lump holding one of the linear equations `dropping` dimensions (`real`, an
    inverse real FFT: lossy alone, not in a group whose inputs have no more freedom, as the DCT
    written by `jax.scipy.fft`) is solved only where its rank on stand-ins shows it regular."""
    # an equation whose output came forward whatever its unknown input (`x * 0`, which JAX
    # 0.12.1 writes beside `x * 0.5` for a complex scalar times a real array) says nothing of
    # that input: it is no equation of a lump
    cand = [
        i
        for i in pending
        if any(not env.known(v) for v in eqns[i].invars)
        and not (eqns[i] in env.losses and env.losses[eqns[i]] is None)
    ]
    stuck = [i for i in cand if any(env.known(v) for v in real_outvars(eqns[i]))]
    if not stuck:
        return False
    top = max(stuck)
    tried = 0
    for t in sorted((i for i in cand if i <= top), reverse=True):
        tried += 1
        if tried > MAX_LUMP_EQNS:
            break
        lump = [i for i in cand if i >= t]
        produced = {v for i in lump for v in real_outvars(eqns[i])}
        inputs: list[Var] = []
        for i in lump:
            for v in eqns[i].invars:
                if (
                    isinstance(v, Var)
                    and not env.known(v)
                    and v not in produced
                    and v not in inputs
                ):
                    inputs.append(v)
        outputs = [v for i in lump for v in real_outvars(eqns[i]) if env.known(v)]
        if not inputs or _degrees(v.aval for v in inputs) != _degrees(v.aval for v in outputs):
            continue
        lump_eqns = [eqns[i] for i in lump]
        # an equation whose element rules found it loses elements (a factor with zeros) makes
        # any lump holding it singular: leave it to be reported, naming it, at trace time
        if any(env.losses.get(e) is not None for e in lump_eqns) or not _is_affine(
            lump_eqns, set(inputs)
        ):
            continue
        L = Lump(lump_eqns, inputs, outputs)
        # an input known on some elements: the lump ignores them, and may then be singular
        # (an overwritten operand's elements do not reach its output); such a lump is not
        # the one to solve
        if any(v in env.part for v in inputs) and _singular_at_trace_time(L, env) is not False:
            continue
        if any(e in dropping for e in lump_eqns) and (
            size_of(v.aval for v in inputs) > _MAX_RANK_CHECK
            or _singular_at_trace_time(L, env) is not False
        ):
            continue
        # singular on random stand-ins: an input the lump takes as free may be fixed by
        # equations the window cuts off; solving would give NaN, so the window widens
        if cut and singular_on_stand_ins(L, env):
            continue
        _solve_lump(L, env)
        records.group_step(env, "lump", L.eqns, L.inputs, L.outputs)
        return True
    return False


_MAX_RANK_CHECK = 1024


def _singular_at_trace_time(L: Lump, env: Env) -> bool | None:
    """Whether the lump's matrix is singular, on stand-ins (None: not decided): by its rank up
    to `_MAX_RANK_CHECK` unknowns, by a zero row or column (an overwritten operand's
    elements) up to `MAX_PROBE_SIZE`."""
    n = size_of(v.aval for v in L.inputs)
    stand_in = stand_ins(L, env)
    if stand_in is None or n > MAX_PROBE_SIZE:
        return None
    try:
        with jax.ensure_compile_time_eval():
            if n <= _MAX_RANK_CHECK:
                # (a numpy zero: a `jnp` array is a tracer under `jit`)
                c = L.coordinates(stand_in)
                J = np.asarray(_jacobian(c, np.zeros(c.n, c.dtype)))
                return bool(np.linalg.matrix_rank(J) < c.n)
            dtype = jnp.result_type(*[v.aval.dtype for v in [*L.inputs, *L.outputs]])
            offs = np.cumsum([0] + [int(np.prod(v.aval.shape, dtype=np.int64)) for v in L.inputs])
            F = L.flat(offs, dtype, stand_in)
            zero = np.zeros(n, dtype)
            cols = min(n, _PROBE_BLOCK)
            block = jax.jit(
                lambda start: jax.vmap(lambda e: jax.jvp(F, (zero,), (e,))[1])(
                    (jnp.arange(n)[None, :] == start + jnp.arange(cols)[:, None]).astype(dtype)
                )
            )
            rows = np.zeros(n, bool)
            for start in range(0, n, cols):
                Y = np.asarray(block(start)) != 0  # Y[c, i] = A[i, start + c]
                live = min(cols, n - start)
                if not Y[:live].any(axis=1).all():
                    return True  # a zero column
                rows |= Y[:live].any(axis=0)
            return not bool(rows.all())  # a zero row
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


_NOT_HOLOMORPHIC = (prims.conj, prims.real, prims.imag)


class Lump:
    """A group of equations, its unknown inputs and its known outputs, as the map
    ``F(inputs; values read from outside) = outputs``."""

    def __init__(
        self,
        eqns: Sequence[JaxprEqn],
        inputs: list[Var],
        outputs: list[Var],
        sources: dict | None = None,
    ) -> None:
        self.eqns, self.inputs, self.outputs = list(eqns), inputs, outputs
        self.sources = sources or {}  # var -> the equation computing it (for stand-ins)
        produced = {v for e in self.eqns for v in real_outvars(e)}
        self.reads = list(
            dict.fromkeys(
                v
                for e in self.eqns
                for v in e.invars
                if isinstance(v, Var) and v not in produced and v not in inputs
            )
        )
        # a complex group through conj, real or imag is linear over the reals only: its
        # Jacobian is not one complex matrix (a holomorphic JVP of conj(x) is wrong), so it
        # is solved as the real system of twice the size
        # (real unknowns of complex outputs, or complex ones of real outputs: the same)
        ends = {_is_complex(v.aval) for v in [*inputs, *outputs]}
        self.real_linear_only = True in ends and (
            len(ends) > 1 or any(e.primitive in _NOT_HOLOMORPHIC for e in self.eqns)
        )

    def __call__(self, *xs: Any, known: Env) -> list[Any]:
        return self.apply(xs, [known.read(v) for v in self.reads])

    def apply(self, xs: Sequence[Any], read_vals: Sequence[Any], fit: bool = True) -> list[Any]:
        """F at inputs `xs`, with `read_vals` for the values it reads from outside (of other
        shapes than the variables', when not `fit`: elementwise equations on samples)."""
        local = Env(fit)
        for v, r in zip(self.reads, read_vals):
            local.write(v, r)
        for v, x in zip(self.inputs, xs):
            local.write(v, x)
        evaluate(self.eqns, local)
        return [local.read(o) for o in self.outputs]

    def flat(self, offs: Any, dtype: Any, known: Env) -> Callable[[Any], Any]:
        """F on one vector of all the inputs, returning one vector of all the outputs."""

        def f(u):
            xs = [
                jnp.reshape(u[offs[m] : offs[m + 1]], v.aval.shape).astype(v.aval.dtype)
                for m, v in enumerate(self.inputs)
            ]
            return jnp.concatenate(
                [jnp.ravel(jnp.asarray(y, dtype)) for y in self(*xs, known=known)]
            )

        return f

    def coordinates(self, known: Env) -> Coordinates:
        """The lump as a map of one vector to one vector (`Coordinates`), in real numbers
        (each complex value as its real, then imaginary part) where it is linear over the
        reals only, else in the ends' common dtype."""
        dtype = jnp.result_type(*[v.aval.dtype for v in [*self.inputs, *self.outputs]])
        split = self.real_linear_only
        if split:
            dtype = jnp.finfo(dtype).dtype

        def pack(vals: Sequence[Any]) -> Any:
            parts = []
            for v, y in zip(self.outputs, vals):
                y = jnp.ravel(y)
                if split and _is_complex(v.aval):
                    parts += [jnp.real(y).astype(dtype), jnp.imag(y).astype(dtype)]
                else:  # (a real output held in a complex array: its real part)
                    parts.append((jnp.real(y) if split else y).astype(dtype))
            return jnp.concatenate(parts)

        def unpack(u: Any) -> list[Any]:
            vals, at = [], 0
            for v in self.inputs:
                size = int(np.prod(v.aval.shape, dtype=np.int64))
                if split and _is_complex(v.aval):
                    x = lax.complex(u[at : at + size], u[at + size : at + 2 * size])
                    at += 2 * size
                else:
                    x = u[at : at + size]
                    at += size
                vals.append(jnp.reshape(x, v.aval.shape).astype(v.aval.dtype))
            return vals

        n = _degrees(v.aval for v in self.inputs) if split else size_of(v.aval for v in self.inputs)
        return Coordinates(lambda u: pack(self(*unpack(u), known=known)), n, dtype, pack, unpack)


class Coordinates(NamedTuple):
    """A lump as ``F(u) = A u + c`` on vectors of `n` numbers of `dtype`: `pack` makes the
    vector of output values, `unpack` the input values of a vector."""

    F: Callable[[Any], Any]
    n: int
    dtype: Any
    pack: Callable[[Sequence[Any]], Any]
    unpack: Callable[[Any], list[Any]]


def _is_complex(aval: Any) -> bool:
    return bool(jnp.issubdtype(aval.dtype, jnp.complexfloating))


def _jacobian(c: Coordinates, u: Any) -> Any:
    """The dense matrix ``A`` of the lump in coordinates `c`, at `u` (holomorphic for a lump
    linear over the complex numbers: `jax.jacfwd` refuses complex inputs otherwise)."""
    return jax.jacfwd(c.F, holomorphic=jnp.issubdtype(c.dtype, jnp.complexfloating))(u)


def _solve_lump(L: Lump, env: Env) -> None:
    inputs, outputs = L.inputs, L.outputs
    dtype = jnp.result_type(*[v.aval.dtype for v in [*inputs, *outputs]])
    ys = [jnp.asarray(env.read(o), dtype) for o in outputs]
    shape = _elementwise_shape(L)
    if shape is not None:
        sols = _solve_elementwise(L, env, shape, dtype, ys)
    else:
        sizes = [int(np.prod(v.aval.shape, dtype=np.int64)) for v in inputs]
        offs = np.cumsum([0] + sizes)
        u = None
        if not L.real_linear_only:
            Fflat = L.flat(offs, dtype, env)
            r = jnp.concatenate([jnp.ravel(y) for y in ys]) - Fflat(jnp.zeros(int(offs[-1]), dtype))
            u = _structured_solve(L, env, offs, dtype, r)
        if u is not None:
            sols = [
                jnp.reshape(u[offs[m] : offs[m + 1]], v.aval.shape) for m, v in enumerate(inputs)
            ]
        else:  # one dense lump: n JVPs and an LU
            c = L.coordinates(env)
            u0 = jnp.zeros(c.n, c.dtype)
            with staged_constants():  # else the n x n identity basis is folded into constants
                A = _jacobian(c, u0)
            sols = c.unpack(dense.solve(A, c.pack(ys) - c.F(u0)))
    if all(is_concrete(s) for s in sols) and not all(bool(jnp.all(jnp.isfinite(s))) for s in sols):
        # blame a reduction if there is one: it is where the information goes
        culprit = next((e for e in L.eqns if e.primitive is prims.reduce_sum), L.eqns[-1])
        raise not_invertible(
            culprit,
            "it belongs to a group of equations that are invertible "
            "only together, and together they form a singular linear map",
            singular=True,
            who=env.ctx.who,
        )
    for v, s in zip(inputs, sols):
        env.write(v, s)


def _elementwise_shape(L: Lump) -> tuple[int, ...] | None:
    if L.real_linear_only:  # (its blocks would be complex derivatives)
        return None
    shapes = {tuple(v.aval.shape) for v in [*L.inputs, *L.outputs]}
    if (
        len(shapes) == 1
        and len(L.inputs) == len(L.outputs)
        and all(elementwise_in(e, next(iter(shapes))) for e in L.eqns)
    ):
        return next(iter(shapes))
    return None


def _blocks(
    L: Lump, env: Env, shape: tuple[int, ...], dtype: Any, at: Sequence[Any] | None = None
) -> tuple[list, Any]:
    """F at zero (or at `at`) and the k x k block of each element there (k JVPs give every
    block at once)."""
    F = partial(L, known=env)
    zeros = list(at) if at is not None else [jnp.zeros(shape, v.aval.dtype) for v in L.inputs]
    f0 = [jnp.asarray(f, dtype) for f in F(*zeros)]
    cols = []
    for j in range(len(L.inputs)):
        tang = [
            jnp.ones(shape, v.aval.dtype) if m == j else jnp.zeros(shape, v.aval.dtype)
            for m, v in enumerate(L.inputs)
        ]
        _, d = jax.jvp(F, zeros, tang)
        cols.append(jnp.stack([jnp.asarray(x, dtype) for x in d], -1))
    return f0, jnp.stack(cols, -1)


_MAX_STAND_IN_RANK = 256
_MAX_STAND_IN_ELEMENTS = 1 << 20


def singular_on_stand_ins(L: Lump, env: Env, nonlinear: bool = False) -> bool:
    """Whether the group's matrix (its Jacobian, at a random point, when `nonlinear`) is
    singular at random stand-ins for what it reads, so, almost surely, at every value: its
    blocks' smallest singular values when elementwise, its rank up to `_MAX_STAND_IN_RANK`
    unknowns otherwise. False when not decided."""
    shape = _elementwise_shape(L)
    n = size_of(v.aval for v in L.inputs)
    if shape is None and n > _MAX_STAND_IN_RANK:
        return False
    if shape is not None and int(np.prod(shape, dtype=np.int64)) > _MAX_STAND_IN_ELEMENTS:
        return False
    stand_in = stand_ins(L, env)
    if stand_in is None:
        return False
    dtype = jnp.result_type(*[v.aval.dtype for v in [*L.inputs, *L.outputs]])
    rng = np.random.default_rng(1)
    try:
        with jax.ensure_compile_time_eval():
            if shape is not None:
                at = [
                    (0.5 * rng.standard_normal(shape)).astype(v.aval.dtype)
                    if nonlinear
                    else np.zeros(shape, v.aval.dtype)
                    for v in L.inputs
                ]
                A = np.asarray(_blocks(L, stand_in, shape, dtype, at)[1])
                A = A.reshape(-1, len(L.inputs), len(L.inputs))
            else:
                c = L.coordinates(stand_in)
                u = (0.5 * rng.standard_normal(c.n) if nonlinear else np.zeros(c.n)).astype(c.dtype)
                A = np.asarray(_jacobian(c, u))[None]
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return False
    if not np.all(np.isfinite(A)) or A.size == 0:
        return False
    sv = dense.numpy_svd(A, compute_uv=False)
    eps = jnp.finfo(A.dtype).eps
    return bool(np.any(sv[:, -1] <= 64 * eps * A.shape[-1] * sv[:, 0]))


def _solve_elementwise(
    L: Lump, env: Env, shape: tuple[int, ...], dtype: Any, ys: list[Any]
) -> list[Any]:
    """One small k x k system per element."""
    k = len(L.inputs)
    f0, A = _blocks(L, env, shape, dtype)
    # A depends on known values only; applying inv(A) by elementwise mul/add keeps the
    # result an elementwise linear lump again, so reverse(reverse(f)) works
    Ainv = dense.inv(A)
    rs = [y - f for y, f in zip(ys, f0)]
    sols = []
    for m in range(k):
        u = Ainv[..., m, 0] * rs[0]
        for j in range(1, k):
            u = u + Ainv[..., m, j] * rs[j]
        sols.append(u)
    return sols


_SOURCE_DEPTH = 16


def stand_ins(L: Lump, env: Env) -> Env | None:
    """Concrete values for what `L` reads, to find its structure at trace time: the known
    values where concrete or computed from constants, random numbers for other traced floats;
    None when a traced integer or boolean (an index, a predicate) is read, since it may change
    the pattern.

    A traced float computed from other traced floats by equations `L.sources` holds (``dt``
    and ``dt / 2``, both read) is computed from their stand-ins: independent random values
    would break the relation a cancellation rests on. Those equations run as one compiled
    program (`compiled_eqns`; op by op, where JAX folds constants, each was a program)."""
    stand_in = Env()
    rng = np.random.default_rng(0)
    given: dict = {}  # var -> its stand-in (numpy), or None (a traced integer)
    chain: list[JaxprEqn] = []  # the sources to run, producers first
    computed: set = set()  # the variables the chain computes

    def value(v: Any, depth: int) -> bool:
        """Whether `v` has a stand-in (given, or computed by the chain)."""
        if not isinstance(v, Var):
            return True
        if v in computed:
            return True
        if v in given:
            return given[v] is not None
        val = env.read(v) if env.known(v) else None
        static = None if val is not None and is_concrete(val) else env.info.static(v)
        if val is not None and is_concrete(val):
            given[v] = np.asarray(val)
        elif static is not None:
            # computed from constants (a DCT's twiddle factors, traced under `jit`): random
            # values would change the lump's rank
            given[v] = np.broadcast_to(np.asarray(static, v.aval.dtype), v.aval.shape)
        elif not jnp.issubdtype(v.aval.dtype, jnp.inexact):
            given[v] = None
        else:
            e = L.sources.get(v) if depth < _SOURCE_DEPTH else None
            if e is not None and all([value(u, depth + 1) for u in e.invars]):
                chain.append(e)
                computed.update(o for o in e.outvars if isinstance(o, Var))
                return True
            given[v] = rng.standard_normal(v.aval.shape).astype(v.aval.dtype) + 1.5
        return given[v] is not None

    for v in L.reads:
        if not value(v, 0):
            return None
    if chain:
        leaves = tuple(
            dict.fromkeys(
                u for e in chain for u in e.invars if isinstance(u, Var) and u not in computed
            )
        )
        wanted = tuple(v for v in L.reads if v in computed)
        with jax.ensure_compile_time_eval():
            run = compiled_eqns(tuple(chain), leaves, wanted)
            for v, x in zip(wanted, run(*[given[u] for u in leaves])):
                given[v] = np.asarray(x)
    for v in L.reads:
        stand_in.write(v, given[v])
    return stand_in


def _structured_solve(L: Lump, env: Env, offs: Any, dtype: Any, r: Any) -> Any:
    """Solve a lump whose matrix is banded; None if it is not."""
    n = int(offs[-1])
    if n < MIN_STRUCTURED_SIZE or jnp.issubdtype(dtype, jnp.complexfloating):
        return None
    stand_in = stand_ins(L, env)
    if stand_in is None:
        return None
    pattern = probe_pattern(L.flat(offs, dtype, stand_in), n, dtype)
    if pattern is None:
        return None
    lo, up = pattern.lower, pattern.upper
    # small independent blocks (data movement around small groups) before a band: k JVPs
    # where a band holding blocks of k needs 2k - 1, and a band of 2 x 2 blocks interleaved
    # (or of a permutation) is as wide as the lump
    if pattern.blocks is None and lo + up > max(8, n // 16):
        return None
    G = L.flat(offs, dtype, env)
    if pattern.blocks is not None:
        u, pivots = block_solve(G, n, pattern.blocks, r, dtype)
        what = "independent blocks (after reordering its rows and columns)"
    elif lo == up == 1:
        u = tridiagonal_solve(G, n, r, dtype)
        what = "banded system (solved with partial pivoting)"
        # gtsv says only that a pivot vanished (NaN): the elimination finds which, to name it
        failed = is_concrete(u) and not bool(jnp.all(jnp.isfinite(u)))
        pivots = banded_solve(G, n, lo, up, r, dtype)[1] if failed else None
    elif lo and up:
        u, pivots, _ = banded_solve(G, n, lo, up, r, dtype)
        what = "banded system (solved with partial pivoting)"
    else:
        u, pivots = banded_triangular_solve(G, n, lo or up, up == 0, r, dtype)
        what = "triangular system"
    if pivots is not None and is_concrete(pivots) and bool(jnp.any(pivots == 0)):
        k = int(jnp.argmax(pivots == 0))
        raise not_invertible(
            L.eqns[-1],
            "it belongs to a group of equations that are "
            f"invertible only together, and their {what} has a zero pivot "
            f"(row {k})",
            singular=True,
            who=env.ctx.who,
        )
    return u
