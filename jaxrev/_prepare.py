"""The jaxpr every walk sees: calls inlined, equal equations merged, `custom_vjp` calls replaced
by their primal computation, constants folded."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrev._compat import (
    CALL_PRIMITIVES,
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    as_closed,
    call_jaxpr,
    dce,
    has_user_frame,
    is_host_callback,
    new_var,
    prims,
)
from jaxrev._graph import is_var, mentions


def prepare(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The jaxpr every walk sees: call-like equations (`jit`, `custom_jvp_call`, ...) inlined,
    equations that compute the same value merged, and what no output needs dropped (`dce`).

    Inversion works across call boundaries this way: a linear lump or a `select_n` case split
    may span code inside and outside `jnp.where`'s or `jnp.cumsum`'s inner `jit`. Inner equations
    with no user frame of their own take the source line of the call that contains them. JAX
    does not merge duplicates (`f(z)` written twice, `x[:1]` and `x[0]`): merged, a value known
    once is known everywhere, and a nonlinear group sees `f(z)` as one unknown, not two. A
    loop's carry that no output reads (a log-det accumulated beside the state but not
    returned) is dead: carried, it would make the loop's final carry unknown to `reverse`.
    """
    jaxpr = closed.jaxpr
    consts = list(closed.consts)
    constvars = list(jaxpr.constvars)
    sub: dict[Var, Any] = {}

    def s(a: Any) -> Any:
        return sub.get(a, a) if isinstance(a, Var) else a

    eqns: list[JaxprEqn] = []
    seen: dict[tuple, JaxprEqn] = {}

    def inline(eqn: JaxprEqn, outer_src: Any) -> None:
        src = eqn.source_info if outer_src is None or has_user_frame(eqn) else outer_src
        taken = _taken_branch(eqn, s)
        if taken is not None:
            inner, operands = taken
        elif eqn.primitive not in CALL_PRIMITIVES:
            invars = [s(v) for v in eqn.invars]
            sig = _signature(eqn, invars)
            first = seen.get(sig) if sig is not None else None
            if first is not None:
                for o, f in zip(eqn.outvars, first.outvars):
                    if not isinstance(o, DropVar) and not isinstance(f, DropVar):
                        sub[o] = f
                if all(
                    isinstance(o, DropVar) or not isinstance(f, DropVar)
                    for o, f in zip(eqn.outvars, first.outvars)
                ):
                    return
            # fresh output variables: the same inner jaxpr may be inlined more than once
            outs = []
            for o in eqn.outvars:
                if isinstance(o, DropVar):
                    outs.append(o)
                else:
                    sub[o] = nv = new_var(o.aval)
                    outs.append(nv)
            new = eqn.replace(invars=invars, outvars=outs, source_info=src)
            eqns.append(new)
            if sig is not None and first is None:
                seen[sig] = new
            return
        else:
            inner, operands = call_jaxpr(eqn.params), eqn.invars
        ij = inner.jaxpr
        for v, c in zip(ij.constvars, inner.consts):
            sub[v] = nv = new_var(v.aval)
            constvars.append(nv)
            consts.append(c)
        outer_in = [s(a) for a in operands]
        for v, a in zip(ij.invars, outer_in):
            sub[v] = a
        for ie in ij.eqns:
            inline(ie, src)
        inner_out = [s(io) for io in ij.outvars]
        for o, io in zip(eqn.outvars, inner_out):
            if not isinstance(o, DropVar):
                sub[o] = io

    for eqn in jaxpr.eqns:
        inline(eqn, None)
    new = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=[s(v) for v in jaxpr.outvars])
    return ClosedJaxpr(dce(new), consts)


def _taken_branch(eqn: JaxprEqn, s: Callable) -> tuple[ClosedJaxpr, list] | None:
    """A `cond` whose index is a literal (diffrax's `made_jump=False`, a Python bool passed to
    `lax.cond`) is its taken branch: inlined, its other branches never run, so they need no
    inverse and store nothing."""
    if eqn.primitive is not prims.cond:
        return None
    index = s(eqn.invars[0])
    if not isinstance(index, Literal):
        return None
    branches = eqn.params["branches"]
    k = min(max(int(np.asarray(index.val)), 0), len(branches) - 1)
    return as_closed(branches[k]), list(eqn.invars[1:])


