"""NiLang's reversible instructions that plain JAX lacks: `rot` (a Givens rotation) and `swap`.

Both are JAX primitives with abstract evaluation, an XLA lowering (the same on CPU and GPU),
JVP, transpose, batching, an inverse rule (``rot(−θ)``, ``swap``) and an inverse-JVP rule, so
`reverse`, `reversible` and the inverse transforms see them as single invertible steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrev._batching import batch_front
from jaxrev._compat import is_symbolic_zero, is_undefined_primal, not_mapped
from jaxrev._env import Unknown
from jaxrev._primitive import make_primitive
from jaxrev.transforms.registry import Lossy, define

__all__ = ["rot", "swap", "rot_p", "swap_p"]


def rot(a: Any, b: Any, theta: Any) -> tuple[jax.Array, jax.Array]:
    """Rotate the pair (a, b) by the angle `theta`: ``(a cos θ − b sin θ, a sin θ + b cos θ)``
    (NiLang's ``ROT``), as one invertible step.

    Its inverse is ``rot(·, ·, −θ)``, which `jr.reverse` uses.

    **Arguments:**

    - `a`, `b`: arrays of one shape and dtype (real or complex).
    - `theta`: the angle, real: a scalar or of `a`'s shape.

    **Returns:**

    The rotated pair ``(a', b')``, of `a`'s shape and dtype.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> a, b = jr.rot(1.0, 0.0, jnp.pi / 2)
        >>> bool(jnp.allclose(jnp.stack([a, b]), jnp.array([0.0, 1.0]), atol=1e-6))
        True
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    dtype = jnp.result_type(a, b)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.result_type(dtype, jnp.float32)
    a, b = a.astype(dtype), b.astype(dtype)
    if a.shape != b.shape:
        raise ValueError(f"jr.rot: a and b must have one shape, got {a.shape} and {b.shape}")
    theta = jnp.asarray(theta)
    if jnp.issubdtype(theta.dtype, jnp.complexfloating):
        raise TypeError("jr.rot: theta must be real")
    theta = theta.astype(jnp.finfo(dtype).dtype)
    if theta.shape not in ((), a.shape):
        raise ValueError(f"jr.rot: theta must be a scalar or of shape {a.shape}, got {theta.shape}")
    out = rot_p.bind(a, b, theta)
    return out[0], out[1]


def swap(a: Any, b: Any) -> tuple[jax.Array, jax.Array]:
    """Exchange `a` and `b` (NiLang's ``SWAP``), as one invertible step (its own inverse).

    **Arguments:**

    - `a`, `b`: arrays of one shape and dtype.

    **Returns:**

    The pair ``(b, a)``.

    **Example:**

        >>> import jaxrev as jr
        >>> [float(v) for v in jr.swap(1.0, 2.0)]
        [2.0, 1.0]
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"jr.swap: a and b must have one shape and dtype, got "
            f"{a.shape} {a.dtype} and {b.shape} {b.dtype}"
        )
    return tuple(swap_p.bind(a, b))


# --------------------------------------------------------------------------- rot rules


def _rot_impl(a, b, theta):
    c, s = jnp.cos(theta), jnp.sin(theta)
    return [c * a - s * b, s * a + c * b]


def _rot_abstract(a, b, theta):
    return [a, b]


def _zeros_like_aval(x):
    return jnp.zeros(x.aval.shape if hasattr(x, "aval") else jnp.shape(x), x.dtype)


def _rot_jvp(primals, tangents):
    a, b, theta = primals
    da, db, dth = tangents
    out = rot_p.bind(a, b, theta)
    if is_symbolic_zero(da) and is_symbolic_zero(db):
        ta, tb = jnp.zeros_like(out[0]), jnp.zeros_like(out[1])
    else:
        da = jnp.zeros_like(a) if is_symbolic_zero(da) else da
        db = jnp.zeros_like(b) if is_symbolic_zero(db) else db
        ta, tb = rot_p.bind(da, db, theta)
    if not is_symbolic_zero(dth):
        # d/dθ (a', b') = (−b', a')
        dth = dth.astype(out[0].dtype)
        ta, tb = ta - dth * out[1], tb + dth * out[0]
    return out, [ta, tb]


def _rot_transpose(cts, a, b, theta):
    if is_undefined_primal(theta):
        raise NotImplementedError("jr.rot is not linear in theta")
    ca, cb = cts
    ca = _zeros_like_aval(a) if is_symbolic_zero(ca) else ca
    cb = _zeros_like_aval(b) if is_symbolic_zero(cb) else cb
    # the rotation matrix's transpose is the rotation by −θ
    ta, tb = rot_p.bind(ca, cb, -theta)
    return [ta if is_undefined_primal(a) else None, tb if is_undefined_primal(b) else None, None]


def all_batched(args, dims) -> list:
    """For a batching rule: every operand with its batch axis first, unbatched ones
    broadcast along it."""
    size, moved, _ = batch_front(args, dims)
    return [
        x if d is not not_mapped else jnp.broadcast_to(x, (size,) + jnp.shape(x))
        for x, d in zip(moved, dims)
    ]


def _rot_batch(args, dims):
    a, b, theta = all_batched(args, dims)
    # θ is a scalar or of a's shape per example: after batching, of a's shape or (size,)
    theta = jnp.broadcast_to(theta.reshape(theta.shape + (1,) * (a.ndim - theta.ndim)), a.shape)
    return rot_p.bind(a, b, theta), [0, 0]


def _rot_inverse(outs, a, b, theta):
    if isinstance(theta, Unknown):
        raise Lossy("the angle is unknown")
    if not (isinstance(a, Unknown) and isinstance(b, Unknown)):
        raise Lossy("only one of the rotated pair is unknown; rot is inverted as a pair")
    ra, rb = rot_p.bind(outs[0], outs[1], -theta)
    return [ra, rb, None]


def _rot_inverse_jvp(t_out, outs, a, b, theta):
    ta, tb = rot_p.bind(t_out[0], t_out[1], -theta)
    return [ta, tb, None]


# JAX's rules (the lowering is `impl`'s, the same on CPU and GPU), then jaxrev's
rot_p = make_primitive(
    "jaxrev_rot",
    multiple_results=True,
    impl=_rot_impl,
    abstract=_rot_abstract,
    jvp=_rot_jvp,
    transpose=_rot_transpose,
    batch=_rot_batch,
)
define(rot_p, inverse=_rot_inverse, inverse_jvp=_rot_inverse_jvp)


# --------------------------------------------------------------------------- swap rules


def _swap_impl(a, b):
    return [b, a]


def _swap_jvp(primals, tangents):
    a, b = primals
    da, db = tangents
    da = jnp.zeros_like(a) if is_symbolic_zero(da) else da
    db = jnp.zeros_like(b) if is_symbolic_zero(db) else db
    return swap_p.bind(a, b), swap_p.bind(da, db)


def _swap_transpose(cts, a, b):
    ca, cb = cts
    ca = _zeros_like_aval(a) if is_symbolic_zero(ca) else ca
    cb = _zeros_like_aval(b) if is_symbolic_zero(cb) else cb
    ta, tb = swap_p.bind(ca, cb)
    return [ta if is_undefined_primal(a) else None, tb if is_undefined_primal(b) else None]


def _swap_batch(args, dims):
    return swap_p.bind(*all_batched(args, dims)), [0, 0]


swap_p = make_primitive(
    "jaxrev_swap",
    multiple_results=True,
    impl=_swap_impl,
    abstract=lambda a, b: [b, a],
    jvp=_swap_jvp,
    transpose=_swap_transpose,
    batch=_swap_batch,
)
define(
    swap_p,
    inverse=lambda outs, a, b: [outs[1], outs[0]],
    inverse_jvp=lambda t, outs, a, b: [t[1], t[0]],
)
