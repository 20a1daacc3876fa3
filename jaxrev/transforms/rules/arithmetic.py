"""Inverse rules of the primitives of `jax.lax` (loops and branches have modules of their own).

Each rule follows JAX's transpose convention: ``rule(out, *invals, **params)`` where `out` is
the output value (a list for multiple-result primitives), an input not yet known is an
`Unknown` (carrying its aval), and the rule returns one entry per input: the recovered value or
None. A rule raises `Lossy` when the step destroys information (the walker turns it into a
`NotInvertibleError` naming the primitive and the user's line) and `NeedMore` (or returns only
Nones) when it may succeed once more inputs are known.

Every rule is registered by the `define` call right after it, which also tags the primitive
(elementwise, linear, bilinear) for the walker's group steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxrev._dense as dense
from jaxrev._compat import JaxprEqn, ShapedArray, as_closed, is_concrete, literal, prims
from jaxrev._env import Env, is_unknown
from jaxrev._errors import ReversibilityError, at_element, at_eqn, not_invertible
from jaxrev._evaluate import apply, eval_closed
from jaxrev.transforms.custom import custom_inverse
from jaxrev.transforms.knowledge import regions as R
from jaxrev.transforms.knowledge.checks import raise_where
from jaxrev.transforms.knowledge.elements import (
    along_axes_forward,
    learn,
    region_of,
    static_of,
    value_of,
)
from jaxrev.transforms.knowledge.signs import nonnegative
from jaxrev.transforms.registry import (
    BILINEAR,
    ELEMENTWISE,
    LINEAR,
    SMOOTH,
    STRUCTURAL,
    ChoiceRule,
    ElementResult,
    ElementRule,
    LogdetContext,
    Lossy,
    NeedMore,
    Unsupported,
    define,
)

__all__ = ["check_nonzero"]


# --------------------------------------------------------------------------- arithmetic


def check_nonzero(v: Any, what: str) -> None:
    if is_concrete(v) and np.any(np.asarray(v) == 0):
        raise Lossy(f"{what} is zero, which destroys the value", singular=True)


def _add(out, x, y, **_):
    if is_unknown(x) and not is_unknown(y):
        return [out - y, None]
    if is_unknown(y) and not is_unknown(x):
        return [None, out - x]
    return None


define(prims.add, inverse=_add, kind=(ELEMENTWISE, LINEAR))
define(prims.add_any, inverse=_add, kind=(ELEMENTWISE, LINEAR))


def _sub(out, x, y, **_):
    if is_unknown(x) and not is_unknown(y):
        return [out + y, None]
    if is_unknown(y) and not is_unknown(x):
        return [None, x - out]
    return None


define(prims.sub, inverse=_sub, kind=(ELEMENTWISE, LINEAR))


_WHOLE = "an integer's image is checked whole, not on some of its elements"
"""Why an integer step's inverse rule waits for its whole output (element-level propagation
applies a rule on a partly known output, without the walk's context)."""


def _mul(out, x, y, *, ctx=None, **_):
    # (element-level propagation applies the rule on a partly known output, without `ctx`:
    # an integer product is checked whole, by the walk, not on some of its elements)
    if ctx is None and _exact(out):
        raise NeedMore(_WHOLE)
    if is_unknown(x) and not is_unknown(y):
        check_nonzero(y, "the known factor")
        return [_quotient(out, y, ctx) if _exact(out) else out / y, None]
    if is_unknown(y) and not is_unknown(x):
        check_nonzero(x, "the known factor")
        return [None, _quotient(out, x, ctx) if _exact(out) else out / x]
    return None


def _zero_factor(eqn: JaxprEqn, env: Env) -> tuple[int, np.ndarray] | None:
    """The operand (0 or 1) whose other factor is known, static and has zeros."""
    for k in (0, 1):
        b = eqn.invars[1 - k]
        if not env.known(b):
            continue
        s = static_of(env, b)
        if s is not None and np.any(np.asarray(s) == 0):
            return k, np.broadcast_to(np.asarray(s) != 0, tuple(eqn.outvars[0].aval.shape))
    return None


def _mul_forward(eqn: JaxprEqn, env: Env) -> bool | None:
    z = _zero_factor(eqn, env)
    (o,) = eqn.outvars
    if z is None or env.known(o):
        return None
    k, nonzero = z
    a = eqn.invars[k]
    if env.known(a):
        return None
    ra = region_of(env, a)
    if tuple(a.aval.shape) != tuple(o.aval.shape):
        ra = R.FULL if ra != R.EMPTY else R.EMPTY
    region = R.intersect(ra, R.mask_region(nonzero), env.info)
    vals = [None, None]
    vals[k] = (
        jnp.zeros(a.aval.shape, a.aval.dtype)
        if region_of(env, a) == R.FULL
        else value_of(env, a, clean=True)
    )
    vals[1 - k] = env.read(eqn.invars[1 - k])
    return learn(env, o, apply(eqn, vals)[0], region)