@functools.lru_cache(maxsize=65536)
def _param_key(eqn: JaxprEqn) -> tuple | None:
    """The hashable params of an equation (None: not comparable, e.g. a sub-jaxpr)."""
    if getattr(eqn, "effects", None):
        return None
    params = []
    for k, v in sorted(eqn.params.items()):
        if isinstance(v, (Jaxpr, ClosedJaxpr)):
            return None
        try:
            hash(v)
        except TypeError:
            return None
        params.append((k, v))
    return (eqn.primitive, tuple(params))


def _signature(eqn: JaxprEqn, invars: Sequence[Any]) -> tuple | None:
    """What makes two equations compute the same value (None: not comparable)."""
    key = _param_key(eqn)
    if key is None:
        return None
    ins = []
    for v in invars:
        if isinstance(v, Literal):
            val = np.asarray(v.val)
            ins.append(("lit", str(val.dtype), val.tobytes(), val.shape))
        else:
            ins.append(v)
    return (key, tuple(ins))


def without_custom_vjp(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with every `custom_vjp` call, at any depth (loop and branch bodies included),
    replaced by its primal computation; `closed` itself where it has none.

    Forward-mode AD cannot pass a `custom_vjp` function, and J⁻¹v and log-determinants are
    forward-mode quantities: they differentiate the function's own computation, not the
    user's VJP (which is only a way to compute a VJP of that same computation).
    """
    if not mentions(closed.jaxpr, _is_custom_vjp):
        return closed
    jaxpr = closed.jaxpr
    consts, constvars = list(closed.consts), list(jaxpr.constvars)
    sub: dict[Var, Any] = {}
    eqns: list[JaxprEqn] = []

    def s(a: Any) -> Any:
        return sub.get(a, a) if isinstance(a, Var) else a

    def emit(eqn: JaxprEqn, inlined: bool) -> None:
        # a custom_jvp rule over a custom_vjp function would JVP it: that one goes too
        if eqn.primitive is prims.custom_vjp_call or (
            eqn.primitive is prims.custom_jvp_call
            and mentions(call_jaxpr(eqn.params).jaxpr, _is_custom_vjp)
        ):
            inner = without_custom_vjp(call_jaxpr(eqn.params))
            for v, c in zip(inner.jaxpr.constvars, inner.consts):
                sub[v] = nv = new_var(v.aval)
                constvars.append(nv)
                consts.append(c)
            for v, a in zip(inner.jaxpr.invars, eqn.invars):
                sub[v] = s(a)
            for ie in inner.jaxpr.eqns:
                emit(ie, True)
            for o, io in zip(eqn.outvars, inner.jaxpr.outvars):
                if is_var(o):
                    sub[o] = s(io)
            return
        outs = eqn.outvars
        if inlined:  # the same inner jaxpr may be inlined twice: fresh output variables
            outs = [o if isinstance(o, DropVar) else new_var(o.aval) for o in eqn.outvars]
            for o, n in zip(eqn.outvars, outs):
                if is_var(o):
                    sub[o] = n
        params = {k: _rewrite_param(p) for k, p in eqn.params.items()}
        eqns.append(eqn.replace(invars=[s(v) for v in eqn.invars], outvars=outs, params=params))

    for eqn in jaxpr.eqns:
        emit(eqn, False)
    new = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=[s(v) for v in jaxpr.outvars])
    return ClosedJaxpr(dce(new), consts)


def _rewrite_param(p: Any) -> Any:
    if isinstance(p, ClosedJaxpr):
        return without_custom_vjp(p)
    if isinstance(p, Jaxpr):  # an open sub-jaxpr can take no new constants
        new = without_custom_vjp(ClosedJaxpr(p, ()))
        return new.jaxpr if not new.consts else p
    if isinstance(p, tuple) and p and all(isinstance(b, (ClosedJaxpr, Jaxpr)) for b in p):
        return tuple(_rewrite_param(b) for b in p)
    return p


def _is_custom_vjp(p: Any) -> bool:
    return p is prims.custom_vjp_call


def fold_constants(jaxpr: Jaxpr) -> Any:
    """The context in which jaxrev differentiates or walks `jaxpr` where what is computed
    from constants alone should stay concrete under `jit` (a scatter's indices, which lumps
    read for sparsity): `jax.ensure_compile_time_eval()`, except in a program that calls the
    host, where JAX would run a callback on constants while tracing the branch that holds it
    (Equinox's `error_if` raises on good inputs: flowjax's bisection)."""
    if mentions(jaxpr, is_host_callback):
        return contextlib.nullcontext()
    return jax.ensure_compile_time_eval()
