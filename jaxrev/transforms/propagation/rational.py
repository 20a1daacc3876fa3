"""Exact roots of groups that are ratios of quadratics in their one unknown, or of one square
root of a quadratic (docs/design.md §3.6).

A rational-quadratic spline's piece ``y = y_k + (y_{k+1} - y_k)(s ξ² + d_k ξ(1 - ξ)) /
(s + (d_{k+1} + d_k - 2s) ξ(1 - ξ))`` with ξ affine in x, a Möbius map ``(a x + b) / (c x +
d)``, an affine map, and the same spline's inverse as flowjax and Durkan et al. write it,
``ξ = 2c / (-b - sqrt(b² - 4ac))`` with a, b, c affine in y: each element's output lies in
the field of ratios of polynomials in the unknown u and one radical t = √S(u), ``F(u) = (N₀(u)
+ N₁(u) t) / (D₀(u) + D₁(u) t)`` (t² = S reduces every product to that form). `quadratic_roots`
finds that form by running the group's equations on polynomial coefficients (``+ - * /``,
integer powers, squares, negation, casts, ``sqrt`` of one argument: any other
step, a second radical, or a degree past `MAX_DEGREE`, and it declines). ``F(u) = y`` is
``N₀ - y D₀ = (y D₁ - N₁) t``; without a radical that is a polynomial equation, with one its
square ``(N₀ - y D₀)² - S (y D₁ - N₁)² = 0`` is (squaring adds the roots of the conjugate
branch, -t, and a spline's inverse gains its bin's left knot, c = 0: the residual check drops
them). Where that equation has degree two at most, its two roots are returned per element:
the stable formula; the linear root where the quadratic term vanishes; where there is no real
root, the vertex, where the residual is least. Newton's step (`nonlinear`) takes them as its
starts and polishes them once; the choice step's consistency picks the root inside the
piece's bin, and the residual check stays.
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
"""Degree of the equation whose roots are taken."""
MAX_INNER_DEGREE = 4
"""Degree of the polynomials met on the way (a product with the radical's argument)."""

Poly = tuple  # coefficients, lowest degree first (arrays or Python numbers); () is zero


class _Declined(Exception):
    pass


def _padd(a: Poly, b: Poly, sign: float = 1.0) -> Poly:
    n = max(len(a), len(b))
    a = a + (0,) * (n - len(a))
    b = b + (0,) * (n - len(b))
    return tuple(x + sign * y for x, y in zip(a, b))


def _pmul(a: Poly, b: Poly) -> Poly:
    if not a or not b:
        return ()
    if len(a) + len(b) - 2 > MAX_INNER_DEGREE:
        raise _Declined
    out: list = [0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            out[i + j] = out[i + j] + x * y
    return tuple(out)


def _pscale(a: Poly, c: Any) -> Poly:
    return tuple(x * c for x in a)


class _Surd:
    """A + B t, with t the group's radical √S (B = () without one)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Poly, b: Poly = ()) -> None:
        self.a, self.b = a, b

    def plus(self, o: _Surd, sign: float = 1.0) -> _Surd:
        return _Surd(_padd(self.a, o.a, sign), _padd(self.b, o.b, sign))

    def times(self, o: _Surd, s: Poly | None) -> _Surd:
        a = _pmul(self.a, o.a)
        bb = _pmul(self.b, o.b)
        if bb:
            if s is None:  # (a radical part without a radical cannot arise)
                raise _Declined
            a = _padd(a, _pmul(bb, s))
        return _Surd(a, _padd(_pmul(self.a, o.b), _pmul(self.b, o.a)))

    def neg(self) -> _Surd:
        return _Surd(_pscale(self.a, -1), _pscale(self.b, -1))


_ONE = _Surd((1,))


class _Rat:
    """num / den, two `_Surd`s in the unknown u."""

    __slots__ = ("num", "den")

    def __init__(self, num: _Surd, den: _Surd = _ONE) -> None:
        self.num, self.den = num, den


class _Field:
    """Arithmetic on `_Rat`s, holding the group's one radical: S, and the variable it is
    the square root of."""

    def __init__(self) -> None:
        self.s: Poly | None = None
        self.of: Any = None

    def add(self, x: _Rat, y: _Rat, sign: float) -> _Rat:
        if x.den is _ONE and y.den is _ONE:
            return _Rat(x.num.plus(y.num, sign))
        num = x.num.times(y.den, self.s).plus(y.num.times(x.den, self.s), sign)
        return _Rat(num, x.den.times(y.den, self.s))

    def mul(self, x: _Rat, y: _Rat) -> _Rat:
        den = _ONE if x.den is _ONE and y.den is _ONE else x.den.times(y.den, self.s)
        return _Rat(x.num.times(y.num, self.s), den)

    def div(self, x: _Rat, y: _Rat) -> _Rat:
        if y.den is _ONE and len(y.num.a) == 1 and not y.num.b:  # by a known value
            c = y.num.a[0]
            return _Rat(_Surd(_pscale(x.num.a, 1 / c), _pscale(x.num.b, 1 / c)), x.den)
        return _Rat(x.num.times(y.den, self.s), x.den.times(y.num, self.s))

    def sqrt(self, x: _Rat, var: Any) -> _Rat:
        """√x for x a polynomial (over a known value): the radical t, a second one declines."""
        if x.num.b or x.den.b or len(x.den.a) > 1:
            raise _Declined
        if self.s is not None and var is not self.of:
            raise _Declined
        c = x.den.a[0] if x.den.a else 1
        self.s, self.of = _pscale(x.num.a, 1 / c), var
        return _Rat(_Surd((), (1,)))

    def step(self, e: Any, ins: list) -> _Rat:
        p = e.primitive
        r = [x if isinstance(x, _Rat) else _Rat(_Surd((x,))) for x in ins]
        if p is prims.add:
            return self.add(r[0], r[1], 1.0)
        if p is prims.sub:
            return self.add(r[0], r[1], -1.0)
        if p is prims.mul:
            return self.mul(r[0], r[1])
        if p is prims.div:
            return self.div(r[0], r[1])
        if p is prims.neg:
            return _Rat(r[0].num.neg(), r[0].den)
        if p is prims.square:
            return self.mul(r[0], r[0])
        if p is prims.sqrt:
            return self.sqrt(r[0], e.invars[0])
        if p is prims.integer_pow:
            n, base = e.params["y"], r[0]
            out = _Rat(_ONE)
            for _ in range(abs(n)):
                out = self.mul(out, base)
            return self.div(_Rat(_ONE), out) if n < 0 else out
        if p in (prims.convert_element_type, prims.copy) and len(ins) == 1:
            if p is prims.convert_element_type and not jnp.issubdtype(
                e.params["new_dtype"], jnp.inexact
            ):
                raise _Declined
            return r[0]
        raise _Declined

    def equation(self, out: _Rat, y: Any) -> Poly:
        """The polynomial in u whose roots hold F(u) = y (with the conjugate's, squared)."""
        lhs = _padd(out.num.a, _pscale(out.den.a, y), -1.0)  # N0 - y D0
        rad = _padd(_pscale(out.den.b, y), out.num.b, -1.0)  # y D1 - N1
        if not out.num.b and not out.den.b:
            return _pscale(lhs, -1)
        if self.s is None:
            raise _Declined
        return _padd(_pmul(lhs, lhs), _pmul(_pmul(rad, rad), self.s), -1.0)


def quadratic_roots(
    eqns: Sequence[Any],
    unknown: Any,
    output: Any,
    reads: Sequence[Any],
    read_vals: Sequence[Any],
    y: Any,
) -> tuple[Any, Any] | None:
    """The two roots u of ``F(u) = y`` per element, where the equations `eqns` compute
    `output` from `unknown` (and the known `reads`) in the form the module describes, with an
    equation of degree two at most; None where they do not."""
    vals: dict = dict(zip(reads, read_vals))
    vals[unknown] = _Rat(_Surd((0, 1)))
    field = _Field()
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
            vals[outs[0]] = field.step(e, ins)
        out = vals.get(output)
        if not isinstance(out, _Rat):
            return None
        coef = field.equation(out, y)
    except (_Declined, KeyError):
        return None
    if len(coef) > MAX_DEGREE + 1:
        return None
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
