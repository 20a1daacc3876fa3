"""Rules of products and solves by matrices: `dot_general` by a known square matrix (inverse
and log-determinant), its element rule (a product by a matrix with zeros known when traced,
a masked autoregressive network's layers: output elements are known where every input element
they read is), and a triangular solve by a known matrix (flowjax's inverted
`TriangularAffine`, ``solve_triangular(A, y - loc)``), inverted by the product it undoes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxrev._dense as dense
from jaxrev._cache import memo
from jaxrev._compat import JaxprEqn, is_concrete, prims
from jaxrev._env import Env, is_unknown
from jaxrev._evaluate import apply
from jaxrev.transforms.knowledge import regions as R
from jaxrev.transforms.knowledge.elements import learn, region_of, value_of
from jaxrev.transforms.registry import (
    BILINEAR,
    LINEAR,
    ElementRule,
    LogdetContext,
    Lossy,
    NeedMore,
    Unsupported,
    define,
)

_SMALL_MATRIX = 64
"""Up to this size, a known matrix applied to at least as many vectors is inverted once and
applied by a product."""


def _dot_general(out, lhs, rhs, *, dimension_numbers, **_):
    (lc, rc), (lb, rb) = dimension_numbers
    if is_unknown(lhs) == is_unknown(rhs):
        return None
    x_is_lhs = is_unknown(lhs)
    x, w = (lhs, rhs) if x_is_lhs else (rhs, lhs)
    xc, wc = (lc, rc) if x_is_lhs else (rc, lc)
    xb, wb = (lb, rb) if x_is_lhs else (rb, lb)
    w_free = [d for d in range(w.ndim) if d not in wc and d not in wb]
    if len(xc) != 1 or len(w_free) != 1 or w.shape[wc[0]] != w.shape[w_free[0]]:
        # (not lost: a product by a rectangular matrix may be part of a square group that
        # Newton's method solves, `W2 tanh(W1 x)`; alone, the walk ends stuck on it)
        raise NeedMore(
            "multiplying by a matrix is invertible only for a known square matrix "
            f"contracted on one dimension (got operand shape {tuple(w.shape)})"
        )
    x_free = [d for d in range(x.aval.ndim) if d not in xc and d not in xb]
    n = w.shape[wc[0]]
    # canonical forms: W as (B..., n_contract, n_free); Y as (B..., F, n_free) or (B..., n_free, F)
    Wc = jnp.transpose(w, list(wb) + [wc[0], w_free[0]])
    fshape = [x.aval.shape[d] for d in x_free]
    nf = int(np.prod(fshape, dtype=np.int64))
    bshape = [x.aval.shape[d] for d in xb]
    # a small matrix applied to many vectors (a 1x1 convolution over pixels): its inverse
    # applied by a product, which XLA runs itself, rather than a LAPACK solve with that many
    # right-hand sides (whose BLAS threads cost milliseconds a call on a busy CPU)
    by_inverse = n <= _SMALL_MATRIX and nf >= n
    if x_is_lhs:  # out = (B..., x_free..., w_free)
        Y = jnp.reshape(out, bshape + [nf, n])
        # Y = X @ Wc  =>  X = Y @ inv(Wc), or X^T = solve(Wc^T, Y^T)
        X = (
            Y @ dense.inv(Wc)
            if by_inverse
            else jnp.swapaxes(
                dense.solve(jnp.swapaxes(Wc, -1, -2), jnp.swapaxes(Y, -1, -2)), -1, -2
            )
        )
        X = jnp.reshape(X, bshape + fshape + [n])
        order = list(xb) + x_free + [xc[0]]
    else:  # out = (B..., w_free, x_free...)
        Y = jnp.reshape(out, bshape + [n, nf])
        # Y = Wc^T @ X
        Wt = jnp.swapaxes(Wc, -1, -2)
        X = dense.inv(Wt) @ Y if by_inverse else dense.solve(Wt, Y)
        X = jnp.reshape(X, bshape + [n] + fshape)
        order = list(xb) + [xc[0]] + x_free
    X = jnp.transpose(X, np.argsort(order))
    if is_concrete(X) and not bool(jnp.all(jnp.isfinite(X))):
        raise Lossy("the known matrix is singular", singular=True)
    return [X, None] if x_is_lhs else [None, X]


def _dot_logdet(ctx: LogdetContext) -> tuple[Any, Any]:
    """y = x @ W (or W @ x) with W known and square: det(W) once per row (column)."""
    eqn = ctx.eqn
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lb or rb or sum(ctx.recovered) != 1 or len(lc) != 1:
        raise Unsupported("a dot_general other than a product by a known square matrix")
    k = ctx.recovered.index(True)
    x, W = ctx.invals[k], ctx.invals[1 - k]
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise Unsupported("a dot_general by a matrix that is not square")
    # the output lays out x's free axes, then W's (x @ W), or W's first (W @ x): the same
    # layout as x when x is contracted on its last axis, or on its first: then the map is W
    # applied along that axis, det(W) once per line, in the order input and output share
    xc = (lc if k == 0 else rc)[0]
    if xc != (x.ndim - 1 if k == 0 else 0):
        raise Unsupported(
            "a dot_general whose output is laid out unlike its input (x @ W "
            "contracting x's last axis, or W @ x contracting its first)"
        )
    s, la = dense.slogdet(W)
    reps = int(np.prod(x.shape, dtype=np.int64)) // W.shape[0]
    return s**reps, la * reps


def _dot_forward(eqn: JaxprEqn, env: Env) -> bool | None:
    """A product of an unknown (or partly known) operand by a known matrix with zeros: each
    output element is known where the operand's elements it reads (through nonzero entries)
    are. A masked autoregressive layer's first outputs need none of the state; each element
    learned downstream then opens more (D passes for D dimensions)."""
    (o,) = eqn.outvars
    if env.known(o):
        return None
    unknown = [k for k in (0, 1) if not env.known(eqn.invars[k])]
    if len(unknown) != 1:
        return None
    k = unknown[0]
    x, w = eqn.invars[k], eqn.invars[1 - k]
    # zeros known when traced: a static matrix's, or, in a loop over stacked layers
    # (flowjax's `Scan`), those every layer has (`Statics.support`)
    nz = env.info.support(w)
    if nz is None:
        return None
    if np.all(nz):
        return None
    rx = region_of(env, x)
    ux = R.static_mask(rx, tuple(x.aval.shape))
    if ux is not None:
        ops = [None, None]
        ops[k], ops[1 - k] = np.asarray(ux, np.float32), np.asarray(nz, np.float32)
        with jax.ensure_compile_time_eval():  # (masks known when traced, even under jit)
            uo = np.asarray(lax.dot_general(ops[0], ops[1], eqn.params["dimension_numbers"])) > 0
        if np.all(uo):
            return False
        region = R.mask_region(uo)
    else:
        # unknown in a window at a computed index (the element a loop's step overwrites):
        # the outputs that read it through nonzero entries, decided at every iteration
        reads = _reads(eqn, k, nz)
        if reads is None:
            return None
        region = R.spread(rx, reads, tuple(o.aval.shape))
        if region == R.FULL:
            return False
    vals = [None, None]
    vals[k] = (
        jnp.zeros(x.aval.shape, x.aval.dtype) if rx == R.FULL else value_of(env, x, clean=True)
    )
    vals[1 - k] = env.read(w)
    return learn(env, o, apply(eqn, vals)[0], region)


def _reads(eqn: JaxprEqn, k: int, nz: np.ndarray) -> np.ndarray | None:
    """Which elements of operand `k` each output element of the product reads through the
    other operand's nonzero entries `nz`: (outputs, operand k's elements), flattened; None
    where that relation is too large to build when tracing (`regions.MAX_RELATION`)."""
    x = eqn.invars[k]
    size = int(np.prod(x.aval.shape, dtype=np.int64))
    if size * int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64)) > R.MAX_RELATION:
        return None
    # every learning pass over the product asks again (a layer's D passes, each trace): keyed
    # on all that decides it, the zeros by content
    dn = eqn.params["dimension_numbers"]
    key = (k, tuple(x.aval.shape), dn, nz.shape, np.packbits(nz).tobytes())
    cache = memo("linalg.reads", 256)
    hit = cache.get(key)
    if hit is None:
        hit = cache.put(key, [], _reads_of(dn, k, tuple(x.aval.shape), nz))
    return hit


def _reads_of(dn: Any, k: int, x_shape: tuple, nz: np.ndarray) -> np.ndarray:
    size = int(np.prod(x_shape, dtype=np.int64))
    basis = np.eye(size, dtype=np.float32).reshape((size, *x_shape))
    w = np.asarray(nz, np.float32)

    def one(e):
        ops = (e, w) if k == 0 else (w, e)
        return lax.dot_general(*ops, dn)

    with jax.ensure_compile_time_eval():
        hits = np.asarray(jax.vmap(one)(basis)) != 0
    hits = hits.reshape(size, -1).T
    hits.setflags(write=False)  # (shared by every caller through the cache)
    return hits


define(
    prims.dot_general,
    inverse=_dot_general,
    logdet=_dot_logdet,
    element=ElementRule(_dot_forward),
    kind=(BILINEAR,),
)


def _triangle(a: Any, lower: bool, unit_diagonal: bool) -> Any:
    """The matrix the solve reads: one triangle (and a unit diagonal where asked)."""
    t = jnp.tril(a) if lower else jnp.triu(a)
    if unit_diagonal:
        n = a.shape[-1]
        t = t * (1 - jnp.eye(n, dtype=a.dtype)) + jnp.eye(n, dtype=a.dtype)
    return t


def _op(t: Any, transpose_a: bool, conjugate_a: bool) -> Any:
    t = jnp.conj(t) if conjugate_a else t
    return jnp.swapaxes(t, -1, -2) if transpose_a else t


def _triangular_solve(out, a, b, *, left_side, lower, transpose_a, conjugate_a, unit_diagonal):
    # out = op(A)^-1 b (left) or b op(A)^-1: b is the product it undoes
    if is_unknown(a) or not is_unknown(b):
        raise Lossy(
            "a triangular solve inverts only for a known matrix and an unknown right-hand side"
        )
    A = _op(_triangle(a, lower, unit_diagonal), transpose_a, conjugate_a)
    return [None, A @ out if left_side else out @ A]


def _triangular_solve_logdet(ctx: LogdetContext) -> tuple[Any, Any]:
    if ctx.recovered != [False, True]:
        raise Unsupported("a triangular solve whose matrix is recovered")
    p = ctx.eqn.params
    a, b = ctx.invals
    if p["unit_diagonal"]:
        return jnp.ones((), ctx.dtype), jnp.zeros((), ctx.dtype)
    d = jnp.diagonal(a, axis1=-2, axis2=-1)
    d = jnp.conj(d) if p["conjugate_a"] else d
    # every column (row, on the right) of b is solved by the same op(A): |det op(A)|^-1 each
    reps = b.shape[-1] if p["left_side"] else b.shape[-2]
    la = -jnp.sum(jnp.log(jnp.abs(d))) * reps
    # (the inverse's determinant: the conjugate phase, for a complex matrix)
    phase = jnp.sign(d) if np.isrealobj(np.empty((), d.dtype)) else jnp.conj(jnp.sign(d))
    sign = jnp.prod(phase) ** reps
    return sign, la.astype(ctx.dtype)


define(prims.triangular_solve, inverse=_triangular_solve, logdet=_triangular_solve_logdet)


def _fft(out, x, *, fft_type, fft_lengths):
    # a complex FFT is undone by the opposite one; a real FFT keeps every degree of freedom of
    # its real input (the half spectrum it returns is Hermitian), so its inverse real FFT
    # gives the input back exactly. The inverse real FFT drops the imaginary parts of the zero
    # (and, for an even length, the Nyquist) frequency: a lump that knows them inverts it
    # (the DCT as `jax.scipy.fft.idct` writes it)
    kind = lax.FftType(fft_type)
    if kind == lax.FftType.IRFFT:
        raise Lossy(
            "an inverse real FFT drops the imaginary parts of its zero (and Nyquist) frequency",
            subspace=True,
        )
    undo = {
        lax.FftType.FFT: lax.FftType.IFFT,
        lax.FftType.IFFT: lax.FftType.FFT,
        lax.FftType.RFFT: lax.FftType.IRFFT,
    }[kind]
    return [lax.fft(out, undo, fft_lengths).astype(x.dtype)]


define(prims.fft, inverse=_fft, kind=(LINEAR,))