def _mul_backward(eqn: JaxprEqn, env: Env) -> bool | ElementResult | None:
    z = _zero_factor(eqn, env)
    (o,) = eqn.outvars
    if z is None:
        return None
    k, nonzero = z
    a = eqn.invars[k]
    if env.known(a) or tuple(a.aval.shape) != tuple(o.aval.shape) or _exact(o.aval):
        return None  # (an integer product inverts whole, by `_mul`'s checked quotient)
    ro = region_of(env, o)
    if R.implies(R.mask_region(nonzero), ro):
        # the output is known only where the factor is zero (forward, whatever the operand):
        # nothing to invert, and nothing lost here
        return ElementResult(False, {eqn: None})
    b = jnp.where(jnp.asarray(nonzero), env.read(eqn.invars[1 - k]), 1)
    region = R.union(ro, R.mask_region(~nonzero), env.info)
    # where the factor is zero the operand is lost, unless another equation gives it back
    lost = Lossy("the known factor is zero, which destroys the value", singular=True)
    return ElementResult(learn(env, a, value_of(env, o, clean=True) / b, region), {eqn: lost})


define(
    prims.mul,
    inverse=_mul,
    element=ElementRule(_mul_forward, _mul_backward),
    kind=(ELEMENTWISE, BILINEAR),
    walks=True,
)


def _div(out, x, y, *, ctx=None, **_):
    if _exact(out):
        if ctx is None:  # (element-level propagation: integers are inverted whole, as `_mul`)
            raise NeedMore(_WHOLE)
        return _integer_div(out, x, y, ctx)
    if is_unknown(x) and not is_unknown(y):
        check_nonzero(y, "the known divisor")
        return [out * y, None]
    if is_unknown(y) and not is_unknown(x):
        check_nonzero(x, "the known numerator")
        return [None, x / out]
    return None


define(prims.div, inverse=_div, kind=(ELEMENTWISE, SMOOTH), walks=True)


# --------------------------------------------------------------------------- integers
# JAX's integers wrap around (arithmetic modulo 2**bits). Sums, differences, negation, `xor`
# and `not` are one-to-one there and invert exactly. A product by c (a left shift by s: by
# 2**s) is inverted to the preimage that does not overflow, which exists where the output is
# a multiple of c: elsewhere the output is outside the map's image (an overflowing preimage of
# an odd c is not sought: a program that overflows forward is not recovered), and the check
# raises under every `on_error`, since an integer has no NaN to show a failure. A division, a
# right shift or a remainder loses the low part, and is refused.


