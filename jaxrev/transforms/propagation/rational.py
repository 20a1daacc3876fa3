"""Exact roots of groups that are ratios of quadratics in their one unknown (docs/design.md §3.6).

A rational-quadratic spline's piece ``y = y_k + (y_{k+1} - y_k)(s ξ² + d_k ξ(1 - ξ)) /
(s + (d_{k+1} + d_k - 2s) ξ(1 - ξ))`` with ξ affine in x, a Möbius map ``(a x + b) / (c x +
d)``, an affine map: each element's output is P(u) / Q(u) with P and Q of degree at most two
in the unknown u, coefficients computed from what is known. `quadratic_roots` finds that form
by running the group's equations on polynomial coefficients (``+ - * /``, integer powers,
negation, casts: any other step, or a degree past two, and it declines), and returns the two
roots of ``y Q(u) - P(u) = 0`` per element: the stable formula; the linear root where the
quadratic term vanishes; where there is no real root, the vertex, where the residual is least.
Newton's step (`nonlinear`) takes them as its starts and polishes them once; the choice step's
consistency picks the root inside the piece's bin, and the residual check stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jaxrev._compat import Literal, prims
from jaxrev._evaluate import apply
from jaxrev._graph import is_var, real_outvars

__all__ = ["quadratic_roots"]

MAX_DEGREE = 2

Poly = tuple  # coefficients, lowest degree first (arrays or Python numbers)


class _Rat:
    """P(u) / Q(u); Q None means 1."""

    __slots__ = ("p", "q")

    def __init__(self, p: Poly, q: Poly | None = None) -> None:
        self.p, self.q = p, q


class _Declined(Exception):
    pass


def _padd(a: Poly, b: Poly, sign: float = 1.0) -> Poly:
    n = max(len(a), len(b))
    a = a + (0,) * (n - len(a))
    b = b + (0,) * (n - len(b))
    return tuple(x + sign * y for x, y in zip(a, b))


def _pmul(a: Poly, b: Poly) -> Poly:
    if len(a) + len(b) - 2 > MAX_DEGREE:
        raise _Declined
    out: list = [0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            out[i + j] = out[i + j] + x * y
    return tuple(out)


def _q(r: _Rat) -> Poly:
    return (1,) if r.q is None else r.q


def _add(a: _Rat, b: _Rat, sign: float) -> _Rat:
    if a.q is None and b.q is None:
        return _Rat(_padd(a.p, b.p, sign))
    return _Rat(_padd(_pmul(a.p, _q(b)), _pmul(b.p, _q(a)), sign), _pmul(_q(a), _q(b)))


def _mul(a: _Rat, b: _Rat) -> _Rat:
    q = None if a.q is None and b.q is None else _pmul(_q(a), _q(b))
    return _Rat(_pmul(a.p, b.p), q)


def _div(a: _Rat, b: _Rat) -> _Rat:
    if b.q is None and len(b.p) == 1:  # by a known value
        return _Rat(tuple(x / b.p[0] for x in a.p), a.q)
    return _Rat(_pmul(a.p, _q(b)), _pmul(_q(a), b.p))


def _step(e: Any, ins: list) -> _Rat:
    p = e.primitive
    r = [x if isinstance(x, _Rat) else _Rat((x,)) for x in ins]
    if p is prims.add:
        return _add(r[0], r[1], 1.0)
    if p is prims.sub:
        return _add(r[0], r[1], -1.0)
    if p is prims.mul:
        return _mul(r[0], r[1])
    if p is prims.div:
        return _div(r[0], r[1])
    if p is prims.neg:
        return _Rat(tuple(-x for x in r[0].p), r[0].q)
    if p is prims.integer_pow:
        n, base = e.params["y"], r[0]
        out = _Rat((1,))
        for _ in range(abs(n)):
            out = _mul(out, base)
        return _div(_Rat((1,)), out) if n < 0 else out
    if p in (prims.convert_element_type, prims.copy) and len(ins) == 1:
        if p is prims.convert_element_type and not jnp.issubdtype(
            e.params["new_dtype"], jnp.inexact
        ):
            raise _Declined
        return r[0]
    raise _Declined


def quadratic_roots(
    eqns: Sequence[Any],
    unknown: Any,
    output: Any,
    reads: Sequence[Any],
    read_vals: Sequence[Any],
    y: Any,
) -> tuple[Any, Any] | None:
    """The two roots u of ``F(u) = y`` per element, where the equations `eqns` compute
    `output` from `unknown` (and the known `reads`) as P(u) / Q(u) of degree two at most;
    None where they do not."""
    vals: dict = dict(zip(reads, read_vals))
    vals[unknown] = _Rat((0, 1))
    try:
        for e in eqns:
            ins = [
                v.val if isinstance(v, Literal) else vals[v] if is_var(v) else v for v in e.invars
            ]
            outs = real_outvars(e)
            if len(outs) != 1:
                raise _Declined
            if not any(isinstance(x, _Rat) for x in ins):
                vals[outs[0]] = apply(e, ins)[0]
                continue
            vals[outs[0]] = _step(e, ins)
    except (_Declined, KeyError):
        return None
    out = vals.get(output)
    if not isinstance(out, _Rat):
        return None
    # y Q(u) - P(u) = c2 u^2 + c1 u + c0
    coef = _padd(_pmul((y,), _q(out)), out.p, -1.0)
    coef = coef + (0,) * (3 - len(coef))
    dt = jnp.result_type(y)
    c0, c1, c2 = (jnp.broadcast_to(jnp.asarray(c, dt), jnp.shape(y)) for c in coef)
    disc = c1 * c1 - 4 * c2 * c0
    root = jnp.sqrt(jnp.maximum(disc, 0))
    qq = -0.5 * (c1 + jnp.where(c1 >= 0, root, -root))
    flat = c2 == 0
    lin = -c0 / jnp.where(c1 == 0, jnp.nan, c1)
    r1 = jnp.where(flat, lin, qq / jnp.where(flat, 1, c2))
    r2 = jnp.where(flat, lin, c0 / jnp.where(qq == 0, jnp.nan, qq))
    # no real root (the output is outside the map's range): the vertex, where the residual
    # is least, so that the check reports how far the output is
    vertex = -c1 / (2 * jnp.where(flat, 1, c2))
    none = (disc < 0) & ~flat
    return jnp.where(none, vertex, r1), jnp.where(none, vertex, r2)
