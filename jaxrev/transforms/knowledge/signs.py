"""What a walk knows of a value's sign when the program is traced: `nonnegative(v, env)`.

An even power loses the sign of its base, unless the base cannot be negative: ``exp(z) ** 2``,
``abs(x) ** 2.0``, or flowjax's ``Power``, whose ``x ** p`` follows Equinox's
``error_if(x, x < 0, ...)``: past that check the program returns only where ``x >= 0``. The
inverse rules of `integer_pow` and `pow` ask `nonnegative` of their base and take the
non-negative root there instead of refusing.

The facts come from the producers of a value (its equation, and theirs, a few levels up):
maps whose results are never negative (`exp`, `sqrt`, `abs`, `logistic`, even powers),
operations that keep signs (sums and products of non-negative values, moves of elements,
selects of non-negative cases), literals and values known at trace time, and a `cond` whose
other branches never return (a check: `ChoiceRule.fails`) passing its operand through, where
the branch that returns is taken only if no element is negative. "Non-negative" includes NaN
(a comparison with NaN is false): a NaN stays NaN through the root.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrev._compat import Literal, cond_branches, is_any_reduction, prims
from jaxrev._env import Env
from jaxrev._graph import is_var
from jaxrev.transforms.registry import choice_rules

__all__ = ["nonnegative"]

MAX_DEPTH = 32
"""How many producers up a sign is looked for."""


def _present(*ps: Any) -> frozenset:
    return frozenset(p for p in ps if p is not None)


_NEVER_NEGATIVE = _present(
    prims.exp, prims.exp2, prims.sqrt, prims.abs, prims.logistic, prims.rsqrt, prims.square
)
# the result is non-negative where all (data) operands are
_KEEP_ALL = _present(
    prims.add,
    prims.add_any,
    prims.min,
    prims.reduce_sum,
    prims.cumsum,
    prims.reshape,
    prims.broadcast_in_dim,
    prims.transpose,
    prims.squeeze,
    prims.rev,
    prims.copy,
    prims.concatenate,
    prims.slice,
    prims.pad,
    prims.reduce_precision,
    prims.convert_element_type,
    prims.mul,
    prims.div,
    prims.stack,
)
# only the first operand carries data (the rest are indices)
_KEEP_FIRST = _present(prims.dynamic_slice, prims.gather)


def nonnegative(v: Any, env: Env, depth: int = 0) -> bool:
    """Whether `v` (a jaxpr variable or literal of the walk `env`) is never negative where the
    program returns, as far as its producers tell when it is traced.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxrev._env import Env, Statics
        >>> j = jax.make_jaxpr(lambda z: jnp.exp(z) * 2.0)(1.0).jaxpr
        >>> nonnegative(j.outvars[0], Env(info=Statics(j)))
        True
    """
    if isinstance(v, Literal) or (is_var(v) and env.info.static(v) is not None):
        val = np.asarray(env.info.static(v))
        return bool(np.all(val >= 0)) if val.dtype.kind in "fiub" else False
    e = env.info.producer.get(v) if is_var(v) else None
    if e is None or depth > MAX_DEPTH:
        return False
    p, ins = e.primitive, e.invars
    if p in _NEVER_NEGATIVE:
        return True
    if p is prims.integer_pow:
        return e.params["y"] % 2 == 0 or nonnegative(ins[0], env, depth + 1)
    if p is prims.pow:
        q = env.info.static(ins[1])
        even = q is not None and bool(np.all((q == np.round(q)) & (np.round(q) % 2 == 0)))
        return even or nonnegative(ins[0], env, depth + 1)
    if p is prims.max:
        return any(nonnegative(u, env, depth + 1) for u in ins)
    if p in (prims.mul, prims.div) and ins[0] is ins[1] and is_var(ins[0]):
        return True  # x * x
    if p is prims.select_n:
        return all(nonnegative(u, env, depth + 1) for u in ins[1:])
    if p in _KEEP_FIRST:
        return nonnegative(ins[0], env, depth + 1)
    if p in _KEEP_ALL:
        return all(nonnegative(u, env, depth + 1) for u in ins)
    if p is prims.cond:
        return _guarded(e, v, env, depth)
    return False


def _guarded(e: Any, v: Any, env: Env, depth: int) -> bool:
    """A `cond` output that is an operand passed through by the only branch that returns
    (Equinox's ``error_if``): non-negative if the operand is, or if the index picks that
    branch only where no element of the operand is negative."""
    branches = cond_branches(e.params)
    rule = choice_rules.get(prims.cond)
    fails = [
        rule is not None and rule.fails is not None and rule.fails(e, k)
        for k in range(len(branches))
    ]
    live = [k for k, f in enumerate(fails) if not f]
    if len(live) != 1:
        return False
    b = branches[live[0]].jaxpr
    j = [k for k, o in enumerate(e.outvars) if o is v][0]
    out = b.outvars[j]
    if out not in b.invars:
        return False
    operand = e.invars[1 + b.invars.index(out)]
    if nonnegative(operand, env, depth + 1):
        return True
    # the branch that returns is 0 (index false) or 1 (index true), of a flag on the operand
    return live[0] in (0, 1) and _flags_negative(e.invars[0], operand, env, live[0] == 1, depth)


def _flags_negative(flag: Any, x: Any, env: Env, returns_if: bool, depth: int) -> bool:
    """Whether `flag` (a boolean or 0/1 integer scalar) equal to `returns_if` implies that
    no element of `x` is negative: the flag is (a conversion of) any(x < c) or any(x <= c)
    with c >= 0 static, or its negation, or an `or` of flags one of which is."""
    for _ in range(MAX_DEPTH):
        e = env.info.producer.get(flag) if is_var(flag) else None
        if e is None:
            return False
        p = e.primitive
        if p is prims.convert_element_type or is_any_reduction(p):
            flag = e.invars[0]
            continue
        if p is getattr(prims, "not"):
            flag, returns_if = e.invars[0], not returns_if
            continue
        if returns_if:  # the flag holds: nothing said of x
            return False
        if p is getattr(prims, "or"):
            return any(_flags_negative(u, x, env, False, depth + 1) for u in e.invars)
        a, b = e.invars
        if p in (prims.lt, prims.le) and a is x:
            bound = env.info.static(b)
        elif p in (prims.gt, prims.ge) and b is x:
            bound = env.info.static(a)
        else:
            return False
        # not (x < c) for c >= 0: x >= c >= 0 (or NaN)
        return bound is not None and bool(np.all(np.asarray(bound) >= 0))
    return False