def _exact(x: Any) -> bool:
    """Whether `x` (a value or an aval) holds integers or booleans."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = jnp.result_type(x)
    return not jnp.issubdtype(dtype, jnp.inexact)


def _outside_range(ctx: Any, outside: Any, what: str, hint: str, *, always: bool = False) -> None:
    """Raise where a step's output has no preimage (`outside`), naming the first such element:
    eagerly at once, under `jit` when the program runs; `always`: under every `on_error` (a
    step that has no NaN to leave there)."""
    eqn, who = ctx.eqn, ctx.walk.who
    raise_where(
        ctx.walk.on_error,
        lambda o: (
            None
            if not np.any(o)
            else at_eqn(
                ReversibilityError, eqn, f"{what}{at_element(o)}", hint, who=who, group=False
            )
        ),
        outside,
        bad=jnp.any(outside),
        always=always,
    )


def _outside_image(ctx: Any, outside: Any, what: str) -> None:
    """`_outside_range` of an integer step, under every `on_error` (an integer has no NaN)."""
    _outside_range(
        ctx,
        outside,
        f"the output is outside the image of the integer step ({what})",
        "Ways out: check the input, or compute the step in floating point.",
        always=True,
    )


def _quotient(out: Any, c: Any, ctx: Any) -> Any:
    """x from ``out = x * c`` in integers: ``out / c`` where c divides it (a product by ±1 is
    undone exactly, overflow included); raises where it does not."""
    out = jnp.asarray(out)
    unit = (c == 1) | (c == -1)
    if is_concrete(c) and np.all(np.asarray(unit)):
        return out * c  # c * c = 1
    zero = c == 0
    divisor = jnp.where(zero | unit, 2, c).astype(out.dtype)  # no overflow, no zero
    outside = ~unit & (zero | (jnp.remainder(out, divisor) != 0))
    _outside_image(ctx, outside, "no multiple of the known factor")
    return jnp.where(unit, out * c, jnp.floor_divide(out, divisor))


def _integer_div(out: Any, x: Any, y: Any, ctx: Any) -> list | None:
    """Integer division (`lax.div` truncates) by ±1 is a product by it; by anything else it
    loses the remainder; a divisor is not determined by its quotient."""
    if is_unknown(y) and not is_unknown(x):
        raise Lossy("an integer divisor is not determined by the quotient")
    if not (is_unknown(x) and not is_unknown(y)):
        return None
    if is_concrete(y):
        if np.all(np.abs(np.asarray(y)) == 1):
            return [jnp.asarray(out) * y, None]
        raise Lossy("integer division loses the remainder (only a divisor of ±1 is one-to-one)")
    _outside_image(ctx, (y != 1) & (y != -1), "division by a divisor other than ±1")
    return [jnp.asarray(out) * y, None]


def _shift_left(out, x, s, *, ctx=None, **_):
    """x from ``out = x << s``: the product by 2**s, undone by a right shift where the low s
    bits of the output are zero (and 0 <= s < bits)."""
    if ctx is None:
        raise NeedMore(_WHOLE)  # (as `_mul`)
    if not (is_unknown(x) and not is_unknown(s)):
        if is_unknown(s):
            raise Lossy("a shift's amount is not determined by the shifted value")
        return None
    out = jnp.asarray(out)
    bits = jnp.iinfo(out.dtype).bits
    right = (
        lax.shift_right_logical
        if jnp.issubdtype(out.dtype, jnp.unsignedinteger)
        else (lax.shift_right_arithmetic)
    )
    s = jnp.broadcast_to(jnp.asarray(s, out.dtype), out.shape)
    back = right(out, s)
    outside = (s < 0) | (s >= bits) | (lax.shift_left(back, s) != out)
    _outside_image(ctx, outside, "the low bits a left shift sets to zero are not zero")
    return [back, None]


define(prims.shift_left, inverse=_shift_left, kind=(ELEMENTWISE,), walks=True)


def _drops(reason: str) -> Callable:
    """The rule of a step that always loses its input: it says what it loses."""

    def rule(out, *ins, **_):
        raise Lossy(reason)

    return rule


define(
    prims.shift_right_arithmetic,
    inverse=_drops("a right shift drops the low bits"),
    kind=(ELEMENTWISE,),
)
define(
    prims.shift_right_logical,
    inverse=_drops("a right shift drops the low bits"),
    kind=(ELEMENTWISE,),
)
define(prims.rem, inverse=_drops("a remainder drops the quotient"), kind=(ELEMENTWISE,))


def _xor(out, x, y, **_):
    """``x ^ c`` is its own inverse."""
    if is_unknown(x) and not is_unknown(y):
        dtype = x.aval.dtype
        return [lax.bitwise_xor(jnp.asarray(out, dtype), jnp.asarray(y, dtype)), None]
    if is_unknown(y) and not is_unknown(x):
        dtype = y.aval.dtype
        return [None, lax.bitwise_xor(jnp.asarray(out, dtype), jnp.asarray(x, dtype))]
    return None


define(prims.xor, inverse=_xor, kind=(ELEMENTWISE,))


def _not(out, x, **_):
    return [
        lax.bitwise_not(jnp.asarray(out, x.aval.dtype))
    ]  # its own inverse, on integers and booleans


define(getattr(prims, "not"), inverse=_not, kind=(ELEMENTWISE,))


def _undone_by(inverse: Callable[[Any], Any], forward: Callable[[Any], Any]) -> custom_inverse:
    """`inverse` as one step that carries its own inverse, `forward`. An inverse written with
    a value used twice (`y * y`) would not invert again, and `reverse(reverse(f))` must."""
    step = custom_inverse(inverse)
    step.definverse(forward)
    return step


def _unary(inverse: Callable[[Any], Any]):
    def rule(out, x, **_):
        return [inverse(out)]

    return rule


# one-to-one elementwise maps and their inverses; the linear ones also join linear lumps
for _p, _inv, _kind in [
    (prims.neg, lambda y: -y, (ELEMENTWISE, LINEAR)),
    (prims.exp, jnp.log, (ELEMENTWISE,)),
    (prims.log, jnp.exp, (ELEMENTWISE,)),
    (prims.exp2, jnp.log2, (ELEMENTWISE,)),
    (prims.log1p, jnp.expm1, (ELEMENTWISE,)),
    (prims.expm1, jnp.log1p, (ELEMENTWISE,)),
    (prims.tanh, jnp.arctanh, (ELEMENTWISE,)),
    (prims.atanh, jnp.tanh, (ELEMENTWISE,)),
    (prims.sinh, jnp.arcsinh, (ELEMENTWISE,)),
    (prims.asinh, jnp.sinh, (ELEMENTWISE,)),
    (prims.erf, lax.erf_inv, (ELEMENTWISE,)),
    (prims.erf_inv, lax.erf, (ELEMENTWISE,)),
    (
        prims.logistic,
        _undone_by(lambda y: jnp.log(y) - jnp.log1p(-y), lax.logistic),
        (ELEMENTWISE,),
    ),
    (prims.sqrt, _undone_by(lambda y: y * y, lax.sqrt), (ELEMENTWISE,)),
    (prims.rsqrt, _undone_by(lambda y: 1 / (y * y), lax.rsqrt), (ELEMENTWISE,)),
    (prims.cbrt, _undone_by(lambda y: y * y * y, lax.cbrt), (ELEMENTWISE,)),
    (prims.conj, jnp.conj, (ELEMENTWISE, LINEAR)),
    (prims.copy, lambda y: y, (ELEMENTWISE, LINEAR)),
]:
    define(_p, inverse=_unary(_inv), kind=(*_kind, SMOOTH))

# the value passes through (numpyro's `x + stop_gradient(clip(x) - x)`); no derivative, so no
# Newton step or linear lump reads through it
define(prims.stop_gradient, inverse=_unary(lax.stop_gradient), kind=(ELEMENTWISE,))


_SIGN_HINT = (
    "Ways out: keep the sign in the state, use an odd power, or make the base "
    "visibly non-negative (exp, abs, softplus, or a check such as Equinox's "
    "`error_if(x, x < 0, ...)` before the power)."
)


def _integer_pow(out, x, *, y, ctx, **_):
    out = jnp.asarray(out, x.aval.dtype)  # a Python scalar output (`x ** 3` of a float)
    if _exact(out):
        return [_integer_root(out, y, ctx)]
    complex_ = jnp.issubdtype(out.dtype, jnp.complexfloating)
    if y == 1:
        return [out]
    if y == -1:
        return [1 / out]
    if y == 3 and not complex_:
        return [lax.cbrt(out)]  # one primitive, so that the inverse is invertible again
    if y % 2 == 0:
        if not complex_ and nonnegative(ctx.eqn.invars[0], ctx.env):
            return [lax.sqrt(out) if y == 2 else out ** (1.0 / y)]
        raise Lossy(f"x**{y} loses the sign of x", _SIGN_HINT)
    if complex_:
        raise Lossy(f"x**{y} has {abs(y)} complex roots")
    r = jnp.abs(out) ** (1.0 / y)
    return [jnp.sign(out) * r]


def _integer_root(out: Any, y: int, ctx: Any) -> Any:
    """x from ``out = x ** y`` in integers: the root rounded from floating point, checked by
    raising it again (an even power keeps the sign only of a base known non-negative)."""
    if y == 1:
        return out
    if y < 1:
        raise Lossy(f"an integer's x**{y} is not one-to-one")
    if y % 2 == 0 and not nonnegative(ctx.eqn.invars[0], ctx.env):
        raise Lossy(f"x**{y} loses the sign of x", _SIGN_HINT)
    real = jnp.asarray(out, jnp.result_type(float))
    root = lax.convert_element_type(
        jnp.round(jnp.sign(real) * jnp.abs(real) ** (1.0 / y)), out.dtype
    )
    _outside_image(ctx, lax.integer_pow(root, y) != out, f"no integer's {y}th power")
    return root


define(prims.integer_pow, inverse=_integer_pow, kind=(ELEMENTWISE, SMOOTH), walks=True)


def _exponent_kind(p: Any) -> tuple[Any, Any, Any]:
    """Where the exponent `p` is zero, an even integer and an odd integer (NumPy arrays for a
    concrete `p`, traced ones otherwise)."""
    xp = np if is_concrete(p) else jnp
    p = xp.asarray(p)
    whole = (p == xp.round(p)) & xp.isfinite(p)
    half = xp.where(whole, p, 0) / 2
    even = whole & (half == xp.round(half))
    return p == 0, even & (p != 0), whole & ~even


def _pow_base(out: Any, x: Any, p: Any, ctx: Any) -> Any:
    """x from ``out = x ** p`` (`lax.pow`, a float exponent): the real root. An odd integer
    exponent keeps the sign (the root of |out| carries it); an even one loses it; any other
    exponent is defined on x >= 0 only (NaN elsewhere), where ``out ** (1 / p)`` is the one
    preimage."""
    if jnp.issubdtype(x.aval.dtype, jnp.complexfloating):
        if is_concrete(p) and np.all(np.abs(np.asarray(p)) == 1):
            return out ** (1.0 / p)
        raise Lossy("a complex base raised to a power has several roots")
    zero, even, odd = _exponent_kind(p)
    if nonnegative(ctx.eqn.invars[0], ctx.env):
        even = odd = False  # the non-negative root is the one preimage
    if is_concrete(p):
        if np.any(zero):
            raise Lossy("the known exponent is zero, which destroys the value", singular=True)
        if np.any(even):
            raise Lossy(f"x**{_show(p)} (an even integer exponent) loses the sign of x", _SIGN_HINT)
    else:
        eqn, who = ctx.eqn, ctx.walk.who
        bad = jnp.any(zero | even)
        raise_where(
            ctx.walk.on_error,
            lambda b: (
                None
                if not b
                else not_invertible(
                    eqn,
                    "the exponent (known only when the program runs) is zero or an even integer, "
                    "which loses the base's sign",
                    _SIGN_HINT,
                    who=who,
                )
            ),
            bad,
            bad=bad,
        )
    root = jnp.where(odd, jnp.sign(out) * jnp.abs(out) ** (1.0 / p), out ** (1.0 / p))
    # a power other than an odd one is never negative: a negative output is outside the map's
    # range (`y ** 2` would turn it into a finite, wrong base for p = 0.5)
    outside = ~np.asarray(odd) & (out < 0) if is_concrete(p) else ~odd & (out < 0)
    _outside_range(
        ctx,
        outside,
        "a negative output of a power that is never negative (the exponent is not an odd "
        "integer) is outside the map's range",
        "Ways out: check the input, or pass on_error='nan'.",
    )
    root = jnp.where(outside, jnp.nan, root)
    return root if is_concrete(p) else jnp.where(zero | even, jnp.nan, root)


def _pow_exponent(out: Any, x: Any, ctx: Any) -> Any:
    """p from ``out = x ** p`` with the base known: log|out| / log|x| (a negative base gives a
    finite power only for an integer p, whose |x|**p is |out|). A base of 0 or ±1 loses it."""
    lost = lambda b: (b == 0) | (abs(b) == 1)  # noqa: E731  (NumPy's on a concrete base)
    if is_concrete(x):
        if np.any(lost(np.asarray(x))):
            raise Lossy("the known base is 0 or ±1, whose powers lose the exponent", singular=True)
        return jnp.log(jnp.abs(out)) / jnp.log(jnp.abs(x))
    eqn, who = ctx.eqn, ctx.walk.who
    bad = jnp.any(lost(x))
    raise_where(
        ctx.walk.on_error,
        lambda b: (
            None
            if not b
            else not_invertible(
                eqn,
                "the base (known only when the program runs) is 0 or ±1, whose powers lose the "
                "exponent",
                who=who,
            )
        ),
        bad,
        bad=bad,
    )
    return jnp.where(lost(x), jnp.nan, jnp.log(jnp.abs(out)) / jnp.log(jnp.abs(x)))


def _show(p: Any) -> str:
    a = np.asarray(p)
    return repr(float(a)) if a.ndim == 0 else "p"


def _pow(out, x, p, *, ctx, **_):
    if is_unknown(x) and not is_unknown(p):
        return [_pow_base(jnp.asarray(out, x.aval.dtype), x, p, ctx), None]
    if is_unknown(p) and not is_unknown(x):
        return [None, _pow_exponent(out, x, ctx)]
    return None


define(prims.pow, inverse=_pow, kind=(ELEMENTWISE, SMOOTH), walks=True)


def _convert(out, x, *, new_dtype, ctx=None, **_):
    old = x.aval.dtype
    if old == new_dtype:
        return [out]
    if not _exact(old):
        if _exact(np.dtype(new_dtype)):
            raise Lossy(
                f"converting {np.dtype(old).name} to {np.dtype(new_dtype).name} rounds the value"
            )
        if np.can_cast(old, new_dtype, "safe"):
            return [lax.convert_element_type(out, old)]
        raise Lossy(
            f"converting {np.dtype(old).name} to {np.dtype(new_dtype).name} loses "
            "precision (only widening conversions are invertible)"
        )
    if ctx is None:
        raise NeedMore(_WHOLE)  # (as `_mul`)
    return [_to_exact(jnp.asarray(out), old, ctx)]


def _to_exact(out: Any, old: Any, ctx: Any) -> Any:
    """The integer (or boolean) of dtype `old` whose conversion gave `out`, checked: a float
    must be within a few ulps of an integer (rounding by the inverse of the float steps after
    it) that it holds exactly (|x| <= 2**(mantissa + 1)) and that `old` holds; an integer must
    convert back to itself."""
    if _exact(out):
        x = lax.convert_element_type(out, old)
        _outside_image(ctx, lax.convert_element_type(x, out.dtype) != out, "a narrowing cast")
        return x
    if jnp.issubdtype(out.dtype, jnp.complexfloating):
        out = jnp.where(jnp.imag(out) == 0, jnp.real(out), jnp.nan)
    fi = jnp.finfo(out.dtype)
    lo, hi = (0, 1) if old == np.bool_ else (jnp.iinfo(old).min, jnp.iinfo(old).max)
    whole = jnp.round(out)
    outside = (
        ~jnp.isfinite(out)
        | (jnp.abs(out - whole) > 64 * fi.eps * jnp.maximum(1.0, jnp.abs(out)))
        | (jnp.abs(whole) > 2.0 ** (fi.nmant + 1))
        | (whole < lo)
        | (whole > hi)
    )
    _outside_image(ctx, outside, "an integer cast to floating point: not an integer it holds")
    return lax.convert_element_type(jnp.where(outside, 0, whole), old)


define(prims.convert_element_type, inverse=_convert, kind=(ELEMENTWISE, LINEAR), walks=True)


def _reshape(out, x, *rest, **_):
    return [jnp.reshape(out, x.aval.shape)] + [None] * len(rest)


define(prims.reshape, inverse=_reshape, kind=(LINEAR, STRUCTURAL))
define(prims.squeeze, inverse=_reshape, kind=(LINEAR, STRUCTURAL))


def _transpose(out, x, *, permutation, **_):
    return [jnp.transpose(out, np.argsort(permutation))]


define(prims.transpose, inverse=_transpose, kind=(LINEAR, STRUCTURAL))


def _rev(out, x, *, dimensions, **_):
    return [lax.rev(out, dimensions)]


define(prims.rev, inverse=_rev, kind=(LINEAR, STRUCTURAL))


def _concatenate(out, *xs, dimension, **_):
    res, start = [], 0
    for x in xs:
        n = x.aval.shape[dimension]
        res.append(
            lax.slice_in_dim(out, start, start + n, axis=dimension) if is_unknown(x) else None
        )
        start += n
    return res


define(prims.concatenate, inverse=_concatenate, kind=(LINEAR, STRUCTURAL))


def _stack(out, *xs, axis, **_):
    return [
        lax.index_in_dim(out, k, axis, keepdims=False) if is_unknown(x) else None
        for k, x in enumerate(xs)
    ]


define(prims.stack, inverse=_stack, kind=(LINEAR, STRUCTURAL))


def _split(outs, x, *, axis, **_):
    if any(is_unknown(o) for o in outs):
        raise NeedMore("some pieces of the split are unknown")
    return [jnp.concatenate(outs, axis=axis)]


define(prims.split, inverse=_split, kind=(LINEAR, STRUCTURAL))


def _broadcast_in_dim(out, x, *dyn, shape, broadcast_dimensions, **_):
    # broadcasting is injective: read the operand back from one copy (a left inverse)
    idx = []
    for d in range(len(shape)):
        if d in broadcast_dimensions:
            k = broadcast_dimensions.index(d)
            idx.append(slice(None) if x.aval.shape[k] == shape[d] else slice(0, 1))
        else:
            idx.append(0)
    return [jnp.reshape(out[tuple(idx)], x.aval.shape)] + [None] * len(dyn)


define(prims.broadcast_in_dim, inverse=_broadcast_in_dim, kind=(LINEAR, STRUCTURAL))


def _cumsum(out, x, *, axis, reverse, **_):
    n = out.shape[axis]
    if reverse:
        shifted = lax.pad(
            lax.slice_in_dim(out, 1, n, axis=axis),
            jnp.zeros((), out.dtype),
            [(0, 1 if d == axis else 0, 0) for d in range(out.ndim)],
        )
    else:
        shifted = lax.pad(
            lax.slice_in_dim(out, 0, n - 1, axis=axis),
            jnp.zeros((), out.dtype),
            [(1 if d == axis else 0, 0, 0) for d in range(out.ndim)],
        )
    return [out - shifted]


def _cumsum_logdet(ctx: LogdetContext) -> tuple[Any, Any]:
    return jnp.ones((), ctx.dtype), jnp.zeros((), ctx.dtype)


define(
    prims.cumsum,
    inverse=_cumsum,
    logdet=_cumsum_logdet,
    element=ElementRule(along_axes_forward),
    kind=(LINEAR,),
)


# A cumulative product or log-sum-exp has no inverse rule of its own here; smooth, it may sit
# inside a group Newton's method solves (numpyro's `L1BallTransform`, a stick-breaking map
# ``t * pad(cumprod(1 - |t[:-1]|))``, triangular in its state)
for _cumulative in (prims.cumprod, prims.cumlogsumexp):
    define(_cumulative, element=ElementRule(along_axes_forward), kind=(SMOOTH,))

# Reductions and running extremes have no inverse (many operands, one value); what they give
# is element knowledge: an output element is known once every element it reads is (a
# softmax's max over a spline's bins, on the rows a masked network has computed)
for _p in (
    prims.reduce_max,
    prims.reduce_min,
    prims.reduce_prod,
    prims.reduce_and,
    prims.reduce_or,
    prims.argmax,
    prims.argmin,
    prims.cummax,
    prims.cummin,
):
    define(_p, element=ElementRule(along_axes_forward))


def _real(out, x, **_):
    raise Lossy("the real part drops the imaginary part", subspace=True)


define(prims.real, inverse=_real, kind=(LINEAR,))


def _complex(out, re, im, **_):
    return [jnp.real(out) if is_unknown(re) else None, jnp.imag(out) if is_unknown(im) else None]


define(prims.complex, inverse=_complex, kind=(LINEAR,))


def _conv_matrix(params: dict, kernel: Any) -> Any | None:
    """The (in, out) channel matrix of a 1x1 convolution that mixes channels only (Glow's
    invertible 1x1 convolution, Flax's `nn.Conv(kernel_size=(1, 1))`); None for any other."""
    rhs_spec = params["dimension_numbers"].rhs_spec  # (out, in, spatial...)
    spatial = rhs_spec[2:]
    if (
        params["feature_group_count"] != 1
        or params["batch_group_count"] != 1
        or any(kernel.shape[d] != 1 for d in spatial)
        or any(s != 1 for s in params["window_strides"])
        or any(d != 1 for d in (*params["lhs_dilation"], *params["rhs_dilation"]))
        or any(p != (0, 0) for p in params["padding"])
        or kernel.shape[rhs_spec[0]] != kernel.shape[rhs_spec[1]]
    ):
        return None
    K = jnp.squeeze(kernel, axis=tuple(spatial))  # its two axes in their kernel order
    return K if rhs_spec[1] < rhs_spec[0] else K.T


def _conv(out, x, kernel, **params):
    """out = conv(x, K) with K a known 1x1 channel mixing M: x = conv(out, inv(M))."""
    if not is_unknown(x) or is_unknown(kernel):
        return None
    M = _conv_matrix(params, kernel)
    if M is None:
        raise Lossy(
            "a convolution is inverted only as a 1x1 convolution mixing channels "
            "(kernel of spatial size 1, stride 1, no padding or dilation, as many "
            "output channels as input channels)"
        )
    rhs_spec = params["dimension_numbers"].rhs_spec
    # the inverse kernel holds inv(M) where the kernel holds M (in -> out)
    inv_kernel = _kernel_of(dense.inv(M), kernel.shape, rhs_spec)
    X = prims.conv.bind(jnp.asarray(out), inv_kernel, **params)
    if is_concrete(X) and not bool(jnp.all(jnp.isfinite(X))):
        raise Lossy("the 1x1 convolution's channel matrix is singular", singular=True)
    return [X, None]


def _kernel_of(M: Any, shape: tuple, rhs_spec: Sequence[int]) -> Any:
    """A 1x1 kernel of `shape` whose (in, out) matrix is `M`."""
    k = jnp.zeros(shape, M.dtype)
    idx = [0] * len(shape)
    i, o = np.meshgrid(np.arange(M.shape[0]), np.arange(M.shape[1]), indexing="ij")
    idx[rhs_spec[1]], idx[rhs_spec[0]] = i, o
    return k.at[tuple(idx)].set(M)


def _conv_logdet(ctx: LogdetContext) -> tuple[Any, Any]:
    """log|det M| once per pixel: the output's elements are the input's, channels mixed."""
    if ctx.recovered != [True, False]:
        raise Unsupported("a convolution recovering its kernel")
    M = _conv_matrix(ctx.eqn.params, ctx.invals[1])
    lhs_spec = ctx.eqn.params["dimension_numbers"].lhs_spec
    out_spec = ctx.eqn.params["dimension_numbers"].out_spec
    if M is None or lhs_spec != out_spec:
        # (the same layout in and out: the map is M applied per pixel, det(M) per pixel, in
        # any element order the two share)
        raise Unsupported(
            "a convolution other than a 1x1 channel mixing with the same layout in and out"
        )
    s, la = dense.slogdet(M)
    reps = int(np.prod(ctx.invals[0].shape, dtype=np.int64)) // M.shape[0]
    return s**reps, la * reps


define(prims.conv, inverse=_conv, logdet=_conv_logdet, kind=(BILINEAR,))


def _linear_solve(outs, *ins, const_lengths, jaxprs, **_):
    # x = A^{-1} b  inverts to  b = A x, with the matvec the solve carries
    n = sum(const_lengths)
    mv = ins[: const_lengths[0]]
    if any(is_unknown(c) for c in mv) or any(is_unknown(o) for o in outs):
        raise NeedMore("the solve's matrix or its solution is not known yet")
    b = eval_closed(as_closed(jaxprs[0]), *mv, *outs)
    return [None] * n + [bi if is_unknown(x) else None for bi, x in zip(b, ins[n:])]


define(prims.linear_solve, inverse=_linear_solve)


def _identity_multi(outs, *xs, **_):
    return [o if is_unknown(x) and not is_unknown(o) else None for o, x in zip(outs, xs)]


define(prims.optimization_barrier, inverse=_identity_multi)


def _identity(out, x, **_):
    return [out]


define(prims.sharding_constraint, inverse=_identity)


if prims.device_put is not None:
    define(
        prims.device_put,
        inverse=(_identity_multi if prims.device_put.multiple_results else _identity),
    )


# --------------------------------------------------------------------------- choices
# Piecewise primitives: each piece is a copy (or the negation) of an operand, picked by a
# comparison of the operands. Alone they lose information (relu is max(x, 0)); in a group
# they may not (softplus's max(x, 0) + log1p(exp(-|x|))): `choices` tries every piece.


def _piecewise_count(eqn: JaxprEqn, known: Any) -> int:
    return 2 if not all(known(v) for v in eqn.invars) else 0


def _operand(eqn: JaxprEqn, k: int) -> Any:
    return eqn.invars[k]


# (both branches hold at the tie, where they give the same value: a saturated branch, the
# constant of a clip, is then never the only consistent one; propagation/reach.py)
def _max_holds(eqn: JaxprEqn, ins: list, k: int) -> Any:
    return ins[0] >= ins[1] if k == 0 else ins[0] <= ins[1]


def _min_holds(eqn: JaxprEqn, ins: list, k: int) -> Any:
    return ins[0] <= ins[1] if k == 0 else ins[0] >= ins[1]


def _abs_branch(eqn: JaxprEqn, k: int) -> Any:
    return eqn.invars[0] if k == 0 else eqn.replace(primitive=prims.neg, params={})


def _abs_holds(eqn: JaxprEqn, ins: list, k: int) -> Any:
    return ins[0] >= 0 if k == 0 else ins[0] < 0


define(prims.max, choice=ChoiceRule(_piecewise_count, _operand, _max_holds), kind=(ELEMENTWISE,))
define(prims.min, choice=ChoiceRule(_piecewise_count, _operand, _min_holds), kind=(ELEMENTWISE,))
define(
    prims.abs,
    choice=ChoiceRule(lambda e, known: 0 if known(e.invars[0]) else 2, _abs_branch, _abs_holds),
    kind=(ELEMENTWISE,),
)


def _sign_branch(eqn: JaxprEqn, k: int) -> Any:
    dt = eqn.outvars[0].aval.dtype
    return literal(np.asarray(k - 1, dt), ShapedArray((), dt))


def _sign_holds(eqn: JaxprEqn, ins: list, k: int) -> Any:
    return (ins[0] < 0, ins[0] == 0, ins[0] > 0)[k]


# `sign(x) * c + a * x` (flowjax's LeakyTanh tails): each branch a constant -1, 0, 1 that the
# rest of the group then inverts around
define(
    prims.sign,
    choice=ChoiceRule(lambda e, known: 0 if known(e.invars[0]) else 3, _sign_branch, _sign_holds),
    kind=(ELEMENTWISE,),
)


# --------------------------------------------------------------------------- tags only
# Primitives with no inverse of their own that lumps may still see through.

for _p in (
    prims.floor,
    prims.ceil,
    prims.round,
    prims.eq,
    prims.ne,
    prims.lt,
    prims.le,
    prims.gt,
    prims.ge,
    getattr(prims, "and"),
    getattr(prims, "or"),
    prims.is_finite,
):
    define(_p, kind=(ELEMENTWISE,))

# smooth but not one-to-one: only a group of equations around them can be invertible
for _p in (prims.sin, prims.cos, prims.tan, prims.square):
    define(_p, kind=(ELEMENTWISE, SMOOTH))

define(prims.reduce_sum, element=ElementRule(along_axes_forward), kind=(LINEAR,))
define(prims.imag, kind=(LINEAR,))
