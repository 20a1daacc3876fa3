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

from jaxrev._compat import JaxprEqn, ShapedArray, as_closed, is_concrete, literal, prims
from jaxrev._env import Env, is_unknown
from jaxrev._errors import ReversibilityError, at_eqn, not_invertible
from jaxrev._evaluate import apply, eval_closed
from jaxrev.transforms.custom import custom_inverse
from jaxrev.transforms.knowledge import regions as R
from jaxrev.transforms.knowledge.checks import raise_where
from jaxrev.transforms.knowledge.elements import learn, region_of, static_of, value_of
from jaxrev.transforms.knowledge.signs import nonnegative
from jaxrev.transforms.registry import (
    BILINEAR,
    ELEMENTWISE,
    LINEAR,
    SMOOTH,
    STRUCTURAL,
    ChoiceRule,
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


def _mul(out, x, y, **_):
    if is_unknown(x) and not is_unknown(y):
        check_nonzero(y, "the known factor")
        return [out / y, None]
    if is_unknown(y) and not is_unknown(x):
        check_nonzero(x, "the known factor")
        return [None, out / x]
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


def _mul_backward(eqn: JaxprEqn, env: Env) -> bool | None:
    z = _zero_factor(eqn, env)
    (o,) = eqn.outvars
    if z is None:
        return None
    k, nonzero = z
    a = eqn.invars[k]
    if env.known(a) or tuple(a.aval.shape) != tuple(o.aval.shape):
        return None
    ro = region_of(env, o)
    if R.implies(R.mask_region(nonzero), ro):
        # the output is known only where the factor is zero (forward, whatever the operand):
        # nothing to invert, and nothing lost here
        env.losses[eqn] = None
        return False
    b = jnp.where(jnp.asarray(nonzero), env.read(eqn.invars[1 - k]), 1)
    region = R.union(ro, R.mask_region(~nonzero), env.info)
    # where the factor is zero the operand is lost, unless another equation gives it back
    env.losses[eqn] = Lossy("the known factor is zero, which destroys the value", singular=True)
    return learn(env, a, value_of(env, o, clean=True) / b, region)


define(
    prims.mul,
    inverse=_mul,
    element=ElementRule(_mul_forward, _mul_backward),
    kind=(ELEMENTWISE, BILINEAR),
)


def _div(out, x, y, **_):
    if is_unknown(x) and not is_unknown(y):
        check_nonzero(y, "the known divisor")
        return [out * y, None]
    if is_unknown(y) and not is_unknown(x):
        check_nonzero(x, "the known numerator")
        return [None, x / out]
    return None


define(prims.div, inverse=_div, kind=(ELEMENTWISE, SMOOTH))


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
    eqn, who = ctx.eqn, ctx.walk.who
    raise_where(
        ctx.walk.on_error,
        lambda o: (
            None
            if not np.any(o)
            else at_eqn(
                ReversibilityError,
                eqn,
                "a negative output of a power that is never negative (the "
                "exponent is not an odd integer) is outside the map's range",
                "Ways out: check the input, or pass on_error='nan'.",
                who=who,
                group=False,
            )
        ),
        outside,
        bad=jnp.any(outside),
    )
    root = jnp.where(outside, jnp.nan, root)
    return root if is_concrete(p) else jnp.where(zero | even, jnp.nan, root)


def _pow_exponent(out: Any, x: Any, ctx: Any) -> Any:
    """p from ``out = x ** p`` with the base known: log|out| / log|x| (a negative base gives a
    finite power only for an integer p, whose |x|**p is |out|). A base of 0 or ±1 loses it."""
    lost = lambda b: (b == 0) | (jnp.abs(b) == 1)  # noqa: E731
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


def _convert(out, x, *, new_dtype, **_):
    old = x.aval.dtype
    if old == new_dtype or np.can_cast(old, new_dtype, "safe"):
        return [lax.convert_element_type(out, old)]
    raise Lossy(
        f"converting {np.dtype(old).name} to {np.dtype(new_dtype).name} loses "
        "precision (only widening conversions are invertible)"
    )


define(prims.convert_element_type, inverse=_convert, kind=(ELEMENTWISE, LINEAR))


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


define(prims.cumsum, inverse=_cumsum, logdet=_cumsum_logdet, kind=(LINEAR,))


def _real(out, x, **_):
    raise Lossy("the real part drops the imaginary part")


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
    inv_kernel = _kernel_of(jnp.linalg.inv(M), kernel.shape, rhs_spec)
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
    s, la = jnp.linalg.slogdet(M)
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
    getattr(prims, "not"),
    prims.xor,
    prims.is_finite,
):
    define(_p, kind=(ELEMENTWISE,))

# smooth but not one-to-one: only a group of equations around them can be invertible
for _p in (prims.sin, prims.cos, prims.tan, prims.square):
    define(_p, kind=(ELEMENTWISE, SMOOTH))

for _p in (prims.reduce_sum, prims.imag):
    define(_p, kind=(LINEAR,))
